"""megamoe inside Hugging Face transformers: a small random-initialised Qwen3-MoE model (no hub download) with
``experts_implementation="megamoe"`` against transformers' own ``"eager"`` and ``"grouped_mm"`` experts — logits,
loss and every parameter's gradient — and the refusals of expert layouts megamoe does not compute. On CPU the
fused kernels run in the interpreter in fp32; on a GPU the model is bf16."""

import copy
import sys

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import megamoe
import megamoe.integrations.transformers as hf_megamoe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_model(dtype=torch.float32, seed=0, device=DEVICE, hidden_size=64, moe_intermediate_size=32, layers=2
               ) -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE of ``layers`` decoder layers, 8 experts, top-2 (``hidden_size`` / ``moe_intermediate_size``: 128
    for FP8's groups)."""
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=hidden_size, intermediate_size=96,
                            moe_intermediate_size=moe_intermediate_size,
                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
                            attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype)


def step(model, implementation: str, input_ids):
    """(logits, loss, {parameter name: gradient}) of one forward+backward with ``implementation``'s experts."""
    model = copy.deepcopy(model)
    model.set_experts_implementation(implementation)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_registered_and_selectable():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["megamoe"] is hf_megamoe.megamoe_experts_forward
    model = tiny_model()
    model.set_experts_implementation("megamoe")
    assert model.config._experts_implementation == "megamoe"


