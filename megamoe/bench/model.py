"""A transformers Qwen3-MoE model's training step with each experts implementation, side by side:

    python -m megamoe.bench.model [--preset qwen3-30b-a3b] [--layers 2] [--tokens 16384] [--experts megamoe,grouped_mm]
                                  [--checkpoint] [--compile-mode layers|model] [--matrix] [--optimizer-step]

The model is built from a config at the preset's layer dimensions (hidden size, heads, experts, top-k, expert
width) with ``--layers`` decoder layers and a small vocabulary, bf16, random weights (no download). A step is
forward + backward of the causal-LM loss on ``--tokens`` tokens (one sequence), gradients dropped after it (no
optimizer unless ``--optimizer-step``, below). ``--checkpoint``: full activation checkpointing of every decoder
layer — with ``megamoe.checkpoint_context`` for megamoe (its forward is not recomputed), plain for the others, as
users run them; without it megamoe runs its saved-activation mode (``set_save_for_backward(model, "preact")``: the
mode made for training without checkpointing). ``--compile-mode layers`` (or ``--compile``): ``torch.compile`` of every
decoder layer; ``model``: of the whole model, ``fullgraph=True``. ``--matrix``: every cell of {no checkpointing,
full checkpointing} x {layers, model} x ``--experts`` in one run; a cell that fails is recorded with its error and
the run goes on, and a whole-model cell that dynamo cannot trace as one graph runs again with graph breaks allowed,
marked as such (``run_cells``). ``--experts sonicmoe``: transformers' own SonicMoE experts on the installed
``sonicmoe`` package (at QuACK's default GEMM config), where it imports. ``megamoe_fp8``: megamoe with its blockwise
FP8 GEMMs (``set_precision(model, "fp8")``); with no optimizer step its FP8 weight copies, made at the first step,
are reused by every step after it, whereas a training step makes them again after each optimizer step:
``--optimizer-step`` ends every implementation's step with an optimizer step that leaves the weights as they are
(``step_fn``), so that megamoe_fp8's step pays for its copies as at one micro-batch per optimizer step.
``megamoe_fp8_call``: the same with the copies made at every call and kept by none
(``megamoe.set_fp8_weight_cache("call")`` for the cell): no layer's copies held through the step, at the cost of a
quantisation in each forward and backward.

Random weights can route very unevenly: ``megamoe.train``'s model at the 30B dimensions (built by the same
``megamoe.models.build``, with Qwen3's vocabulary) sent nearly every token of its second decoder layer to the same 8
experts at its first step (``expert_load`` 15.9, of the 16 that would mean all of them), where the layer benchmark's
``random`` routing is balanced. Every implementation here meets the same routing.

Each cell runs on a fresh copy of the model: medians of CUDA-event timings over ``--iters`` steps after 3 warm-up
steps, the peak of allocated memory over all of them (the bf16 weights and gradients included, no optimizer state),
the loss, and the seconds of the warm-up (compilation). The JSON (written after every cell, so that a run cut
short keeps what it measured) records the GPU, versions, date, commit and command. Without a GPU:
one forward+backward of the tiny preset's model (fp32; compiled with ``aot_eager``) per implementation, or per
cell with ``--matrix``, its loss and gradients compared with the eager un-checkpointed first implementation's,
and no timings.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import megamoe
from megamoe.arguments import HelpFormatter, add_compile_mode, csv_of, positive_int
from megamoe.bench.common import kernel_tables
from megamoe.integrations.transformers import (  # importing it registers "megamoe"
    enable_activation_checkpointing,
    set_precision,
    set_save_for_backward,
)
from megamoe.kernels import quant
from megamoe.models import (
    ATTENTION,
    ATTENTION_IMPLEMENTATIONS,
    COMPILE_MODES,
    EXPERTS,
    build,
    compile_model,
    experts_problem,
)
from megamoe.provenance import git_commit, source_digest, utc_now

CHECKPOINTING = (False, True)  # the matrix's rows: no checkpointing, full checkpointing
PROFILE_ROWS = 40  # kernels per --profile table: a 2-layer step runs ~30 kinds (attention, norms, the experts' own)
# The implementations a cell can run: transformers' experts interfaces (models.EXPERTS), and megamoe with its
# blockwise FP8 GEMMs (D and the expert width multiples of 128: the real presets, not the tiny one).
# megamoe in FP8 -> the policy of its FP8 weight copies in the cell (``kernels.quant.set_fp8_weight_cache``)
FP8_EXPERTS = {"megamoe_fp8": "step", "megamoe_fp8_call": "call"}
MODEL_EXPERTS = (*EXPERTS, *FP8_EXPERTS)


def is_megamoe(experts: str) -> bool:
    return experts == "megamoe" or experts in FP8_EXPERTS


def prepared(model, experts: str, checkpoint: bool, compile_mode: str | None, device=None, fullgraph: bool = True):
    """A copy of ``model`` (on ``device``) with ``experts``'s implementation, checkpointing and compilation as
    asked (``fullgraph``: :func:`~megamoe.models.compile_model`'s); megamoe keeps its gate/up pre-activation where
    nothing is checkpointed."""
    model = copy.deepcopy(model)
    if device is not None:
        model = model.to(device)
    model.set_experts_implementation("megamoe" if is_megamoe(experts) else experts)
    if experts in FP8_EXPERTS:
        set_precision(model, "fp8")
    model.train()
    if checkpoint:  # megamoe under its own policy; the others plainly, as users run them
        enable_activation_checkpointing(model, megamoe.checkpoint_context if is_megamoe(experts) else None)
    elif is_megamoe(experts):
        set_save_for_backward(model, "preact")
    if compile_mode is not None:
        compile_model(model, compile_mode, fullgraph)
    return model


def step_fn(model, input_ids, optimizer_step: bool = False):
    """One training step of ``model`` on ``input_ids``: forward, backward, the gradients dropped. ``optimizer_step``:
    an optimizer's step before they are dropped, SGD at learning rate 0, so that the weights stay as they are (every
    step computes the same) while every FP8 weight copy is made again at the next step, as after any optimizer step
    (``kernels.quant.fp8_weight``): what one micro-batch per optimizer step costs megamoe_fp8. The step's own cost
    (one pass over the weights and gradients, no state) is in every implementation's time."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0) if optimizer_step else None

    def step():
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        for p in model.parameters():
            p.grad = None
        return loss.detach()

    return step


