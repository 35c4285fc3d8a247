"""``python -m megamoe.train`` on CPU: a tiny Qwen3-MoE model on a few standard-library files learns with every
experts implementation, megamoe's losses follow transformers' step by step, a resumed run continues bitwise, and
the script runs under torchrun with FSDP2 and expert parallelism (gloo)."""

import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from megamoe import train

STDLIB = Path(sysconfig.get_paths()["stdlib"])
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few real text files (the interpreter's json package and argparse), copied so the digest is theirs."""
    folder = tmp_path_factory.mktemp("corpus")
    for path in [*sorted((STDLIB / "json").glob("*.py")), STDLIB / "argparse.py"]:
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def args_for(corpus, out, experts, *extra):
    return ["--preset", "tiny", "--corpus", str(corpus), "--vocab-size", "512", "--seq-len", "64",
            "--seqs-per-step", "2", "--steps", "6", "--warmup", "2", "--lr", "3e-3", "--eval-every", "3",
            "--eval-seqs", "2", "--log-every", "3", "--experts", experts, "--out", str(out), "--quiet", *extra]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """(out folder, {experts: the run's result}, {experts: what the run printed})."""
    out = tmp_path_factory.mktemp("runs")
    results, printed = {}, {}
    for experts in ("megamoe", "grouped_mm", "eager"):
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            results[experts] = train.main(args_for(corpus, out, experts, "--checkpoint-every", "3"))
        printed[experts] = stdout.getvalue()
    return out, results, printed


def test_every_backend_learns_and_megamoe_follows_transformers_step_by_step(runs):
    _, results, _ = runs
    for experts, run in results.items():
        assert len(run["losses"]) == 6 and all(map(torch.isfinite, torch.tensor(run["losses"])))
        assert run["losses"][-1] < run["losses"][0] - 0.1, f"{experts}: {run['losses']}"
        assert run["eval"][-1]["loss"] < run["eval"][0]["loss"], f"{experts}: {run['eval']}"
    for baseline in ("grouped_mm", "eager"):  # fp32 on CPU: the same model, weights and data
        torch.testing.assert_close(torch.tensor(results["megamoe"]["losses"]), torch.tensor(results[baseline]["losses"]),
                                   rtol=1e-4, atol=1e-5, msg=baseline)


def test_log_has_the_documented_fields_and_a_plot(runs):
    out, results, _ = runs
    run_dir = out / "tiny-l2-megamoe-s64x2-seed0"
    log = json.loads((run_dir / "log.json").read_text())
    for key in ("gpu", "torch", "transformers", "date", "command", "preset", "layers", "params", "experts",
                "precision", "ep", "seq_len", "steps", "tokens_per_s", "step_ms_median", "mfu", "moe_share",
                "moe_ms", "moe_share_of_step", "peak_mem_bytes", "final_eval_loss", "losses", "fp8_weight_gradients",
                "fp8_wgrad_x_scales", "fp8_weight_cache", "expert_load", "allocator_timed_steps", "passes_ms",
                "passes_ms_median", "clip_ms", "clip_ms_median", "optimizer_ms", "optimizer_ms_median"):
        assert key in log, key
    # each step in three parts: its passes, the clipping and the optimizer step, one after the other
    phases = list(zip(log["passes_ms"], log["clip_ms"], log["optimizer_ms"], log["step_ms"]))
    assert len(phases) == len(log["losses"])
    assert all(min(parts) > 0 and math.isclose(sum(parts), step, rel_tol=1e-9) for *parts, step in phases)
    for key in ("passes_ms", "clip_ms", "optimizer_ms"):
        assert log[f"{key}_median"] == statistics.median(log[key][train.TIMING_SKIP:] or log[key])
    assert log["allocator_timed_steps"] is None  # (CUDA's allocator, on a GPU)
    assert log["fp8_weight_gradients"] is None and log["fp8_wgrad_x_scales"] is None  # bf16 experts
    assert log["fp8_weight_cache"] is None
    # each step's load per decoder layer: the tiny preset's 8 experts, top-2, between balanced and all on two
    assert len(log["expert_load"]) == len(log["losses"]) and all(len(step) == log["layers"] for step in log["expert_load"])
    assert all(1.0 <= load <= 4.0 for step in log["expert_load"] for load in step)
    # the last step's assignments per layer and expert: every token's top-2, and the load they give
    counts = torch.tensor(log["expert_counts"], dtype=torch.float32)
    assert counts.shape == (log["layers"], 8) and (counts.sum(dim=1) == 2 * log["tokens_per_step"]).all()
    assert torch.allclose(counts.amax(dim=1) / counts.mean(dim=1), torch.tensor(log["expert_load"][-1]), rtol=1e-3)
    assert log["params"] == results["megamoe"]["params"] > 0 and log["corpus_digest"]
    assert (run_dir / "loss.png").stat().st_size > 0
    assert {p.name for p in (run_dir / "checkpoint-3").iterdir()} == {"rank0.safetensors", "state.json"}


def test_plot_labels_say_whether_fp8_weight_gradients_ran_where_the_log_records_it():
    from megamoe.train import precision_label

    assert precision_label({"expert_precision": "bf16"}) == ""
    assert precision_label({"expert_precision": "fp8"}) == " (FP8)"  # a log from before the field existed
    assert precision_label({"expert_precision": "fp8", "fp8_weight_gradients": False}) == " (FP8, bf16 dW)"
    assert precision_label({"expert_precision": "fp8", "fp8_weight_gradients": True}) == " (FP8, FP8 dW)"
    assert precision_label({"expert_precision": "fp8", "fp8_weight_gradients": True,
                            "fp8_wgrad_x_scales": "tile"}) == " (FP8, FP8 dW)"
    assert precision_label({"expert_precision": "fp8", "fp8_weight_gradients": True,
                            "fp8_wgrad_x_scales": "layer"}) == " (FP8, FP8 dW, x over the layer)"
    assert precision_label({"expert_precision": "fp8", "fp8_weight_gradients": True,
                            "fp8_wgrad_x_scales": "expert"}) == " (FP8, FP8 dW, x per expert)"


def test_resumed_run_continues_bitwise(runs, corpus):
    """From the checkpoint after step 3, steps 4-6 give the uninterrupted run's losses exactly."""
    out, results, _ = runs
    for experts in ("megamoe", "grouped_mm"):
        checkpoint = out / f"tiny-l2-{experts}-s64x2-seed0" / "checkpoint-3"
        resumed = train.main(args_for(corpus, out, experts, "--resume", str(checkpoint), "--name", f"resumed-{experts}",
                                      "--no-checkpoint"))
        assert resumed["first_step"] == 3
        assert resumed["losses"] == results[experts]["losses"][3:], experts
        assert resumed["eval"][-1] == results[experts]["eval"][-1]


def test_foreach_adamw_takes_the_fused_ones_steps(runs, corpus):
    """``--optimizer foreach`` is the same AdamW as the default fused one (to rounding), and either resumes the
    other's checkpoint (the step count moved to where the resuming optimizer keeps it)."""
    out, results, _ = runs
    fused = results["megamoe"]
    assert fused["optimizer"] == "AdamW (fused), fp32"
    foreach = train.main(args_for(corpus, out, "megamoe", "--optimizer", "foreach", "--name", "foreach",
                                  "--checkpoint-every", "3"))
    assert foreach["optimizer"] == "AdamW (foreach), fp32"
    torch.testing.assert_close(torch.tensor(foreach["losses"]), torch.tensor(fused["losses"]), rtol=1e-5, atol=1e-6)
    for name, checkpoint in (("fused-from-foreach", out / "foreach" / "checkpoint-3"),
                             ("foreach-from-fused", out / "tiny-l2-megamoe-s64x2-seed0" / "checkpoint-3")):
        optimizer = name.split("-")[0]
        resumed = train.main(args_for(corpus, out, "megamoe", "--optimizer", optimizer, "--resume", str(checkpoint),
                                      "--name", name, "--no-checkpoint"))
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(fused["losses"][3:]), rtol=1e-5,
                                   atol=1e-6, msg=name)


