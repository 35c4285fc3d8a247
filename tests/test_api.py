"""Public API: argument validation, the module, and the benchmark's CPU path."""

import re

import pytest
import torch

import megamoe
from megamoe import reference
from tests.helpers import assert_close_to_reference, make_problem, run_with_grads


def good_args():
    x, idx, w, w13, w2, _ = make_problem(6, 32, 16, 4, 2, "random")
    return {"x": x, "topk_idx": idx, "topk_weights": w, "w13": w13, "w2": w2}


def call(args, **kwargs):
    return megamoe.moe(args["x"], args["topk_idx"], args["topk_weights"], args["w13"], args["w2"], **kwargs)


BAD_INPUTS = [
    # (argument, replacement, exception, message fragment)
    ("x", lambda a: a["x"].numpy(), TypeError, "x must be a torch.Tensor"),
    ("x", lambda a: a["x"][None], ValueError, "x must have 2 dimensions"),
    ("x", lambda a: a["x"].long(), TypeError, "x must have dtype"),
    ("x", lambda a: a["x"].double().to("meta"), TypeError, "x must have dtype"),  # fp64: CPU tensors only
    ("topk_idx", lambda a: a["topk_idx"].float(), TypeError, "topk_idx must have dtype"),
    ("topk_idx", lambda a: a["topk_idx"][:3], ValueError, "topk_idx must have T=6 rows"),
    ("topk_idx", lambda a: a["topk_idx"].clone().fill_(4), ValueError, "expert id 4"),
    ("topk_idx", lambda a: a["topk_idx"].clone().fill_(-2), ValueError, "expert id -2"),
    ("topk_weights", lambda a: a["topk_weights"][:, :1], ValueError, "topk_weights must have the shape"),
    ("topk_weights", lambda a: a["topk_weights"].long(), TypeError, "topk_weights must have dtype"),
    ("w13", lambda a: a["w13"].double(), TypeError, "w13 must have dtype"),
    ("w13", lambda a: a["w13"][:, :, :16].contiguous(), ValueError, "w13 must be"),
    ("w13", lambda a: a["w13"][:, :31], ValueError, "odd"),
    ("w13", lambda a: a["w13"].transpose(1, 2).contiguous().transpose(1, 2), ValueError, "w13 must be contiguous"),
    ("w2", lambda a: a["w2"][:3], ValueError, "w2 must be"),
    ("w2", lambda a: a["w2"].transpose(1, 2), ValueError, "w2 must be"),
    ("w2", lambda a: a["w2"].to("meta"), ValueError, "w2 is on meta"),
]