def loss_and_grads(model, input_ids) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward+backward of the causal-LM loss: the loss and every parameter's gradient."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def grad_diff(grads: dict, ref: dict) -> float:
    """The largest difference of any parameter's gradient from ``ref``'s, relative to that parameter's largest
    reference gradient (inf where a parameter is missing)."""
    if grads.keys() != ref.keys():
        return float("inf")
    return max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in ref.items())


def error_line(exc: BaseException) -> str:
    """``exc`` in one line: its type and first line, and the next line where the first only introduces it
    (``BackendCompilerFailed``: "backend='inductor' raised:")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {text}"[:500]


def cell_name(checkpoint: bool, compile_mode: str | None, experts: str) -> str:
    saved = " (saved)" if is_megamoe(experts) and not checkpoint else ""
    return f"{'checkpointed' if checkpoint else 'no checkpointing'}, {compile_mode or 'eager'}, {experts}{saved}"


def check_on_cpu(experts: list[str], checkpoint: bool, compile_mode: str | None = None, attention: str = "sdpa"
                 ) -> int:
    """Without a GPU: one forward+backward of the tiny preset's model (fp32) per implementation, its loss and
    gradients compared with the first implementation's. Returns the exit status (1 if they disagree)."""
    print(f"No CUDA GPU: timings need a GPU. Instead, one forward+backward of the tiny preset's model (fp32, "
          f"32 tokens{', checkpointed' if checkpoint else ''}{f', compiled: {compile_mode}' if compile_mode else ''}"
          f") per implementation: its loss, and its loss and gradients against {experts[0]}'s.")
    model = build("tiny", 2, 128, torch.float32, "cpu", attention=attention)
    input_ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    runs = {e: loss_and_grads(prepared(model, e, checkpoint, compile_mode), input_ids) for e in experts}
    first_loss, first_grads = runs[experts[0]]
    print(f"  {'experts':12s} {'loss':>10s} {'|loss diff|':>12s} {'max grad diff':>14s}  (per parameter, relative to its "
          "largest gradient)")
    failed = False
    for e, (loss, grads) in runs.items():
        if e == experts[0]:
            print(f"  {e:12s} {loss:10.6f}")
            continue
        loss_diff, diff = abs(loss - first_loss), grad_diff(grads, first_grads)
        failed |= loss_diff > 1e-4 * abs(first_loss) or diff > 1e-3
        print(f"  {e:12s} {loss:10.6f} {loss_diff:12.2e} {diff:14.2e}")
    if failed:
        print("FAILED: the implementations disagree (tolerance: 1e-4 relative for the loss, 1e-3 for gradients)")
        return 1
    print("OK: the implementations agree. Run on a CUDA GPU for timings.")
    return 0