def test_resume_refuses_another_configuration(runs, corpus):
    out, _, _ = runs
    checkpoint = out / "tiny-l2-megamoe-s64x2-seed0" / "checkpoint-3"
    with pytest.raises(ValueError, match="seq_len"):
        train.main([*args_for(corpus, out, "megamoe", "--resume", str(checkpoint)), "--seq-len", "32"])


def test_under_torchrun_with_fsdp2_and_expert_parallelism(runs, corpus, tmp_path):
    """Two gloo ranks, FSDP2, --ep 2 (each rank its 4 of 8 experts, tokens exchanged): rank r's batch is the
    r-th half of the one-process run's batch of twice the sequences, so the first step's loss (the mean over the
    ranks) is that run's; later steps differ only by the router's auxiliary loss, computed per rank."""
    single = train.main(args_for(corpus, tmp_path, "megamoe", "--seqs-per-step", "4", "--steps", "2",
                                 "--no-checkpoint", "--eval-every", "2"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "megamoe.train", *args_for(corpus, tmp_path, "megamoe", "--steps", "2", "--ep", "2", "--name", "ep2",
                                       "--eval-every", "2")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = json.loads((tmp_path / "ep2" / "log.json").read_text())
    assert log["world"] == 2 and log["ep"] == 2 and log["tokens_per_step"] == single["tokens_per_step"]
    assert log["losses"][0] == pytest.approx(single["losses"][0], rel=1e-5)
    assert log["losses"][1] == pytest.approx(single["losses"][1], rel=1e-3)
    # the global gradient norm: the expert gradients divided by the ep size, their squares summed over the ranks
    assert log["grad_norms"][0] == pytest.approx(single["grad_norms"][0], rel=1e-3)
    assert {p.name for p in (tmp_path / "ep2" / "checkpoint-2").iterdir()} == \
        {"rank0.safetensors", "rank1.safetensors", "state.json"}


@pytest.mark.parametrize("divisor", [1, 2, 3])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clipping_divides_the_expert_gradients_without_a_pass_of_its_own(divisor, max_norm):
    """``clip_gradients(..., expert_divisor=n)`` gives what dividing the expert gradients by n and then torch's
    ``clip_grad_norm_`` give: the same norm and the same gradients, clipped (max_norm 0.5) or not (1e3)."""
    torch.manual_seed(0)
    shapes = {"embed": (7, 5), "experts_w13": (4, 6, 5), "experts_w2": (4, 5, 3), "head": (5, 7)}
    params = {name: torch.nn.Parameter(torch.randn(shape)) for name, shape in shapes.items()}
    for p in params.values():
        p.grad = torch.randn_like(p) * 3
    expert_params = [params["experts_w13"], params["experts_w2"]]
    reference = {name: torch.nn.Parameter(p.detach().clone()) for name, p in params.items()}
    for name, p in reference.items():
        p.grad = params[name].grad / (divisor if name.startswith("experts") else 1)
    expected_norm = torch.nn.utils.clip_grad_norm_(list(reference.values()), max_norm)

    norm = train.clip_gradients(list(params.values()), expert_params, max_norm, None, expert_divisor=divisor)
    torch.testing.assert_close(norm, expected_norm)
    assert (norm > max_norm) == (max_norm == 0.5)  # the two cases are the two they claim to be
    for name, p in params.items():
        torch.testing.assert_close(p.grad, reference[name].grad, msg=name)


def test_micro_batches_accumulate_the_steps_gradient(runs, corpus):
    """--micro-batches 2 of one sequence each: the same sequences per step as one micro-batch of two (the step's
    loss their mean, so the first step's loss is the same; the gradient likewise but for the router's auxiliary
    loss, computed per micro-batch); the run's name, tokens per step and resume check count the micro-batches."""
    out = runs[0]  # (its tokenizer cache)
    single = train.main(args_for(corpus, out, "megamoe", "--steps", "2", "--no-checkpoint", "--eval-every", "2",
                                 "--name", "one-micro-batch"))
    accumulated = train.main(args_for(corpus, out, "megamoe", "--seqs-per-step", "1", "--micro-batches", "2",
                                      "--steps", "2", "--eval-every", "2"))
    assert accumulated["micro_batches"] == 2 and accumulated["tokens_per_step"] == single["tokens_per_step"]
    assert accumulated["losses"][0] == pytest.approx(single["losses"][0], rel=1e-5)
    assert accumulated["grad_norms"][0] == pytest.approx(single["grad_norms"][0], rel=1e-2)
    assert accumulated["losses"][1] == pytest.approx(single["losses"][1], rel=1e-3)
    checkpoint = out / "tiny-l2-megamoe-s64x1x2-seed0" / "checkpoint-2"
    assert checkpoint.is_dir()
    with pytest.raises(ValueError, match="micro_batches"):
        train.main(args_for(corpus, out, "megamoe", "--seqs-per-step", "1", "--steps", "3", "--resume",
                            str(checkpoint)))


def test_moe_share_times_whole_steps_with_their_fp8_weight_copies(monkeypatch):
    """The ablation's timed unit is a training step's forward+backward passes, --micro-batches of them (batches as
    the loop reads them), each unit after the FP8 weight copies are dropped as the optimizer step drops them before
    every training step: a step's quantisation is timed with its experts, and ``moe_ms`` is per step, as the
    ``step_ms`` that ``moe_share_of_step`` divides it by. (CUDA's timing events stood in for: 2 ms with the experts,
    1.5 without.)"""
    calls = []
    implementation = ["megamoe"]

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            calls.append("record")

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 2.0 if implementation[0] == "megamoe" else 1.5

    class Model:
        def set_experts_implementation(self, name):
            implementation[0] = name

        def zero_grad(self, set_to_none):
            pass

        def parameters(self):
            return iter([weight])

    class Batches:
        def batch(self, index, seqs):
            return torch.full((seqs, 4), index)

    weight = torch.ones((), requires_grad=True)

    def step_loss(ids):
        calls.append(("pass", int(ids[0, 0]), ids.shape[0]))
        return weight * 2, 0.0, 0.0

    monkeypatch.setattr(train.torch.cuda, "Event", Event)
    monkeypatch.setattr(train, "clear_weight_cache", lambda: calls.append("drop copies"))
    args = train.parse_args(["--moe-share-steps", "2", "--micro-batches", "3", "--seqs-per-step", "2"], cuda=True)
    assert args.precision == "bf16"  # (the copies are dropped whatever the precision: a no-op without FP8 ones)
    result = train.moe_share(Model(), Batches(), args, torch.device("cpu"), 2, 1, step_loss)
    assert implementation == ["megamoe"]
    assert result["moe_ms"] == pytest.approx(0.5) and result["moe_share"] == pytest.approx(0.25)

    def step(i):  # rank 1 of 2 reads every other batch, 3 micro-batches of 2 sequences a step
        return ["drop copies", "record", *[("pass", (i * 3 + m) * 2 + 1, 2) for m in range(3)], "record"]

    # 3 untimed steps then 2 timed, with the experts and without
    assert calls == [call for _ in range(2) for i in range(5) for call in step(i)]
    assert "3 a step" in result["moe_share_method"] and "FP8 weight copies" not in result["moe_share_method"]

    # each timed step's copies are made again after the drop (under "ahead"), as the optimizer step makes them
    monkeypatch.setattr(train, "make_weight_copies_ahead", lambda params: calls.append(("ahead", list(params))))
    calls.clear()
    train.moe_share(Model(), Batches(), args, torch.device("cpu"), 2, 1, step_loss)
    ahead = [call for call in calls if call[0] == "ahead"]
    assert len(ahead) == 10 and all(params == [weight] for _, params in ahead)
    assert [c for c in calls if c[0] != "ahead"] == [call for _ in range(2) for i in range(5) for call in step(i)]
    assert all(calls[i - 1] == "drop copies" for i, call in enumerate(calls) if call[0] == "ahead")


def test_a_run_says_it_has_no_gpu_first_and_where_it_wrote_last(runs):
    """Without a GPU the first line says so (before the first step); the last lines give the eval loss rounded
    and the absolute paths of the log, the plot and the last checkpoint."""
    out, results, printed = runs
    lines = printed["megamoe"].splitlines()
    if not torch.cuda.is_available():
        assert lines[0].startswith("No CUDA GPU: training on the CPU in fp32") and "slow" not in lines[0]
    run_dir = (out / "tiny-l2-megamoe-s64x2-seed0").resolve()
    assert lines[-4].startswith(f"done: final eval loss {results['megamoe']['final_eval_loss']:.4f}, ")
    assert lines[-3:] == [f"  log:        {run_dir / 'log.json'}", f"  loss curve: {run_dir / 'loss.png'}",
                          f"  checkpoint: {run_dir / 'checkpoint-6'}"]
    assert all(Path(line.split(": ", 1)[1].strip()).is_absolute() and Path(line.split(": ", 1)[1].strip()).exists()
               for line in lines[-3:])


def test_without_a_gpu_the_defaults_run_about_a_minute():
    args = train.parse_args([], cuda=False)
    assert (args.preset, args.layers, args.steps, args.seq_len, args.seqs_per_step, args.warmup) == \
        ("tiny", 2, 30, 256, 4, 3)
    assert args.device_note == ("No CUDA GPU: training on the CPU in fp32, with the CPU's defaults --preset tiny "
                                "--steps 30 --seq-len 256 --seqs-per-step 4 --warmup 3 (about a minute on 2 cores, and the first run "
                                "trains the tokenizer).")
    args = train.parse_args([], cuda=True)
    assert (args.preset, args.layers, args.steps, args.seq_len, args.seqs_per_step, args.warmup) == \
        ("qwen3-30b-a3b", 16, 300, 16384, 1, 30)
    assert args.device_note is None
    note = train.parse_args(["--preset", "qwen3-30b-a3b", "--layers", "2"], cuda=False).device_note
    assert "will be slow on a CPU; `--preset tiny --steps 30 --seq-len 256 --seqs-per-step 4` takes about a " \
           "minute" in note
    assert "slow" in train.parse_args(["--steps", "300"], cuda=False).device_note


@pytest.mark.parametrize("argv,message", [
    (["--moe-share-steps", "3"], "--moe-share-steps times the step on a GPU"),
    (["--ep", "2"], "--ep needs several processes"),
    (["--precision", "fp8"], "--precision fp8 needs the layer's hidden and expert sizes to be multiples of 128"),
    (["--precision", "fp8", "--experts", "grouped_mm"], "--precision fp8 runs megamoe's experts"),
    (["--fp8-weight-cache", "call"], ("--fp8-weight-cache sets how FP8 experts keep their weight copies: it needs "
                                     "--precision fp8")),
    (["--precision", "fp8", "--fp8-weight-cache", "layer"], "argument --fp8-weight-cache: invalid choice"),
    (["--steps", "0"], "argument --steps: must be at least 1, not 0"),
    (["--seq-len", "-3"], "argument --seq-len: must be at least 1, not -3"),
    (["--layers", "0"], "argument --layers: must be at least 1"),
    (["--lr", "-1"], "argument --lr: must be greater than 0"),
    (["--micro-batches", "0"], "argument --micro-batches: must be at least 1"),
    (["--resume", "/no/such/folder"], "--resume /no/such/folder: no such checkpoint folder"),
    (["--compile", "--compile-mode", "model"], "argument --compile-mode: not allowed with argument --compile"),
    (["--plot", "a/log.json"], "--plot draws into --out, which must then be a .png path (got benchmarks/out/train)"),
    (["--profile", "3-2"], "argument --profile: --profile 3-2: the steps must be 1 <= A <= B"),
    (["--profile", "0"], "argument --profile: --profile 0: the steps must be 1 <= A <= B"),
    (["--profile", "2:4"], "argument --profile: --profile takes steps as A-B (or A), counted from 1; got '2:4'"),
])
def test_arguments_that_cannot_run_here_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(argv, cuda=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"python -m megamoe.train: error: {message}")
    assert "Traceback" not in err


def test_profile_says_where_the_profiled_steps_went(corpus, tmp_path):
    """--profile 2-3: profile.json beside log.json, with its provenance, the two steps, and each part of a step
    timed on the host (on CPU no device events: the device's columns are zero and the kernel table empty)."""
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        result = train.main(args_for(corpus, tmp_path, "megamoe", "--steps", "4", "--eval-every", "4", "--no-checkpoint",
                                     "--profile", "2-3", "--name", "profiled"))
    profile = json.loads((tmp_path / "profiled" / "profile.json").read_text())
    assert f"profile:    {(tmp_path / 'profiled' / 'profile.json').resolve()}" in stdout.getvalue()
    assert profile["steps"] == [2, 3]
    assert all(profile[key] == result[key] for key in train.PROFILE_PROVENANCE)
    phases = profile["phases"]
    assert set(phases) == {"passes", "clip", "optimizer", "other"}
    for name in ("passes", "clip", "optimizer"):  # each part's ranges recorded, per step, within the step's time
        assert 0 < phases[name]["host_ms"] < max(result[f"{name}_ms"][1:3]), name
    assert phases["other"]["host_ms"] == 0
    assert all(part["device_ms"] == part["idle_ms"] == 0 for part in phases.values()) and profile["kernels"] == []
    with pytest.raises(ValueError, match="--profile 4-5: this run trains steps 1 to 4"):
        train.main(args_for(corpus, tmp_path, "megamoe", "--steps", "4", "--profile", "4-5"))


def test_the_start_line_says_what_the_fp8_weight_copies_hold():
    from megamoe.kernels import quant
    from megamoe.models import build

    model = build("tiny", 2, 128, torch.float32, "cpu")
    held = sum(quant.weight_copies_bytes(p) for layer in model.model.layers for p in layer.mlp.experts.parameters())
    gib = f"{held / 2**30:.2f} GiB"
    assert train.fp8_copies_line(model).startswith(f"FP8 expert weights: their copies held through each step, {gib}")
    quant.set_fp8_weight_cache("ahead")
    try:
        assert train.fp8_copies_line(model).startswith("FP8 expert weights: their copies held through each step, made "
                                                       f"right after each optimizer step, {gib}")
        quant.set_fp8_weight_cache("call")
        assert train.fp8_copies_line(model).startswith("FP8 expert weights: copies made in every forward and backward, "
                                                       f"none held ({gib} with --fp8-weight-cache step)")
    finally:
        quant.set_fp8_weight_cache("step")


def test_precision_fp8_switches_every_megamoe_experts_module():
    from megamoe.integrations.transformers import PRECISION
    from megamoe.models import build

    model = build("tiny", 2, 128, torch.float32, "cpu")
    train.prepare(model, "megamoe", None, None, None, precision="fp8")
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert len(experts) == 2 and all(getattr(m, PRECISION) == "fp8" for m in experts)
    assert train.parse_args(["--preset", "qwen3-30b-a3b", "--precision", "fp8"], cuda=True).precision == "fp8"


def test_help_gives_the_whole_description_and_each_default_once(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "What it does, in order" in out and "- **Output**" in out and "``moe_share_of_step`` its fraction" in out
    options = out.split("\noptions:\n")[1]
    blocks = {}
    for line in options.splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = ""
        blocks[name] += " " + line.strip()
    assert all(text.count("default") <= 1 for text in blocks.values()), blocks
    assert "(default: this Python's standard library)" in " ".join(blocks["--corpus"].split())
    assert blocks["--seed"].endswith("(default: 0)") and "(default: 300, without a GPU 30)" in blocks["--steps"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_balancing_loss_is_transformers(dtype):
    """The training loop's sync-free auxiliary loss equals transformers' Qwen3-MoE ``load_balancing_loss_func``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        load_balancing_loss_func,
    )

    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(40 + i, 8, generator=gen).to(dtype) for i in range(3)]
    expected = load_balancing_loss_func(tuple(logits), 8, 2)
    loss, counts = train.load_balancing_loss(logits, 8, 2)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for layer, layer_logits in enumerate(logits):  # each router's assignments, counted as bincount would
        chosen = torch.topk(torch.softmax(layer_logits, dim=-1), 2, dim=-1).indices
        assert counts[layer].tolist() == torch.bincount(chosen.reshape(-1), minlength=8).float().tolist()


def test_expert_load_is_the_most_loaded_expert_over_the_mean():
    """One router sending every token to experts 0 and 1 (E / top-k = 4), one spreading them evenly (1), one with
    expert 5 taking half of all assignments (4 of the 8 experts' mean share of 1/8: 4)."""
    tokens, experts = 16, 8
    collapsed = torch.full((tokens, experts), -9.0)
    collapsed[:, :2] = 0
    even = torch.full((tokens, experts), -9.0)
    even[torch.arange(tokens), torch.arange(tokens) % experts] = 0  # top-1 of each token: every expert twice
    even[torch.arange(tokens), (torch.arange(tokens) + 1) % experts] = -1  # and its second choice: twice more
    half = torch.full((tokens, experts), -9.0)
    half[:, 5] = 0
    half[torch.arange(tokens), torch.arange(tokens) % 5] = -1
    _, counts = train.load_balancing_loss([collapsed, even, half], experts, 2)
    assert train.expert_load(counts).tolist() == [4.0, 1.0, 4.0]


@pytest.mark.parametrize("experts", ["megamoe", "grouped_mm"])
def test_whole_model_compiled_trains_as_eager(runs, corpus, experts):
    """``--compile-mode model`` (the whole model in one graph, fullgraph; ``aot_eager`` on CPU), checkpointed (megamoe
    under its helper), with the routers' auxiliary loss: the same losses as the eager run, step by step."""
    out, results, _ = runs
    run = train.main(args_for(corpus, out, experts, "--compile-mode", "model", "--stop-after", "2",
                              "--no-checkpoint", "--name", f"{experts}-whole-model"))
    assert run["compile_mode"] == "model" and len(run["losses"]) == 2
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(results[experts]["losses"][:2]),
                               rtol=1e-5, atol=1e-6)


def test_compiled_layers_share_their_graphs_however_many_layers(runs, corpus):
    """``--compile-mode layers``: every decoder layer runs the same compiled graphs (training, eval), so that a
    model of more layers than dynamo's recompile limit (8) compiles no more than a 2-layer one and no layer runs
    eagerly. (Routers appending to one shared list made every layer's frame guard on its length: an entry per
    layer, and the layers past the limit eager.)"""
    from torch._dynamo.utils import counters

    out = runs[0]  # (its tokenizer cache)
    graphs = {}
    for layers in (2, 10):
        torch._dynamo.reset()
        counters.clear()
        run = train.main(args_for(corpus, out, "megamoe", "--layers", str(layers), "--compile-mode", "layers",
                                  "--steps", "2", "--eval-every", "2", "--no-checkpoint",
                                  "--name", f"compiled-{layers}-layers"))
        assert len(run["losses"]) == 2 and counters["frames"]["total"] == counters["frames"]["ok"]
        graphs[layers] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert 0 < graphs[10] == graphs[2] < 8, graphs


@pytest.mark.parametrize("argv,mode", [([], None), (["--compile"], "layers"), (["--compile-mode", "layers"], "layers"),
                                       (["--compile-mode", "model"], "model")])
def test_compile_is_compile_mode_layers(argv, mode):
    assert train.parse_args(argv, cuda=False).compile_mode == mode


def test_sonicmoe_that_does_not_import_ends_in_one_line(monkeypatch, capsys):
    """``--experts sonicmoe`` where ``import sonicmoe`` fails: one line saying what to install, from both tools,
    before anything is built."""
    from transformers.integrations import sonicmoe as hf_sonicmoe

    from megamoe.bench import model

    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # import sonicmoe raises ImportError
    monkeypatch.setattr(hf_sonicmoe, "_SONICMOE", None)
    for parse, prog, argv in ((train.parse_args, "python -m megamoe.train", ["--experts", "sonicmoe"]),
                              (model.parse_args, "python -m megamoe.bench.model", ["--experts", "megamoe,sonicmoe"]),
                              (model.parse_args, "python -m megamoe.bench.model", ["--matrix", "--experts", "sonicmoe"])):
        with pytest.raises(SystemExit) as exit_info:
            parse(argv, cuda=True)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        line = err.splitlines()[-1]
        assert line.startswith(f"{prog}: error: --experts sonicmoe: SonicMoE is not importable (import of sonicmoe "
                               "halted") and "); install sonic-moe" in line
        assert "Traceback" not in err


def test_a_checkpoint_written_before_micro_batches_were_recorded_ran_one_per_step(tmp_path):
    """A checkpoint whose state.json lacks ``micro_batches`` resumes only a run of one micro-batch per step (the
    check passes, and the loading goes on to the missing weights here), and refuses any other."""
    (tmp_path / "state.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(ValueError, match="micro_batches=1, this run 2"):
        train.load_checkpoint(tmp_path, None, None, 0, {"micro_batches": 2})
    with pytest.raises(FileNotFoundError, match="rank0.safetensors"):
        train.load_checkpoint(tmp_path, None, None, 0, {"micro_batches": 1})