@pytest.mark.parametrize("name,make,exc,match", BAD_INPUTS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_named(name, make, exc, match):
    args = good_args()
    args[name] = make(args)
    with pytest.raises(exc, match=match):
        call(args)


def test_unsupported_options_raise():
    args = good_args()
    with pytest.raises(ValueError, match="precision"):
        call(args, precision="int4")
    with pytest.raises(ValueError, match="multiples of 128"):  # FP8 itself: tests/test_fp8.py
        call(args, precision="fp8")
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        call(args, group=object())
    for bad in (-1, 1.5, True, (1,), (1, 2, 3), (-1, 2), (2, True), [0, 32]):
        with pytest.raises(ValueError, match="comm_sms must be None, an int >= 0 or a pair"):
            call(args, comm_sms=bad)
    for sending in (8, (0, 8), (8, 0)):
        with pytest.raises(ValueError, match="fused expert-parallel path only"):
            call(args, comm_sms=sending)  # one device: nothing to send
    call(args, comm_sms=(0, 0))
    for bad in (0, -8, 8.0, True, "8"):
        with pytest.raises(ValueError, match="max_tokens_per_rank must be None or a positive int"):
            call(args, max_tokens_per_rank=bad)
    call(args, max_tokens_per_rank=8)  # one device: nothing to size


def test_ep_path_defaults_to_fused_where_it_runs_and_says_so_elsewhere(monkeypatch):
    """``MEGAMOE_EP``: ``auto`` (default) takes the fused protocol only where it runs (never CPU tensors, even
    under the interpreter), quietly on CPU; ``fused`` where it cannot run and a bad value are clear errors."""
    import warnings

    from megamoe.api import ep_path

    args = good_args()
    x, w2 = args["x"], args["w2"]
    monkeypatch.delenv("MEGAMOE_EP", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ep_path(x, w2) == "all_to_all"
    for value, expected in (("auto", "all_to_all"), ("all_to_all", "all_to_all")):
        monkeypatch.setenv("MEGAMOE_EP", value)
        assert ep_path(x, w2) == expected
    for value, match in (("fused", "needs CUDA tensors"), ("nccl", "MEGAMOE_EP must be auto, all_to_all or fused")):
        monkeypatch.setenv("MEGAMOE_EP", value)
        with pytest.raises(ValueError, match=match):
            ep_path(x, w2)


@pytest.mark.parametrize("name, reader, default", [
    ("MEGAMOE_AUTOTUNE", "autotune_requested", True),
    ("MEGAMOE_DEBUG", "debug_checks_enabled", False),
    ("MEGAMOE_FP8_WGRAD", "fp8_wgrad_requested", True),
    ("MEGAMOE_LOW_PEAK_BACKWARD", "low_peak_backward_requested", True),
    ("MEGAMOE_WGRAD_BY_SIZE", "wgrad_by_size_requested", True),
    ("MEGAMOE_EP_UNBOUNDED_WAITS", "ep_unbounded_waits", False),
])
def test_on_off_switches_take_0_1_or_unset_and_refuse_the_rest(monkeypatch, name, reader, default):
    """Each 0/1 environment switch: unset or empty gives its default, 0 and 1 what they say, and a value such as
    ``yes`` or ``true`` is refused naming the variable, instead of leaving the default in place unnoticed."""
    from megamoe import env

    read = getattr(env, reader)
    monkeypatch.delenv(name, raising=False)
    assert read() is default
    for value, expected in (("", default), ("0", False), ("1", True)):
        monkeypatch.setenv(name, value)
        assert read() is expected
    for bad in ("yes", "true", "2"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name} must be 0, 1 or unset, not '{bad}'"):
            read()


def test_wgrad_taken_names_the_weight_gradients_and_refuses_the_rest(monkeypatch):
    """``MEGAMOE_WGRAD_TAKEN``: unset or empty dW13 only, ``none`` neither, names of ``env.WGRAD_GEMMS`` separated by
    commas those; an unknown name, a name twice or an on/off value is refused naming the variable."""
    from megamoe.env import wgrad_taken_requested

    monkeypatch.delenv("MEGAMOE_WGRAD_TAKEN", raising=False)
    assert wgrad_taken_requested() == {"dw13"}
    for value, expected in (("", {"dw13"}), ("none", set()), ("dw2", {"dw2"}), ("dw13,dw2", {"dw13", "dw2"}),
                            ("dw2,dw13", {"dw13", "dw2"})):
        monkeypatch.setenv("MEGAMOE_WGRAD_TAKEN", value)
        assert wgrad_taken_requested() == expected, value
    for bad in ("1", "0", "dw1", "dw13,", "dw13,dw13", "DW13", "dw13 dw2"):
        monkeypatch.setenv("MEGAMOE_WGRAD_TAKEN", bad)
        with pytest.raises(ValueError, match=f"MEGAMOE_WGRAD_TAKEN must be 'none' or names of .*not '{bad}'"):
            wgrad_taken_requested()


def test_wgrad_order_switch_is_read_at_import_by_both_weight_gradient_kernels():
    """``MEGAMOE_WGRAD_BY_SIZE=0`` puts the bf16 and FP8 Gluon weight gradients' blocks in expert order for the
    process (their launchers' default, ``gluon_sm90.WGRAD_BY_SIZE``); unset, by size. ``MEGAMOE_WGRAD_TAKEN`` names
    the bf16 weight gradients whose programs take their blocks in turn (``gluon_sm90.WGRAD_TAKEN``); unset, dW13."""
    import os
    import subprocess
    import sys

    code = ("from megamoe.kernels import gluon_fp8_sm90 as f, gluon_sm90 as g; "
            "print(g.WGRAD_BY_SIZE, f.WGRAD_BY_SIZE, sorted(g.WGRAD_TAKEN))")
    for by_size, taken, expected in (("0", "none", "False False []"), ("", "", "True True ['dw13']"),
                                     ("", "dw13,dw2", "True True ['dw13', 'dw2']")):
        env = {**os.environ, "MEGAMOE_WGRAD_BY_SIZE": by_size, "MEGAMOE_WGRAD_TAKEN": taken}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.splitlines()[-1] == expected


def test_default_comm_sms_leaves_small_gpus_their_sms(monkeypatch):
    """The measured default on an H200-sized GPU; a kernel of its own (0) where 32 senders would take half
    the SMs or more (a MIG slice), instead of an error about an argument the caller never passed."""
    import types

    from megamoe.env import sm_count
    from megamoe.parallel.fused import DEFAULT_COMM_SMS, default_comm_sms

    for num_sms, expected in ((132, DEFAULT_COMM_SMS), (2 * DEFAULT_COMM_SMS, 0), (16, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index, n=num_sms: types.SimpleNamespace(multi_processor_count=n))
        sm_count.cache_clear()
        assert default_comm_sms(0) == expected
    sm_count.cache_clear()


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_moe_cpu_matches_reference(idx_dtype):
    problem = make_problem(40, 48, 24, 6, 3, "dropped", idx_dtype=idx_dtype)
    assert_close_to_reference(run_with_grads(megamoe.moe, *problem), problem)


def test_module_forward_backward_and_load_balancing():
    torch.manual_seed(0)
    layer = megamoe.MegaMoE(32, 16, 6, 2, score_func="sigmoid")
    x = torch.randn(2, 9, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    # The module is router + moe(): recompute by hand.
    logits = x.reshape(-1, 32) @ layer.gate.weight.t()
    idx, w = megamoe.routing.route(logits, 2, score_func="sigmoid", expert_bias_E=layer.expert_bias)
    ref = reference.moe_loop(x.reshape(-1, 32), idx, w, layer.w13, layer.w2)
    torch.testing.assert_close(y.reshape(-1, 32), ref, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    assert layer.gate.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    assert layer.tokens_per_expert.sum() == 18 * 2
    counts = layer.tokens_per_expert.clone()
    layer.update_expert_bias(coeff=0.01)
    expected = 0.01 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.expert_bias, expected - expected.mean())
    assert layer.tokens_per_expert.sum() == 0
    layer.eval()
    layer(x)
    assert layer.tokens_per_expert.sum() == 0  # eval does not count


def test_a_view_of_x_gives_the_numbers_of_its_copy():
    """Activations arrive as views (here a slice of a wider tensor): moe and MegaMoE take them and compute what
    they compute on a contiguous copy, gradients included."""
    x, idx, w, w13, w2, dy = make_problem(6, 32, 16, 4, 2, "random")
    view = torch.cat([x, torch.randn(6, 8)], dim=1)[:, :32]
    assert not view.is_contiguous()
    for got, want in zip(run_with_grads(megamoe.moe, view, idx, w, w13, w2, dy),
                         run_with_grads(megamoe.moe, x, idx, w, w13, w2, dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.manual_seed(0)
    layer = megamoe.MegaMoE(32, 16, 4, 2)
    wide = torch.randn(2, 3, 40)
    torch.testing.assert_close(layer(wide[..., :32]), layer(wide[..., :32].contiguous()), rtol=0, atol=0)


def test_fp64_on_cpu_passes_gradcheck():
    """fp64 CPU tensors run the reference implementation, so torch.autograd.gradcheck can check every gradient
    (x, routing weights, w13, w2; dropped slots included)."""
    x, idx, w, w13, w2, _ = make_problem(5, 8, 4, 3, 2, "dropped", dtype=torch.float64)
    inputs = [t.double().requires_grad_() for t in (x, w, w13, w2)]
    assert torch.autograd.gradcheck(lambda *a: megamoe.moe(a[0], idx, *a[1:]), inputs)
    torch.testing.assert_close(megamoe.moe(x, idx, w.double(), w13, w2),
                               reference.moe_loop(x, idx, w.double(), w13, w2), rtol=1e-12, atol=1e-12)
    torch.manual_seed(0)
    layer = megamoe.MegaMoE(8, 4, 3, 2, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    y = layer(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, layer.float()(x.float()).double(), rtol=1e-5, atol=1e-6)


def test_reference_path_compiles_on_cpu(monkeypatch):
    """torch.compile(megamoe.moe, fullgraph=True) on fp32 CPU tensors: the reference path's grouped GEMMs compile
    (torch._grouped_mm would not: bf16 only on CPU) and give the eager numbers and gradients."""
    monkeypatch.undo()  # the real torch.empty_like: Dynamo does not trace the poisoning stand-in (conftest.py)
    # ... and forgets the map of torch functions it may have built while the stand-in was installed (an earlier
    # test's first trace), in which the real torch.empty_like is missing, "marked as skipped".
    torch._dynamo.trace_rules.clear_lru_cache()
    monkeypatch.setenv("MEGAMOE_BACKEND", "reference")
    problem = make_problem(40, 48, 24, 6, 3, "dropped")
    compiled = torch.compile(megamoe.moe, fullgraph=True, backend="aot_eager")
    for got, want in zip(run_with_grads(compiled, *problem), run_with_grads(megamoe.moe, *problem)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def test_reference_grouped_mm_op_is_a_well_formed_custom_op():
    """The CPU grouped GEMM (megamoe::grouped_mm_per_group): schema, fake tensor, autograd registration."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(20, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 8, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([8, 8, 16], dtype=torch.int32)  # an empty group; rows 16.. belong to none
    torch.library.opcheck(reference.grouped_mm_per_group, (a, b, offs))
    out = reference.grouped_mm_per_group(a, b, offs)
    torch.testing.assert_close(out, torch.cat([a[:8] @ b[0], a[8:16] @ b[2], torch.zeros(4, 5, dtype=a.dtype)]))
    assert torch.autograd.gradcheck(reference.grouped_mm_per_group, (a, b, offs))


def test_repr_names_the_dtype_that_runs():
    layer = megamoe.MegaMoE(32, 16, 4, 2, dtype=torch.float32)
    assert "dtype=float32" in repr(layer) and "bf16" not in repr(layer)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"top_k": 7}, ValueError, "top_k"), ({"score_func": "tanh"}, ValueError, "score_func"),
    ({"hidden_size": 0}, ValueError, "hidden_size"), ({"precision": "fp4"}, ValueError, "precision"),
    ({"ep_group": object()}, TypeError, "ep_group"), ({"dtype": torch.float64, "device": "meta"}, TypeError, "dtype must be"),
    ({"dtype": torch.int32}, TypeError, "dtype must be"),
    ({"comm_sms": -1}, ValueError, "comm_sms must be"), ({"max_tokens_per_rank": 0}, ValueError, "max_tokens_per_rank"),
])
def test_module_rejects_bad_config(kwargs, exc, match):
    args = {"hidden_size": 32, "intermediate_size": 16, "num_experts": 6, "top_k": 2, **kwargs}
    with pytest.raises(exc, match=match):
        megamoe.MegaMoE(**args)


def test_module_names_an_input_of_another_dtype():
    layer = megamoe.MegaMoE(32, 16, 6, 2)
    with pytest.raises(TypeError, match="x has dtype torch.float16 but the layer's weights are torch.float32"):
        layer(torch.randn(3, 32, dtype=torch.float16))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([[0.0] * 32])


def test_bf16_in_the_interpreter_is_refused_not_wrong(monkeypatch):
    """Triton 3.6's interpreter computes bf16 dots wrongly (rel. error ~1e10): the fused path refuses bf16 CPU
    tensors there with a clear error; without the interpreter the same call runs the reference and is right."""
    x, idx, w, w13, w2, _ = make_problem(6, 32, 16, 4, 2, "random", dtype=torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(TypeError, match="bfloat16 on the CPU under TRITON_INTERPRET=1"):
        megamoe.moe(x, idx, w, w13, w2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    y = megamoe.moe(x, idx, w, w13, w2)
    ref = reference.moe_loop(x, idx, w, w13, w2, fp32=True)
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_module_rejects_wrong_width():
    with pytest.raises(ValueError, match="hidden_size=32"):
        megamoe.MegaMoE(32, 16, 6, 2)(torch.randn(3, 31))


def test_benchmark_cpu_path_checks_correctness(capsys):
    from megamoe.bench.cli import main

    if torch.cuda.is_available():
        pytest.skip("the CPU path runs only without a GPU")
    main([])
    out = capsys.readouterr().out
    assert "timings need a GPU" in out and "Ignored" not in out
    assert "OK" in out and "megamoe" in out and "precision=fp8" in out
    main(["--preset", "qwen3-235b-a22b", "--tokens", "64", "--routing", "skewed"])
    out = capsys.readouterr().out  # the options the check cannot honour are named; the routing is honoured
    assert "Ignored without a GPU: --preset, --tokens" in out and "skewed routing" in out and "OK" in out


def test_benchmark_cpu_path_fails_a_wrong_fp8_answer(monkeypatch):
    """The CPU check's FP8 line can fail: an FP8 path 50% off the recipe exits with the measure named."""
    from megamoe.bench.cli import main

    if torch.cuda.is_available():
        pytest.skip("the CPU path runs only without a GPU")
    moe = megamoe.moe

    def off(*args, precision="bf16", **kwargs):
        y = moe(*args, precision=precision, **kwargs)
        return y * 1.5 if precision == "fp8" else y

    monkeypatch.setattr(megamoe, "moe", off)
    with pytest.raises(SystemExit, match="twice its recipe's own error"):
        main([])


@pytest.mark.gpu
def test_benchmark_gpu_path_writes_results_and_profile(tmp_path):
    """``python -m megamoe.bench --profile`` on a tiny problem: the JSON has every impl's times, error and
    timing window (UTC, one impl after the other), and the per-kernel tables name every impl."""
    import json

    from megamoe.bench.cli import main
    from megamoe.bench.common import utc_now

    before = utc_now()
    main(["--preset", "tiny", "--tokens", "64", "--impls", "grouped_mm,megamoe", "--profile", "--no-plot",
          "--rep-ms", "5", "--out", str(tmp_path)])
    info = json.loads((tmp_path / "tiny-t64-random-ep1.json").read_text())
    assert [r["impl"] for r in info["results"]] == ["grouped_mm", "megamoe"]
    for r in info["results"]:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["max_rel_err"] < 2e-2
    windows = [t for r in info["results"] for t in r["timed_utc"]]
    assert before <= windows[0] and windows == sorted(windows) and windows[-1] <= utc_now()
    tables = (tmp_path / "tiny-t64-random-ep1-profile.txt").read_text()
    act = "_act_ws_kernel" if torch.cuda.get_device_capability()[0] == 9 else "_act_bwd_kernel"  # gluon_sm90.py
    assert "===== grouped_mm" in tables and "===== megamoe" in tables and act in tables
    assert "ms wall per call" in tables and "----- megamoe: host side" in tables and "cudaLaunchKernel" in tables


@pytest.mark.gpu
def test_benchmark_rounds_write_every_round(tmp_path):
    """``--rounds 2`` on a tiny problem: each impl's times are the medians of its two rounds, both kept."""
    import json
    import statistics

    from megamoe.bench.cli import main

    main(["--preset", "tiny", "--tokens", "64", "--impls", "grouped_mm,megamoe", "--rounds", "2", "--no-plot",
          "--rep-ms", "5", "--out", str(tmp_path)])
    info = json.loads((tmp_path / "tiny-t64-random-ep1.json").read_text())
    assert info["rounds"] == 2
    for r in info["results"]:
        assert len(r["fwd_bwd_ms_rounds"]) == len(r["timed_utc_rounds"]) == 2
        assert r["fwd_bwd_ms"] == statistics.median(r["fwd_bwd_ms_rounds"]) > 0


def test_benchmark_rounds_take_turns_and_report_each_impls_median(monkeypatch):
    """The layer benchmark's rounds: with N > 1 every impl is set up first, then timed once per round in turn; its
    times are the medians over the rounds (each round's kept), its step follows from them; with 1, one impl after
    the other."""
    from types import SimpleNamespace

    from megamoe.bench import layer

    events = []
    times = {"a": [3.0, 1.0, 2.0], "b": [5.0, 6.0, 4.0]}

    given = []

    def set_up(impl, problem, leaves):
        events.append(("set up", impl.name))
        given.append(leaves)
        return SimpleNamespace(impl=impl, left=iter(times[impl.name]))

    def time_once(timed, rep_ms):
        events.append(("time", timed.impl.name))
        ms = next(timed.left)
        return {"fwd_ms": ms, "fwd_bwd_ms": 2 * ms, "timed_utc": [f"{len(events)}<", f"{len(events)}>"]}

    monkeypatch.setattr(layer, "set_up", set_up)
    monkeypatch.setattr(layer, "time_once", time_once)
    monkeypatch.setattr(layer, "memory", lambda timed: {"saved_activation_bytes": 0, "peak_extra_bytes": 0})
    impls = [layer.Impl("a", None, keeps_activations=True), layer.Impl("b", None, keeps_activations=False)]
    problem = tuple(torch.full((2,), float(i)) for i in range(6))  # x, topk_idx, topk_weights, w13, w2, dy
    a, b = layer.time_impls(impls, problem, rep_ms=5, rounds=3)
    assert events == [("set up", "a"), ("set up", "b")] + [("time", "a"), ("time", "b")] * 3
    # one set of leaf copies (x, routing weights, w13, w2) for all impls: N impls hold the weights once
    assert given[0] is given[1] and [t[0].item() for t in given[0]] == [0.0, 2.0, 3.0, 4.0]
    assert all(t.requires_grad and t.is_leaf for t in given[0])
    assert not any(t.data_ptr() == p.data_ptr() for t, p in zip(given[0], problem[:1] + problem[2:5]))
    assert (a["fwd_ms"], a["fwd_bwd_ms"], a["ac_step_ms"]) == (2.0, 4.0, 6.0)  # keeps activations: fwd + fwd+bwd
    assert (b["fwd_ms"], b["fwd_bwd_ms"], b["ac_step_ms"]) == (5.0, 10.0, 10.0)
    assert a["fwd_ms_rounds"] == [3.0, 1.0, 2.0] and b["fwd_bwd_ms_rounds"] == [10.0, 12.0, 8.0]
    assert a["timed_utc"] == ["3<", "7>"] and a["timed_utc_rounds"] == [["3<", "3>"], ["5<", "5>"], ["7<", "7>"]]
    events.clear()
    a, b = layer.time_impls(impls, problem, rep_ms=5)
    assert events == [("set up", "a"), ("time", "a"), ("set up", "b"), ("time", "b")]
    assert a["fwd_bwd_ms"] == 6.0 and "fwd_ms_rounds" not in a
    with pytest.raises(ValueError, match="at least 1"):
        layer.time_impls(impls, problem, rep_ms=5, rounds=0)


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "argument --rounds: must be at least 1, not 0"),
    (["--ep", "--rounds", "2"], "--rounds is the layer benchmark's"),
    (["--tokens", "16384,0"], "argument --tokens: must be at least 1, not 0"),
    (["--rep-ms", "-1"], "argument --rep-ms: must be at least 1"),
    (["--impls", "megamoe,foo"], "--impls: ['foo'] not among the layer benchmark's"),
    (["--ep", "--impls", "megamoe"], "--impls: ['megamoe'] not among the expert-parallel benchmark's"),
    (["--loopback", "2", "--comm-sms", "4"], "--comm-sms, --loopback: the expert-parallel benchmark's options"),
    (["--ep", "--loopback", "-1"], "argument --loopback: must be at least 0, not -1"),
    (["--ep", "--comm-sms-split", "1:x"], "argument --comm-sms-split: not an integer: 'x'"),
    (["--ep", "--rep-ms", "100", "--no-plot"], "--rep-ms: the layer benchmark's options"),
    (["--ep", "--loopback", "1", "--ep-iters", "5"], "--ep-iters: options of the expert-parallel benchmark on torchrun"),
])
def test_benchmark_refuses_arguments_it_cannot_run(argv, message, capsys):
    """Each in argparse's one line, before anything is set up (no traceback, no GPU needed)."""
    from megamoe.bench.cli import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.startswith("python -m megamoe.bench: error: ") and message in last, last
    assert "Traceback" not in err


def test_benchmark_on_a_gpu_without_matplotlib_says_so_before_it_runs(monkeypatch, capsys):
    """The layer benchmark's PNG needs matplotlib, which a GPU machine's own python may lack (scripts/setup.sh
    installs nothing there): the run stops at once saying how to get it or skip the PNG, not after its first JSON."""
    import importlib.util

    from megamoe.bench import cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        cli.parse_args([])
    assert "the PNG needs matplotlib: pip install -e '.[bench]', or pass --no-plot" in capsys.readouterr().err
    assert cli.parse_args(["--no-plot"]).no_plot and cli.parse_args(["--ep"]).ep


def test_benchmark_impls(capsys):
    """Every impl name the benchmark offers builds (an optional peer that is not installed is skipped, saying
    so); the CUDA-graph variant times the same function."""
    import importlib.util

    from megamoe.bench.layer import IMPLS, make_impls

    impls = {impl.name: impl for impl in make_impls([n for n in IMPLS if n != "liger"], "cpu")}
    if importlib.util.find_spec("sonicmoe") is None:
        assert "sonicmoe" not in impls and "sonicmoe: skipped, not importable" in capsys.readouterr().out
    else:
        assert impls["sonicmoe"].keeps_activations
    assert impls["megamoe_cudagraph"].cuda_graph and not impls["megamoe"].cuda_graph
    assert impls["megamoe_cudagraph"].fn is impls["megamoe"].fn is megamoe.moe
    with pytest.raises(ValueError, match="unknown impl"):
        make_impls(["megamoe_eager"], "cpu")


def test_host_time_probe_times_both_paths_and_restores_the_launcher(capsys):
    """``python -m tools.host`` (kernels stubbed out); afterwards the kernels run again."""
    import os

    import triton.runtime.interpreter

    from tools.host import main

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the probe stubs the interpreter's launches")
    run = triton.runtime.interpreter.InterpretedFunction.run
    main(["--tokens", "64", "--steps", "10", "--reps", "1", "--cprofile", "5"])
    out = capsys.readouterr().out
    assert "eager (megamoe.moe)" in out and "custom ops" in out
    assert "Ordered by: internal time" in out and "due to restriction <5>" in out  # the cProfile listing, 5 rows
    assert triton.runtime.interpreter.InterpretedFunction.run is run
    with pytest.raises(SystemExit, match="either --gpu"):
        main(["--gpu"])  # real launches under the interpreter: refused


@pytest.mark.gpu
def test_per_kernel_benchmark_records_every_stage_and_its_config(tmp_path):
    """``python -m tools.kernels``: every stage timed, each GEMM's config recorded (on sm90 those of
    the up kernel, dh', the act kernel and the weight gradients are the warp-specialized kernels', the weight
    gradients' with their ring of 6 stages of BK 32; the weight gradients' other orders, dh' alone and with x's copy
    alone beside, the same bits)."""
    import json

    from tools.kernels import ORDERS, PARTS, layer_order, main

    main(["--tokens", "256", "--json", str(tmp_path / "k.json")])
    rows = {r["stage"]: r for r in json.loads((tmp_path / "k.json").read_text())["stages"]}
    assert {"plan", "fwd up+swiglu", "fwd up+swiglu, products stored", "bwd gather, dh'", "bwd recompute+act",
            "bwd dw13", "bwd dx combine", "bwd dw13, combine", "bwd dw2"} <= set(rows)
    assert all(r["ms"] > 0 and len(r["timed_utc"]) == 2 for r in rows.values())
    assert rows["fwd up+swiglu"]["config"]["BM"] in (64, 128)
    if torch.cuda.get_device_capability()[0] == 9:
        for stage in ("fwd up+swiglu", "fwd up+swiglu, products stored", "bwd gather, dh'", "bwd recompute+act",
                      "bwd dw13", "bwd dw13, combine", "bwd dw2"):
            assert rows[stage]["config"]["WARP_SPECIALIZED"], stage
        for stage in ("bwd dw13", "bwd dw13, combine", "bwd dw2"):
            assert (rows[stage]["config"]["BK"], rows[stage]["config"]["num_stages"]) == (32, 6), stage
            for name, (suffix, _) in ORDERS.items():  # the blocks' other orders beside, the same bits
                if name != layer_order("dw2" if stage == "bwd dw2" else "dw13"):
                    other = rows[stage + suffix]
                    assert other["ms"] > 0 and other["bitwise_equal"], stage + suffix
        for stage in ("fwd down", "bwd dx"):
            assert not rows[stage]["config"].get("WARP_SPECIALIZED"), stage
        for suffix in PARTS:  # dh' without the copies beside it, and with x's alone: the stage's dh'
            part = rows["bwd gather, dh'" + suffix]
            assert part["ms"] > 0 and part["bitwise_as"] == "bwd gather, dh', output 2" and part["bitwise_equal"]


@pytest.mark.gpu
def test_host_time_probe_on_the_gpu(capsys):
    """``python -m tools.host --gpu``: the 30B layer's steps with real launches; the cProfile
    listing shows Triton's launcher, which the stubbed mode leaves out."""
    from tools.host import main

    main(["--gpu", "--tokens", "64", "--steps", "10", "--reps", "1", "--cprofile", "20", "--stages"])
    out = capsys.readouterr().out
    assert "kernels on" in out and "eager (megamoe.moe)" in out and "custom ops" in out
    assert "due to restriction <20>" in out and "/triton/" in out  # Triton's launch path is in the listing
    stages = out.split("host time per call of each stage")[1]
    for name in ("triton kernel, one pointer", "torch.add", "fwd up+swiglu", "bwd dw2"):
        assert float(stages.split(name)[1].split()[0]) > 0
    with pytest.raises(SystemExit, match="either --gpu"):
        main([])  # neither mode chosen: no TRITON_INTERPRET on a GPU machine


def test_kernels_tool_totals_follow_the_layers_mode_and_backward_order():
    """``tools.kernels.layer_totals``: each memory mode's total holds its own stages and the backward order's (low
    peak: dW13 alone and dx's combine on its own; dx first: the combine inside dW13), never a variant or a part."""
    from tools.kernels import layer_totals

    ms = {"plan": 1, "fwd up+swiglu": 10, "fwd up+swiglu, products stored": 20, "bwd recompute+act": 100,
          "bwd act on the products": 200, "bwd dw13": 1000, "bwd dx combine": 2000, "bwd dw13, combine": 4000,
          "bwd dw13 (blocks in expert order)": 8000, "bwd dw13, combine (blocks by size)": 16000,
          "bwd gather, dh' (the GEMM alone)": 32000, "bwd gather, dh' (the kernel with x's copy)": 64000}
    rows = [{"stage": stage, "ms": v} for stage, v in ms.items()]
    assert layer_totals(rows, True) == {"none": 3111, "preact": 3221}
    assert layer_totals(rows, False) == {"none": 4111, "preact": 4221}


def test_the_tools_compare_outputs_bit_for_bit():
    """``tools.kernels.same_outputs``: equal bits are equal even where they are NaNs or e4m3; one bit apart, a
    tuple of another length or a tensor of another dtype's bits are not."""
    from tools.kernels import same_outputs

    a = torch.tensor([1.0, float("nan"), -0.0])
    q = torch.tensor([0.5, -3.0]).to(torch.float8_e4m3fn)
    assert same_outputs(a, a.clone()) and same_outputs((a, q), (a.clone(), q.clone()))
    assert not same_outputs(a, torch.tensor([1.0, float("nan"), 0.0]))  # -0.0 and 0.0: equal values, other bits
    assert not same_outputs((a, q), (a,)) and not same_outputs(a, a.view(torch.int32))


def test_kernels_tool_ceilings_do_each_gemm_stages_work():
    """``tools.kernels``' cuBLAS ceiling beside each GEMM stage does that stage's FLOPs (the rows shared evenly by
    the experts), and only GEMM stages have one; the saved mode's act step reads the products its up stage stored.
    On the GPU where there is one (the Triton kernels take no CPU tensors there), else in the interpreter."""
    from megamoe.bench.common import make_problem
    from tools.kernels import dense_shapes, stages

    dim, inter, num_experts, top_k = 64, 32, 4, 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    problem = make_problem(64, dim, inter, num_experts, top_k, "random", torch.float32, device, 0)
    shapes = dense_shapes(int((problem[1] >= 0).sum()), num_experts, dim, inter)
    table = stages(problem, num_experts)
    assert {name for name, (_, flops, _) in table.items() if flops} == shapes.keys()
    for name, (batch, m, n, k) in shapes.items():
        assert 2 * batch * m * n * k == table[name][1], name
    # the saved mode's act step runs on the products the up kernel stored: its dz is the recompute's
    dz_saved = table["bwd act on the products"][0]()[0]
    dz_recomputed = table["bwd recompute+act"][0]()[0]
    assert torch.allclose(dz_saved, dz_recomputed, rtol=1e-4, atol=1e-5)


def test_fp8_tool_times_the_stages_asked_for_and_refuses_a_name_it_lacks():
    """``python -m tools.fp8 --stages``: the stages whose names contain a given part, in the table's order; a part
    that names no stage stops the tool before any timing."""
    from tools.fp8 import select_stages

    stages = [("down", 1), ("down (issue-ahead)", 2), ("dh'", 3), ("dx", 4), ("dW13 FP8", 5)]
    assert select_stages(stages, None) == stages
    assert select_stages(stages, ["DX", "down"]) == [("down", 1), ("down (issue-ahead)", 2), ("dx", 4)]
    with pytest.raises(SystemExit, match="no stage's name contains"):
        select_stages(stages, ["dx", "dW3"])


def test_fp8_tool_checks_each_scheduling_variant_bitwise_against_the_layers(monkeypatch, tmp_path):
    """``python -m tools.fp8``'s table through the interpreter (timer and dense matmul stubbed): each variant that
    changes only when its kernel's instructions run is compared with the layer's own variant of its GEMM, and
    recorded; a variant that wrote other bits would stop the command, after its record is written. With ``--rounds``
    every stage's times are kept, their median reported."""
    import json

    import triton.testing

    from megamoe.bench import common
    from megamoe.kernels import expert_bwd, gluon_sm90
    from tools import fp8
    from tools.kernels import ORDERS

    if torch.cuda.is_available():
        pytest.skip("the interpreter's run of a GPU tool (on a GPU the tool itself runs)")
    monkeypatch.setitem(common.PRESETS, "tiny-fp8", (256, 256, 4, 2))  # D and I take the 256-column variants
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    monkeypatch.setattr(fp8, "scaled_mm_tflops", lambda m, n, k: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stub")
    args = ["--preset", "tiny-fp8", "--tokens", "64", "--out", str(tmp_path)]
    fp8.main(args + ["--stages", "up,down,dW2 FP8,over the layer,per expert", "--rounds", "2"], device="cpu")
    record = json.loads(next(tmp_path.glob("fp8-kernels-tiny-fp8-t64-some-stages.json")).read_text())
    assert record["rounds"] == 2 and all(r["ms_rounds"] == [1.0, 1.0] and r["ms"] == 1.0 for r in record["stages"])
    checked = {r["stage"]: r["bitwise_as"] for r in record["stages"] if "bitwise_as" in r}
    # dW13 with x's scales over the layer computes other sums than the recipe's: timed, checked against nothing
    layer_scales = [r["stage"] for r in record["stages"] if "over the layer" in r["stage"]]
    assert layer_scales == ["dW13, x's scales over the layer (FP8)", "dW13, x's scales over the layer (FP8, 256 columns)",
                            "the same, x's scales over the layer"]
    assert not set(layer_scales) & set(checked)
    per_expert = [r["stage"] for r in record["stages"] if "per expert" in r["stage"]]
    assert per_expert == ["wgrad: x's channel amax per expert (N, D) from the tokens' rows",
                          "the same, x's scales per expert"] and not set(per_expert) & set(checked)
    assert all(r["bitwise_equal"] for r in record["stages"] if "bitwise_as" in r)
    assert checked["up, products stored"] == "up (+ SwiGLU, h quantised)"
    other_order = "dW2 FP8 (256 columns)" + ORDERS["expert" if gluon_sm90.WGRAD_BY_SIZE else "size"][0]
    assert checked["down"] == "down (256 columns)"
    assert checked[other_order] == checked["dW2 FP8"] == "dW2 FP8 (256 columns)"
    assert "up (+ SwiGLU, h quantised)" not in checked and "down (256 columns)" not in checked  # the layer's own
    # One variant that writes other bits: named, and the command fails once its record is written
    wgrad = expert_bwd.wgrad_fp8

    def other_order_off_by_one(*a, **kw):
        dw = wgrad(*a, **kw)
        return dw + 1 if kw.get("by_size") is not None else dw  # (only the other order's stage passes by_size)

    monkeypatch.setattr(expert_bwd, "wgrad_fp8", other_order_off_by_one)
    for old in tmp_path.iterdir():
        old.unlink()
    differs = r"do not write bitwise.*" + re.escape(other_order)
    with pytest.raises(SystemExit, match=differs):
        fp8.main(args + ["--stages", "dW2 FP8 (256"], device="cpu")
    assert any(tmp_path.iterdir())