def timed(step, iters: int) -> tuple[float, float]:
    """(the median ms of ``iters`` steps, the seconds of the 3 warm-up steps before them: compilation, autotuning
    and JIT builds)."""
    begin = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - begin
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), warmup_s


def run_cell(base, experts: str, checkpoint: bool, compile_mode: str | None, input_ids, iters: int,
             reference=None, fullgraph: bool = True, optimizer_step: bool = False, profile: bool = False) -> dict:
    """One cell on a fresh copy of ``base``: on a GPU its step time, peak memory and loss (``optimizer_step``: each
    timed step ends with :func:`step_fn`'s optimizer step; ``profile``: then the step's per-kernel CUDA times,
    ``common.kernel_tables``, as the text of ``"_profile"``); on the CPU (``reference``: the (loss, gradients) to
    compare with) its loss and its differences from the reference. ``fullgraph=False``: the whole model compiled
    with graph breaks allowed (recorded as ``"fullgraph": false``)."""
    # Each cell compiles its own copy: without a reset dynamo counts the copies' layers as recompiles of one
    # frame, and past its recompile limit it runs the rest eagerly, with only a warning.
    torch._dynamo.reset()
    result = {"experts": experts, "checkpoint": checkpoint, "compile_mode": compile_mode}
    if compile_mode == "model":
        result["fullgraph"] = fullgraph
    if is_megamoe(experts):
        result["megamoe_save_for_backward"] = "none" if checkpoint else "preact"
    model = prepared(base, experts, checkpoint, compile_mode, input_ids.device, fullgraph)
    if input_ids.is_cuda:
        if experts in FP8_EXPERTS:
            result["fp8_weight_cache"] = FP8_EXPERTS[experts]
        outside = quant.fp8_weight_cache()
        quant.set_fp8_weight_cache(FP8_EXPERTS.get(experts, outside))
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step = step_fn(model, input_ids, optimizer_step)
            ms, warmup_s = timed(step, iters)
            result.update(step_ms=ms, tokens_per_s=input_ids.numel() / ms * 1e3, warmup_s=warmup_s,
                          peak_mem_bytes=torch.cuda.max_memory_allocated(), loss=step().item())
            if profile:
                result["_profile"] = kernel_tables({cell_name(checkpoint, compile_mode, experts): step},
                                                   rows=PROFILE_ROWS)
        finally:
            quant.set_fp8_weight_cache(outside)
            quant.clear_weight_cache()  # the cell's copies, before the next cell measures its peak
    else:
        loss, grads = loss_and_grads(model, input_ids)
        result.update(loss=loss, loss_diff=abs(loss - reference[0]), grad_diff=grad_diff(grads, reference[1]))
    return result