@pytest.mark.parametrize("baseline", ["eager", "grouped_mm"])
def test_model_matches_transformers_experts_fp32(baseline):
    """fp32 (CPU: the interpreter's exact fp32 products): the same logits, loss and gradients to rounding."""
    model = tiny_model()
    input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref_logits, ref_loss, ref_grads = step(model, baseline, input_ids)
    logits, loss, grads = step(model, "megamoe", input_ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        ref = ref_grads[name]
        assert grad is not None and ref is not None, name
        scale = ref.abs().max().item()
        assert (grad - ref).abs().max().item() <= 1e-4 * max(scale, 1e-6), name


def test_whole_model_compiles_fullgraph_without_recompiles():
    """The model with megamoe experts under ``torch.compile(fullgraph=True)``: no graph break anywhere, no
    recompile when the per-expert counts change between steps, and the eager model's loss and gradients
    (aot_eager on CPU: the same kernels; the GPU test uses the default backend)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model()
    model.set_experts_implementation("megamoe")
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    for seed in range(3):  # a new batch, so new routing, every step
        input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            out = compiled(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        ref = model(input_ids=input_ids, labels=input_ids)
        ref.loss.backward()
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(compiled_model.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
            p.grad, q.grad = None, None


def test_expert_parallel_sentinels_contribute_nothing():
    """Ids >= num_experts (transformers' "not on this rank") are dropped slots: the output is that of the
    remaining slots, and their routing weights get zero gradient."""
    model = tiny_model()
    experts = model.model.layers[0].mlp.experts
    experts.config._experts_implementation = "megamoe"
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, 64, generator=gen).to(DEVICE)
    idx = torch.randint(0, 8, (10, 2), generator=gen).to(DEVICE)
    w = torch.rand(10, 2, generator=gen).to(DEVICE).requires_grad_()
    sentinel = idx.clone()
    sentinel[:, 1] = 8  # every token's second slot is another rank's
    y = hf_megamoe.megamoe_experts_forward(experts, x, sentinel, w)
    expected = hf_megamoe.megamoe_experts_forward(experts, x, idx[:, :1], w[:, :1])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert torch.equal(w.grad[:, 1], torch.zeros_like(w.grad[:, 1]))


def test_saved_mode_through_the_integration_gives_the_same_gradients(monkeypatch):
    """``set_save_for_backward(model, "preact")``: every experts call asks megamoe to keep the gate/up products,
    and the model's loss and every gradient equal the keep-nothing run's; a bad mode is refused."""
    model = tiny_model()
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    _, loss, grads = step(model, "megamoe", input_ids)
    saved = copy.deepcopy(model)
    hf_megamoe.set_save_for_backward(saved, "preact")
    modes, moe = [], megamoe.moe
    monkeypatch.setattr(megamoe, "moe", lambda *a, **k: modes.append(k["save_for_backward"]) or moe(*a, **k))
    _, saved_loss, saved_grads = step(saved, "megamoe", input_ids)
    assert modes == ["preact"] * saved.config.num_hidden_layers
    assert torch.equal(saved_loss, loss)
    for name, g in grads.items():
        torch.testing.assert_close(saved_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="save_for_backward must be one of"):
        hf_megamoe.set_save_for_backward(saved, "everything")


def test_inference_without_grad_keeps_nothing():
    model = tiny_model()
    model.set_experts_implementation("megamoe")
    input_ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert not logits.requires_grad and torch.isfinite(logits).all()


@pytest.mark.parametrize("attribute, value, match", [
    ("has_bias", True, "biases"),
    ("is_transposed", True, "transposed"),
    ("is_concatenated", False, "interleaves"),
    ("has_gate", False, "no gate"),
])
def test_layouts_megamoe_does_not_compute_are_refused(attribute, value, match):
    experts = tiny_model().model.layers[0].mlp.experts
    setattr(experts, attribute, value)
    x, idx, w = torch.randn(4, 64).to(DEVICE), torch.zeros(4, 2, dtype=torch.long).to(DEVICE), torch.ones(4, 2).to(DEVICE)
    with pytest.raises(ValueError, match=match):
        hf_megamoe.megamoe_experts_forward(experts, x, idx, w)


def test_other_activations_and_gates_are_refused(monkeypatch):
    experts = tiny_model().model.layers[0].mlp.experts
    x, idx, w = torch.randn(4, 64).to(DEVICE), torch.zeros(4, 2, dtype=torch.long).to(DEVICE), torch.ones(4, 2).to(DEVICE)
    monkeypatch.setattr(experts.config, "hidden_act", "gelu")
    with pytest.raises(ValueError, match="'gelu' activation"):
        hf_megamoe.megamoe_experts_forward(experts, x, idx, w)
    monkeypatch.setattr(experts.config, "hidden_act", "silu")
    monkeypatch.setattr(type(experts), "_apply_gate", lambda self, gate_up: gate_up.chunk(2, dim=-1)[0].clamp(max=7))
    with pytest.raises(ValueError, match="its own gating function"):
        hf_megamoe.megamoe_experts_forward(experts, x, idx, w)


@pytest.mark.gpu
def test_model_matches_transformers_experts_bf16_gpu():
    """bf16 on the GPU: megamoe's logits, loss and gradients against the fp32 model are within twice the error of
    transformers' own bf16 grouped_mm experts (plus a small atol)."""
    model32 = tiny_model(torch.float32)
    input_ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref_logits, ref_loss, ref_grads = step(model32, "eager", input_ids)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    low_logits, low_loss, low_grads = step(model16, "grouped_mm", input_ids)
    logits, loss, grads = step(model16, "megamoe", input_ids)
    for name, out, low, ref in [("logits", logits, low_logits, ref_logits), ("loss", loss, low_loss, ref_loss),
                                *((n, grads[n], low_grads[n], ref_grads[n]) for n in ref_grads)]:
        err = (out.float() - ref).abs().max().item()
        bound = 2 * (low.float() - ref).abs().max().item() + 1e-3 * max(ref.abs().max().item(), 1e-6)
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"


@pytest.mark.gpu
def test_model_benchmark_profiles_each_cell(tmp_path):
    """``--profile``: each cell's per-kernel table, in one text file next to the JSON (which holds none of it)."""
    import json

    from megamoe.bench import model

    model.main(["--preset", "tiny", "--layers", "1", "--tokens", "256", "--iters", "2", "--experts",
                "megamoe,grouped_mm", "--checkpoint", "--compile", "--profile", "--out", str(tmp_path)])
    [record] = tmp_path.glob("*.json")
    assert all("_profile" not in r and r["step_ms"] > 0 for r in json.loads(record.read_text())["results"])
    tables = record.with_name(record.stem + "-profile.txt").read_text()
    for experts in ("megamoe", "grouped_mm"):  # a table per cell, under the cell's name
        assert f"===== {model.cell_name(True, 'layers', experts)} (5 calls" in tables, experts
    assert tables.count("Self CUDA") >= 2


def test_model_benchmark_checks_the_implementations_without_a_gpu(capsys, monkeypatch):
    """``python -m megamoe.bench.model`` on CPU: one step of the tiny model per implementation (with checkpointing:
    megamoe under its helper, the others plain), each one's loss and gradients against megamoe's; a disagreement
    fails."""
    from megamoe.bench import model

    if torch.cuda.is_available():
        pytest.skip("the CPU path runs only without a GPU")
    model.main(["--checkpoint", "--experts", "megamoe,grouped_mm,eager"])
    out = capsys.readouterr().out
    assert "timings need a GPU" in out and "OK" in out
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()
            if line.startswith("  ") and line.split()[0] in ("megamoe", "grouped_mm", "eager")}
    assert len(rows["megamoe"]) == 1 and rows["megamoe"][0] > 0
    for name in ("grouped_mm", "eager"):  # loss, |loss diff|, max grad diff
        loss, loss_diff, grad_diff = rows[name]
        assert loss == pytest.approx(rows["megamoe"][0], rel=1e-5) and loss_diff < 1e-4 and grad_diff < 1e-3
    one_step = model.loss_and_grads

    def eager_off_by_one_percent(m, ids):
        loss, grads = one_step(m, ids)
        scale = 1.01 if m.config._experts_implementation == "eager" else 1.0
        return loss, {n: g * scale for n, g in grads.items()}

    monkeypatch.setattr(model, "loss_and_grads", eager_off_by_one_percent)
    with pytest.raises(SystemExit, match="1"):
        model.main(["--experts", "megamoe,eager"])
    assert "FAILED" in capsys.readouterr().out


def test_model_benchmark_optimizer_step_keeps_the_weights_and_counts_as_a_step(monkeypatch):
    """``--optimizer-step``'s step (``bench.model.step_fn``): an optimizer's step per training step, which leaves
    every weight bit for bit as it was (the timed steps keep computing the same) and counts as an optimizer step for
    the FP8 weight copies (it drops them: they are made again at the next step); without it, none. The flag is
    refused without a GPU, where nothing is timed."""
    from megamoe.bench import model
    from megamoe.kernels import quant
    from megamoe.models import build

    net = model.prepared(build("tiny", 2, 128, torch.float32, "cpu"), "megamoe", False, None, DEVICE)
    input_ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    fp8_shaped = torch.randn(1, 128, 128, device=DEVICE)
    quant.clear_weight_cache()
    for optimizer_step in (False, True):
        quant.fp8_weight(fp8_shaped)  # a cached copy, which only an optimizer step drops
        step = model.step_fn(net, input_ids, optimizer_step)
        losses = [step() for _ in range(2)]
        assert len(quant._weight_cache) == (0 if optimizer_step else 1)
        assert torch.equal(losses[0], losses[1])
        assert all(p.grad is None for p in net.parameters())
        assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            model.parse_args(["--optimizer-step"], cuda=False)


def fake_sonicmoe(monkeypatch, calls: list) -> None:
    """An installed ``sonicmoe`` (and QuACK) stand-in whose ``moe_general_routing_inputs`` computes the experts in
    plain PyTorch from what it is given (SonicMoE's layout: w1 (2I, D, E) gate rows then up rows, w2 (D, I, E)),
    recording each call's stream and layout."""
    import enum
    import types

    from transformers.integrations import sonicmoe as hf_sonicmoe

    def moe_general_routing_inputs(x, scores, token_idx, expert_idx, w1, b1, w2, b2, E, stream_id, activation_type,
                                   is_inference_mode_enabled=False, concat_layout=False):
        calls.append({"stream_id": stream_id, "concat_layout": concat_layout, "E": E, "act": activation_type})
        inter = w2.shape[1]
        out = torch.zeros_like(x)
        for slot in range(token_idx.numel()):
            t, e = token_idx[slot], expert_idx[slot]
            gate_up = w1[:, :, e] @ x[t]
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out = out.index_add(0, t.view(1), (scores[slot] * (w2[:, :, e] @ h)).view(1, -1))
        return out, None

    gemms = {name: (lambda *a, tuned=True, **k: tuned) for name in ("gemm", "gemm_gated", "gemm_dgated")}
    modules = {"sonicmoe": types.SimpleNamespace(moe_general_routing_inputs=moe_general_routing_inputs),
               "sonicmoe.enums": types.SimpleNamespace(ActivationType=enum.Enum("ActivationType", "SWIGLU GEGLU")),
               "sonicmoe.functional": types.SimpleNamespace(**gemms),
               "sonicmoe.functional.forward": types.SimpleNamespace(gemm=gemms["gemm"]),
               "sonicmoe.functional.backward": types.SimpleNamespace(gemm_dgated=gemms["gemm_dgated"]),
               "quack": types.SimpleNamespace(), "quack.gemm_interface": types.SimpleNamespace(**gemms)}
    modules["sonicmoe"].functional = modules["sonicmoe.functional"]
    modules["sonicmoe.functional"].forward = modules["sonicmoe.functional.forward"]
    modules["sonicmoe.functional"].backward = modules["sonicmoe.functional.backward"]
    modules["quack"].gemm_interface = modules["quack.gemm_interface"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(hf_sonicmoe, "_SONICMOE", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1234))


def test_sonicmoe_experts_run_the_installed_package(monkeypatch):
    """``--experts sonicmoe``: transformers' own SonicMoE experts call the installed package (no hub download),
    on the current stream, at QuACK's pinned default GEMM config; the model's loss and gradients are
    grouped_mm's."""
    from megamoe.models import experts_problem

    calls = []
    fake_sonicmoe(monkeypatch, calls)
    assert experts_problem(["megamoe", "sonicmoe"], cuda=True) is None
    assert sys.modules["sonicmoe.functional"].gemm_gated() is False  # pinned: tuned=False
    assert sys.modules["sonicmoe.functional.forward"].gemm() is False
    model = tiny_model(device="cpu")
    input_ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    _, ref_loss, ref_grads = step(model, "grouped_mm", input_ids)
    _, loss, grads = step(model, "sonicmoe", input_ids)
    assert len(calls) == model.config.num_hidden_layers
    assert all(c["stream_id"] == 1234 and c["concat_layout"] and c["E"] == 8 and c["act"].name == "SWIGLU"
               for c in calls)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert experts_problem(["sonicmoe"], cuda=False) == \
        "--experts sonicmoe needs a CUDA GPU (SonicMoE's kernels are CUDA only)"


def test_model_benchmark_matrix_records_every_cell(tmp_path, monkeypatch, capsys):
    """``--matrix``: every cell of {no checkpointing, full} x {layers, model} x experts, each compiled as its cell
    says and compared with the eager un-checkpointed reference (same loss and gradients), in the JSON in order; a
    cell that raises is recorded with its error in one line and the run goes on."""
    import json

    import transformers

    from megamoe.bench import model

    if torch.cuda.is_available():
        pytest.skip("the CPU path runs only without a GPU")
    compiled, compile_model = [], model.compile_model

    def compile_or_fail(m, mode, fullgraph=True):
        if mode == "model" and m.config._experts_implementation == "eager":
            raise RuntimeError("no graph for you\nsecond line")
        compiled.append((m.config._experts_implementation, mode))
        compile_model(m, mode, fullgraph)

    monkeypatch.setattr(model, "compile_model", compile_or_fail)
    model.main(["--matrix", "--experts", "grouped_mm,eager", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    info = json.loads((tmp_path / "model-tiny-l2-t32-matrix-grouped_mm-eager.json").read_text())
    cells = [(r["checkpoint"], r["compile_mode"], r["experts"]) for r in info["results"]]
    assert cells == [(c, m, e) for c in (False, True) for m in ("layers", "model") for e in ("grouped_mm", "eager")]
    assert compiled == [(e, m) for _ in range(2) for m in ("layers", "model") for e in ("grouped_mm", "eager")
                        if (e, m) != ("eager", "model")]
    for r in info["results"]:
        if (r["experts"], r["compile_mode"]) == ("eager", "model"):
            assert r["error"] == "RuntimeError: no graph for you" and "loss" not in r
        else:
            assert "error" not in r and r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-4, r
    assert info["matrix"] and info["command"].startswith("python -m megamoe.bench.model --matrix")
    assert info["transformers"] == transformers.__version__
    assert "| full | model | loss " in out and "| failed |" in out


def test_model_benchmark_compiles_with_graph_breaks_what_dynamo_cannot_trace_whole(tmp_path, monkeypatch, capsys):
    """A whole-model cell whose experts dynamo cannot trace (here, as in SonicMoE's transformers integration, their
    forward behind ``torch.compiler.disable``) runs again with graph breaks allowed, gives the reference's loss and
    gradients, and says so in its record, its line and the table; megamoe's, which must be one graph, fails."""
    import json

    from megamoe.bench import model

    if torch.cuda.is_available():
        pytest.skip("the CPU path runs only without a GPU")
    compile_model = model.compile_model
    fullgraphs = []

    def compile_untraceable(m, mode, fullgraph=True):
        for module in m.modules():
            if hasattr(module, "gate_up_proj"):
                module.forward = torch.compiler.disable(module.forward)
        fullgraphs.append(fullgraph)
        compile_model(m, mode, fullgraph)

    monkeypatch.setattr(model, "compile_model", compile_untraceable)
    model.main(["--matrix", "--experts", "eager,megamoe", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    (path,) = tmp_path.glob("*.json")
    results = json.loads(path.read_text())["results"]
    assert [(r["compile_mode"], r["experts"], r.get("fullgraph")) for r in results] == [
        ("layers", "eager", None), ("layers", "megamoe", None), ("model", "eager", False), ("model", "megamoe", None)
    ] * 2
    # each whole-model cell is tried in one graph first; only eager's again with graph breaks
    assert fullgraphs == [True, True, True, False, True] * 2
    for r in results:
        if (r["compile_mode"], r["experts"]) == ("model", "megamoe"):
            assert r["error"].startswith("Unsupported: "), r
            continue
        assert "error" not in r and r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-4, r
        if r["compile_mode"] == "model":
            assert r["fullgraph_error"].startswith("Unsupported: "), r
    assert "again with graph breaks" in out and "| full | model | loss " in out and "(graph breaks) |" in out


def test_model_benchmark_keeps_megamoe_activations_only_without_checkpointing():
    from megamoe.bench import model

    for checkpoint, mode in ((False, "preact"), (True, None)):
        m = model.prepared(tiny_model(device="cpu"), "megamoe", checkpoint, None)
        assert {getattr(e, hf_megamoe.SAVE_FOR_BACKWARD, None) for e in m.modules() if hasattr(e, "gate_up_proj")} \
            == {mode}


def test_model_benchmark_runs_megamoe_fp8_as_megamoe_with_fp8_gemms(capsys):
    """``--experts megamoe_fp8``: megamoe's implementation with ``set_precision(model, "fp8")``, in megamoe's memory
    modes; refused without a GPU (the CPU check's tiny preset is not FP8-shaped), with one line."""
    from megamoe.bench import model

    for name in ("megamoe_fp8", "megamoe_fp8_call"):
        for checkpoint, mode in ((False, "preact"), (True, None)):
            m = model.prepared(tiny_model(device="cpu"), name, checkpoint, None)
            experts = [e for e in m.modules() if hasattr(e, "gate_up_proj")]
            assert {getattr(e, hf_megamoe.PRECISION, None) for e in experts} == {"fp8"}
            assert {getattr(e, hf_megamoe.SAVE_FOR_BACKWARD, None) for e in experts} == {mode}
            assert m.config._experts_implementation == "megamoe"
        assert model.cell_name(True, "layers", name) == f"checkpointed, layers, {name}"
        assert model.parse_args(["--experts", f"megamoe,{name}"], cuda=True).experts == ["megamoe", name]
        with pytest.raises(SystemExit):
            model.parse_args(["--experts", name], cuda=False)
        assert capsys.readouterr().err.splitlines()[-1].startswith(
            f"python -m megamoe.bench.model: error: --experts {name} needs a CUDA GPU")
    assert model.FP8_EXPERTS == {"megamoe_fp8": "step", "megamoe_fp8_call": "call"}


def test_model_benchmark_arguments(capsys):
    from megamoe.bench import model

    assert model.parse_args(["--compile"], cuda=True).compile_mode == "layers"
    assert model.parse_args(["--compile-mode", "model"], cuda=True).compile_mode == "model"
    with pytest.raises(SystemExit):
        model.parse_args(["--matrix", "--checkpoint"], cuda=True)
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m megamoe.bench.model: error: --matrix runs every checkpointing and compile mode: leave out "
        "--checkpoint, --compile and --compile-mode")
    for argv, message in ((["--tokens", "0"], "argument --tokens: must be at least 1, not 0"),
                          (["--iters", "-2"], "argument --iters: must be at least 1, not -2"),
                          (["--compile", "--compile-mode", "model"],
                           "argument --compile-mode: not allowed with argument --compile")):
        with pytest.raises(SystemExit):
            model.parse_args(argv, cuda=True)
        assert capsys.readouterr().err.splitlines()[-1] == f"python -m megamoe.bench.model: error: {message}"
    with pytest.raises(SystemExit):
        model.parse_args(["--profile"], cuda=False)
    assert capsys.readouterr().err.splitlines()[-1] == ("python -m megamoe.bench.model: error: --profile times the "
                                                        "kernels of the step: it needs a CUDA GPU")
    # without a GPU the check runs the tiny preset's model: the sizes given are named as ignored
    assert model.parse_args(["--tokens", "64", "--layers", "3"], cuda=False).ignored == ["layers", "tokens"]
    assert model.parse_args(["--tokens", "64"], cuda=True).ignored == []


def test_causal_attention_needs_no_mask_and_gives_sdpas_loss_and_gradients():
    """``build(attention="sdpa_causal")``: transformers builds no mask for it, so that the whole model compiled calls
    SDPA with ``is_causal=True`` and no mask (``"sdpa"`` gets a materialised mask there: the cause of the whole-model
    cells' slow attention), with the loss and gradients of ``"sdpa"`` on an unpadded sequence."""
    from megamoe.bench import model as bench_model
    from megamoe.models import build

    input_ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    runs, calls = {}, {}
    for attention in ("sdpa", "sdpa_causal"):
        m = build("tiny", 2, 128, torch.float32, "cpu", attention=attention)
        runs[attention] = bench_model.loss_and_grads(m, input_ids)
        seen = []

        def backend(gm, example_inputs, seen=seen):
            seen += [(n.kwargs.get("attn_mask") is None, n.kwargs.get("is_causal")) for n in gm.graph.nodes
                     if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]
            return gm.forward

        torch.compile(m, backend=backend, fullgraph=True)(input_ids=input_ids, labels=input_ids)
        calls[attention] = seen
    assert calls == {"sdpa": [(False, False)] * 2, "sdpa_causal": [(True, True)] * 2}
    (loss, grads), (causal_loss, causal_grads) = runs["sdpa"], runs["sdpa_causal"]
    assert abs(loss - causal_loss) < 1e-5 and bench_model.grad_diff(causal_grads, grads) < 1e-4
    assert bench_model.parse_args(["--attention", "sdpa_causal"], cuda=True).attention == "sdpa_causal"
    with pytest.raises(ValueError, match="attention must be one of"):
        build("tiny", 1, 128, torch.float32, "cpu", attention="flash")