def run_cells(base, cells, input_ids, iters: int, write, reference=None, optimizer_step: bool = False,
              profile: bool = False) -> list[dict]:
    """Every cell of ``cells`` ((checkpoint, compile mode, experts)) with :func:`run_cell`; a cell that raises is
    recorded with its error (one line) and the next one runs. A whole-model cell of another implementation than
    megamoe's that dynamo cannot trace in one graph (``Unsupported``: SonicMoE's transformers experts call their
    kernel through ``torch.compiler.disable``) runs again with graph breaks allowed, as a user of that
    implementation compiles the whole model, and says so: ``"fullgraph": false`` and ``"fullgraph_error"`` in its
    record, "graph breaks" in its line and the table's cell. megamoe's must be one graph: its break is a failure.
    ``write(results)`` after every cell; ``optimizer_step``, ``profile``: :func:`run_cell`'s."""
    results = []
    for checkpoint, compile_mode, experts in cells:
        name = cell_name(checkpoint, compile_mode, experts)
        try:
            try:
                result = run_cell(base, experts, checkpoint, compile_mode, input_ids, iters, reference,
                                  optimizer_step=optimizer_step, profile=profile)
            except torch._dynamo.exc.Unsupported as exc:
                if compile_mode != "model" or is_megamoe(experts):
                    raise
                print(f"  {name:48s} not one graph ({error_line(exc)}): again with graph breaks", flush=True)
                name += " (graph breaks)"
                result = run_cell(base, experts, checkpoint, compile_mode, input_ids, iters, reference,
                                  fullgraph=False, optimizer_step=optimizer_step, profile=profile)
                result["fullgraph_error"] = error_line(exc)
        except Exception as exc:  # noqa: BLE001 -- a cell's failure is a result of the matrix
            result = {"experts": experts, "checkpoint": checkpoint, "compile_mode": compile_mode,
                      "error": error_line(exc)}
            print(f"  {name:48s} FAILED: {result['error']}", flush=True)
        else:
            if "step_ms" in result:
                print(f"  {name:48s} step {result['step_ms']:8.3f} ms  {result['tokens_per_s']:10.0f} tokens/s  "
                      f"peak {result['peak_mem_bytes'] / 2**30:6.2f} GiB  loss {result['loss']:.4f}", flush=True)
            else:
                print(f"  {name:48s} loss {result['loss']:.6f}  |loss diff| {result['loss_diff']:.2e}  max grad "
                      f"diff {result['grad_diff']:.2e}", flush=True)
        results.append(result)
        gc.collect()  # the cell's model and compiled graphs, before the next cell measures its peak
        if input_ids.is_cuda:
            torch.cuda.empty_cache()
        write(results)
    return results


def table(results: list[dict], experts: list[str]) -> str:
    """The results as a markdown table: a row per (checkpointing, compile mode), a column per implementation,
    each cell "step ms, peak GiB" (GPU), "loss" (CPU) or "failed"."""
    rows = {}
    for r in results:
        row = rows.setdefault((r["checkpoint"], r["compile_mode"]), {})
        breaks = " (graph breaks)" if r.get("fullgraph") is False else ""
        if "error" in r:
            row[r["experts"]] = "failed"
        elif r.get("step_ms") is not None:
            row[r["experts"]] = f"{r['step_ms']:.1f} ms, {r['peak_mem_bytes'] / 2**30:.1f} GiB{breaks}"
        else:
            row[r["experts"]] = f"loss {r['loss']:.4f}{breaks}"
    heads = [f"{e} (saved / helper)" if is_megamoe(e) else e for e in experts]
    lines = ["| checkpointing | compiled | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(experts)]
    for (checkpoint, compile_mode), row in rows.items():
        lines.append(f"| {'full' if checkpoint else 'none'} | {compile_mode or 'no'} | "
                     + " | ".join(row.get(e, "") for e in experts) + " |")
    return "\n".join(lines)


def parse_args(argv=None, cuda: bool | None = None):
    """The parsed arguments; those that cannot run here (``cuda``: whether a GPU runs this; default: whether one
    is visible) end the program with one line, before any model is built."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    p = argparse.ArgumentParser(prog="python -m megamoe.bench.model", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", choices=sorted(ATTENTION), default="qwen3-30b-a3b", help="layer dimensions")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per step (one sequence)")
    p.add_argument("--vocab", type=positive_int, default=32768, help="vocabulary size")
    p.add_argument("--experts", type=csv_of(MODEL_EXPERTS), default="megamoe,grouped_mm",
                   help=f"from {MODEL_EXPERTS} (sonicmoe: where `import sonicmoe` works, on a GPU; megamoe_fp8: on a "
                        "GPU)")
    p.add_argument("--checkpoint", action="store_true",
                   help="full activation checkpointing of every layer (without it megamoe keeps its gate/up "
                        "pre-activation, save_for_backward='preact')")
    add_compile_mode(p, COMPILE_MODES)
    p.add_argument("--matrix", action="store_true",
                   help="every cell of {no checkpointing, full} x {layers, model} x --experts (failed cells are "
                        "recorded with their error)")
    p.add_argument("--attention", choices=ATTENTION_IMPLEMENTATIONS, default="sdpa",
                   help="transformers' SDPA, or sdpa_causal: the same call without a mask, is_causal=True (one "
                        "unpadded sequence); the whole model compiled, sdpa builds the full causal mask and loses "
                        "SDPA's flash kernel under torch < 2.14")
    p.add_argument("--iters", type=positive_int, default=10, help="timed steps per cell")
    p.add_argument("--optimizer-step", action="store_true",
                   help="end each timed step with an optimizer step (SGD at learning rate 0: the weights stay, but "
                        "megamoe_fp8 makes its FP8 weight copies again every step, as training with one micro-batch "
                        "per optimizer step does; GPU timings only)")
    p.add_argument("--profile", action="store_true",
                   help="also write each cell's per-kernel CUDA times of its step (torch.profiler, 5 steps after 3 "
                        "warm-up steps; GPU only) next to the JSON: where the step's time goes, kernel by kernel")
    p.add_argument("--out", default="benchmarks/out", help="folder for the JSON")
    args = p.parse_args(argv)
    defaults = vars(p.parse_args([]))
    # what a check without a GPU leaves out (it runs the tiny preset's model: 2 layers, 32 tokens, once); main prints it
    args.ignored = [] if cuda else [name for name in ("preset", "layers", "tokens", "vocab", "iters")
                                    if getattr(args, name) != defaults[name]]
    if args.matrix and (args.checkpoint or args.compile_mode):
        p.error("--matrix runs every checkpointing and compile mode: leave out --checkpoint, --compile and "
                "--compile-mode")
    problem = experts_problem(args.experts, cuda)
    if problem:
        p.error(problem)
    if args.profile and not cuda:
        p.error("--profile times the kernels of the step: it needs a CUDA GPU")
    if args.optimizer_step and not cuda:
        p.error("--optimizer-step changes what the timed steps run: it needs a CUDA GPU (the check without one "
                "times nothing)")
    fp8 = [e for e in args.experts if e in FP8_EXPERTS]
    if fp8 and not cuda:
        p.error(f"--experts {fp8[0]} needs a CUDA GPU: without one the check runs the tiny preset, whose widths "
                "are not multiples of 128 (FP8's scale blocks)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.ignored:
        print(f"Ignored without a GPU: {', '.join('--' + name for name in args.ignored)} (the check runs the tiny "
              f"preset's model, 2 layers, 32 tokens, once).")
    if args.matrix:
        cells = [(c, m, e) for c in CHECKPOINTING for m in COMPILE_MODES for e in args.experts]
    else:
        cells = [(args.checkpoint, args.compile_mode, e) for e in args.experts]
    if not cuda and not args.matrix:
        if check_on_cpu(args.experts, args.checkpoint, args.compile_mode, args.attention):
            sys.exit(1)
        return
    if cuda:
        import triton

        device, dtype, preset, layers, vocab, tokens = torch.device("cuda"), torch.bfloat16, args.preset, \
            args.layers, args.vocab, args.tokens
        versions = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "triton": triton.__version__}
    else:
        print(f"No CUDA GPU: timings need a GPU. Instead, every cell's forward+backward of the tiny preset's model "
              f"(fp32, 32 tokens; compiled with aot_eager), its loss and gradients against {args.experts[0]}'s "
              f"eager, un-checkpointed run.")
        device, dtype, preset, layers, vocab, tokens = torch.device("cpu"), torch.float32, "tiny", 2, 128, 32
        versions = {"gpu": None, "torch": torch.__version__}
    # The model stays on the CPU; each cell moves its own copy to the device, so that a cell's peak memory is
    # its own model's.
    base = build(preset, layers, vocab, dtype, "cpu", attention=args.attention)
    input_ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    reference = None if cuda else loss_and_grads(prepared(base, args.experts[0], False, None), input_ids)
    info = {**versions, "commit": git_commit(), "source_sha256": source_digest(), "date": utc_now("seconds"),
            "command": "python -m megamoe.bench.model " + " ".join(shlex.quote(a) for a in
                                                                  (sys.argv[1:] if argv is None else argv)),
            "preset": preset, "layers": layers, "tokens": tokens, "vocab": vocab, "dtype": str(dtype),
            "attention": args.attention,
            # Its version decides how a checkpointed layer meets a compiled one (docs/USAGE.md)
            "transformers": transformers.__version__,
            "matrix": args.matrix, "iters": args.iters if cuda else None,
            "parameters": sum(p.numel() for p in base.parameters()),
            "peak_mem": "the most memory allocated during a cell's timed steps: its model's weights and gradients "
                        "included, no optimizer state", "optimizer_step": args.optimizer_step,
            "sonicmoe_gemm_config": "QuACK default (pinned)" if "sonicmoe" in args.experts else None}
    if not args.matrix:
        info.update(checkpoint=args.checkpoint, compile_mode=args.compile_mode)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    attention = "" if args.attention == "sdpa" else f"-{args.attention}"
    opt = "-optstep" if args.optimizer_step else ""
    if args.matrix:
        path = out / f"model-{preset}-l{layers}-t{tokens}-matrix-{'-'.join(args.experts)}{attention}{opt}.json"
    else:
        path = out / (f"model-{preset}-l{layers}-t{tokens}{'-ckpt' if args.checkpoint else ''}"
                      f"{'-wholemodel' if args.compile_mode == 'model' else ''}{attention}{opt}.json")

    def write(results):
        records = [{k: v for k, v in r.items() if k != "_profile"} for r in results]
        path.write_text(json.dumps({**info, "results": records}, indent=1) + "\n")

    results = run_cells(base, cells, input_ids, args.iters, write, reference, optimizer_step=args.optimizer_step,
                        profile=args.profile)
    print(table(results, args.experts))
    print(f"wrote {path}")
    if args.profile:
        tables = path.with_name(path.stem + "-profile.txt")
        tables.write_text("".join(r.get("_profile", "") for r in results))
        print(f"wrote {tables}")
    if not cuda:
        bad = [r for r in results if "error" not in r and (r["loss_diff"] > 1e-4 * abs(reference[0])
                                                            or r["grad_diff"] > 1e-3)]
        if bad:
            print("FAILED: these cells disagree with the reference (tolerance: 1e-4 relative for the loss, 1e-3 "
                  "for gradients): " + "; ".join(cell_name(r["checkpoint"], r["compile_mode"], r["experts"])
                                                  for r in bad))
            sys.exit(1)


if __name__ == "__main__":
    main()
