"""One MoE layer (experts only, routing done), megamoe against what users run today, side by side.

On a GPU: forward, forward+backward and the activation-checkpointing step (forward + forward-and-
backward, what an impl that keeps activations costs under full checkpointing; an impl that keeps none
needs no outer checkpointing, so its step is its forward+backward), effective TFLOP/s, memory, speed-ups
and the error against the fp32 reference on a small problem. Writes a table, a JSON file and a PNG.

Without a GPU: runs a tiny problem through every implementation that runs on the CPU (the reference,
and the Triton kernels under ``TRITON_INTERPRET=1``), checks it against the fp32 reference (megamoe's FP8 path
within twice its recipe's own error, on a problem with D = I = 128), and says that timings need a GPU.

FLOP counts (N = routed rows = T*K less dropped slots): forward 6·N·D·I; backward 12·N·D·I; the
fused backward recomputes the gate/up GEMM: 16·N·D·I. ``tflops`` = FLOPs executed in the step / step
time (24·N·D·I for a checkpointed baseline, 22·N·D·I for the fused path); ``model_tflops`` uses the
training FLOPs 18·N·D·I for every impl (comparable across impls, like MFU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import megamoe
from megamoe import autograd, reference
from megamoe.api import backend_for
from megamoe.bench.common import (
    PRESETS,
    dense_matmul_tflops,
    kernel_tables,
    leaf_copies,
    make_problem,
    max_rel_err,
    training_step,
    utc_now,
)
from megamoe.env import FP8_WGRAD_X_SCALES, interpreting
from megamoe.kernels import gluon_sm90
from megamoe.kernels.tuning import autotune_enabled
from megamoe.models import pin_quack_default_configs
from megamoe.provenance import gpu_record

IMPLS = ("loop", "grouped_mm", "grouped_mm_compiled", "liger", "sonicmoe", "megamoe", "megamoe_saved",
         "megamoe_saved_dx_first", "megamoe_cudagraph", "megamoe_fp8", "megamoe_fp8_saved", "megamoe_fp8_optstep",
         "grouped_mm_fp8", "grouped_mm_fp8_compiled")
# megamoe's FP8 modes with an option of the recipe for x's dW13 scales (``MEGAMOE_FP8_WGRAD_X_SCALES``), set around
# each of their calls and backwards, so that one process times them beside the recipe: name -> (mode, option), e.g.
# megamoe_fp8_x_layer -> (megamoe_fp8, layer).
X_SCALES_IMPLS = {f"{mode}_x_{option}": (mode, option) for mode in ("megamoe_fp8", "megamoe_fp8_saved")
                  for option in FP8_WGRAD_X_SCALES if option != "tile"}
IMPLS += tuple(X_SCALES_IMPLS)
DEFAULT_IMPLS = "grouped_mm,grouped_mm_compiled,megamoe"
BASELINES = ("grouped_mm", "grouped_mm_compiled")
# The CPU check: a tiny problem through what runs on a CPU, each against the fp32 reference ("loop").
CPU_TOKENS, CPU_IMPLS = 48, ("grouped_mm", "megamoe")
CPU_FP8_DIM = 128  # D and I of the check's FP8 problem (one 128 group and block each)


@dataclass
class Impl:
    name: str
    fn: Callable
    keeps_activations: bool  # True: under full checkpointing its step costs fwd + (fwd + bwd)
    cuda_graph: bool = False  # timed as CUDA-graph replays (no host launch cost); memory measured eagerly
    x_scales: str | None = None  # FP8: x's dW13 scales in place of the process's (X_SCALES_IMPLS); None: those

    def settings(self) -> contextlib.AbstractContextManager:
        """The context its forward and backward run in: ``x_scales`` as ``autograd.FP8_WGRAD_X_SCALES`` (which
        the backward reads), the process's setting restored after; nothing to set where ``x_scales`` is None."""
        if self.x_scales is None:
            return contextlib.nullcontext()
        return autograd_setting("FP8_WGRAD_X_SCALES", self.x_scales)

    def within(self, fn: Callable) -> Callable:
        """``fn`` (a call and its backward) run in :meth:`settings`."""

        def call(*args, **kwargs):
            with self.settings():
                return fn(*args, **kwargs)

        return call


def liger_moe() -> Callable:
    """Liger-Kernel's fused Triton MoE (same weight layout) behind our signature; needs
    ``pip install liger-kernel`` (0.8.5 was checked against the fp32 reference in the interpreter)."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as exc:
        raise SystemExit("impl 'liger' needs Liger-Kernel: pip install liger-kernel==0.8.5") from exc

    def fn(x, topk_idx, topk_weights, w13, w2):
        return LigerFusedMoEFunction.apply(x, w13, w2, topk_idx.to(torch.int32), topk_weights)

    return fn


def sonicmoe_moe(autotune: bool) -> Callable | None:
    """SonicMoE (``pip install sonic-moe``; CuTe DSL + QuACK GEMMs, keeps the gate/up pre-activation for its
    backward) given the routing, on megamoe's own weight layout, behind our signature; None, with a message,
    where it is not importable. ``autotune=False`` pins QuACK's GEMMs to their default config (its autotuning
    of one layer shape outlasts a 10-minute run on the H200); the result records which ran."""
    try:
        from sonicmoe import moe_general_routing_inputs
        from sonicmoe.enums import ActivationType

        if not autotune:
            pin_quack_default_configs()
    except ImportError as exc:
        print(f"  sonicmoe: skipped, not importable ({exc}); install sonic-moe and its pinned QuACK / CUTLASS DSL")
        return None

    def fn(x, topk_idx, topk_weights, w13, w2):
        num_tokens, top_k = topk_idx.shape
        # SonicMoE takes every routed (token, expert, score), sorted by token; it has no dropped slots.
        torch._assert_async((topk_idx >= 0).all(), "impl sonicmoe: dropped slots (-1) are not supported")
        token_idx = torch.arange(num_tokens, device=x.device, dtype=torch.int32).repeat_interleave(top_k)
        y, _ = moe_general_routing_inputs(
            x, topk_weights.reshape(-1).to(x.dtype), token_idx, topk_idx.reshape(-1).to(torch.int32),
            w13.permute(1, 2, 0), None, w2.permute(1, 2, 0), None, w13.shape[0],
            torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU, False, concat_layout=True)
        return y

    return fn


@contextlib.contextmanager
def autograd_setting(name: str, value):
    """``megamoe.autograd``'s setting ``name`` at ``value`` inside the context, as it was after."""
    previous = getattr(autograd, name)
    setattr(autograd, name, value)
    try:
        yield
    finally:
        setattr(autograd, name, previous)


def dx_first(fn: Callable) -> Callable:
    """``fn`` (megamoe) with the backward's dx-first order (``megamoe.autograd.LOW_PEAK_BACKWARD`` cleared: dx's slot
    rows before dW13, combined inside its launch; the forward reads the setting when it runs and its backward follows
    it), the setting of the process left as it was."""

    def call(*args, **kwargs):
        with autograd_setting("LOW_PEAK_BACKWARD", False):
            return fn(*args, **kwargs)

    return call


def after_optimizer_step(fn: Callable) -> Callable:
    """``fn`` (megamoe in FP8) as each training step meets it at one micro-batch per optimizer step: every call
    starts with no FP8 weight copy (``quant.clear_weight_cache``), so its forward makes them again (one pass over
    both weights; its backward reuses them), which the layer's other FP8 impls, reusing one set of copies, leave
    out."""
    from megamoe.kernels import quant

    def call(*args, **kwargs):
        quant.clear_weight_cache()
        return fn(*args, **kwargs)

    return call


def make_impls(names, device, sonicmoe_autotune: bool = False) -> list[Impl]:
    """The impls of ``names`` (of :data:`IMPLS`); an optional peer that is not installed is skipped with a
    message (``liger`` exits instead: it is pip-installable anywhere)."""
    impls = []
    for name in names:
        if name == "loop":
            impls.append(Impl(name, reference.moe_loop, True))
        elif name == "grouped_mm":
            impls.append(Impl(name, reference.moe_grouped_mm, True))
        elif name == "grouped_mm_compiled":
            impls.append(Impl(name, torch.compile(reference.moe_grouped_mm, fullgraph=True), True))
        elif name == "grouped_mm_fp8":  # torchao's FP8 rowwise MoE recipe (reference.moe_grouped_mm_fp8)
            impls.append(Impl(name, reference.moe_grouped_mm_fp8, True))
        elif name == "grouped_mm_fp8_compiled":
            impls.append(Impl(name, torch.compile(reference.moe_grouped_mm_fp8, fullgraph=True), True))
        elif name == "liger":
            impls.append(Impl(name, liger_moe(), True))
        elif name == "sonicmoe":
            fn = sonicmoe_moe(sonicmoe_autotune)
            if fn is not None:
                impls.append(Impl(name, fn, True))
        elif name in ("megamoe", "megamoe_cudagraph"):
            fused = backend_for(torch.empty(0, device=device)) == "triton"
            impls.append(Impl(name, megamoe.moe, not fused, cuda_graph=name == "megamoe_cudagraph"))
        elif name == "megamoe_saved":  # keeps the gate/up pre-activation: checkpointing would rerun its forward
            impls.append(Impl(name, functools.partial(megamoe.moe, save_for_backward="preact"), True))
        elif name == "megamoe_saved_dx_first":
            impls.append(Impl(name, dx_first(functools.partial(megamoe.moe, save_for_backward="preact")), True))
        elif name in ("megamoe_fp8", "megamoe_fp8_optstep"):  # optstep: the weights' FP8 copies made at every call
            fused = backend_for(torch.empty(0, device=device), fp8=True) == "triton"
            fn = functools.partial(megamoe.moe, precision="fp8")
            impls.append(Impl(name, after_optimizer_step(fn) if name == "megamoe_fp8_optstep" else fn, not fused))
        elif name == "megamoe_fp8_saved":
            impls.append(Impl(name, functools.partial(megamoe.moe, precision="fp8", save_for_backward="preact"), True))
        elif name in X_SCALES_IMPLS:
            mode, option = X_SCALES_IMPLS[name]
            (impl,) = make_impls([mode], device)
            impls.append(dataclasses.replace(impl, name=name, x_scales=option))
        else:
            raise ValueError(f"unknown impl {name!r}; choose from {IMPLS}")
    return impls


@dataclass
class Timed:
    """An impl's calls on one problem, set up once (compiled, autotuned and warmed up; captured if CUDA-graphed):
    ``fwd`` and ``fwd_bwd`` as timed, ``eager_fwd`` and ``eager_fwd_bwd`` for the memory figures."""
    impl: Impl
    leaves: list
    fwd: Callable
    fwd_bwd: Callable
    eager_fwd: Callable
    eager_fwd_bwd: Callable


def set_up(impl: Impl, problem, leaves: list) -> Timed:
    """``impl``'s calls on ``problem`` with ``leaves`` (:func:`leaf_copies`, shared by every impl of a run) as the
    tensors they differentiate; no call leaves a gradient on them."""
    topk_idx, dy = problem[1], problem[5]
    xl, wl, w13l, w2l = leaves

    @impl.within
    def fwd():
        return impl.fn(xl, topk_idx, wl, w13l, w2l)

    @impl.within
    def fwd_bwd():
        fwd().backward(dy)

    fwd_bwd()  # compile / autotune / warm up outside the timed region
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    if impl.cuda_graph:  # the same launches, replayed: what a captured training step pays
        timed_fwd, _ = cuda_graphed(fwd)
        timed_fwd_bwd, _ = cuda_graphed(lambda: torch.autograd.grad(fwd(), leaves, dy))
    else:
        timed_fwd, timed_fwd_bwd = fwd, fwd_bwd
    return Timed(impl, leaves, timed_fwd, timed_fwd_bwd, fwd, fwd_bwd)


def time_once(timed: Timed, rep_ms: int) -> dict:
    """One median of each timed call (``do_bench``), with when they were taken (UTC, as scripts/gpu-check.sh's
    clocks.csv): the SM clock under the power limit moves the GEMMs' times (docs/FACTS.md), so a result can be
    read against the clock it met."""
    from triton.testing import do_bench

    started = utc_now()
    fwd_ms = do_bench(timed.fwd, warmup=100, rep=rep_ms, return_mode="median")
    fwd_bwd_ms = do_bench(timed.fwd_bwd, warmup=100, rep=rep_ms, grad_to_none=timed.leaves, return_mode="median")
    for t in timed.leaves:
        t.grad = None
    return {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms, "timed_utc": [started, utc_now()]}


def memory(timed: Timed) -> dict:
    """What the forward keeps for the backward beyond its output, and the forward+backward's peak over what was
    allocated before it (bytes; the eager calls). A call first, so that what an impl caches across calls (the FP8
    weight copies) is in place, whatever ran since its timed calls (``megamoe_fp8_optstep`` clears every copy)."""
    timed.eager_fwd_bwd()
    for t in timed.leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = timed.eager_fwd()
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    del y
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    timed.eager_fwd_bwd()
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - base
    for t in timed.leaves:
        t.grad = None
    return {"saved_activation_bytes": int(saved), "peak_extra_bytes": int(peak_extra)}


def time_impls(impls: list[Impl], problem, rep_ms: int, rounds: int = 1) -> list[dict]:
    """Each impl's times and memory on ``problem``. ``rounds`` 1: one impl after the other, each set up, timed
    and freed in turn. ``rounds`` N > 1: every impl set up first, then N rounds, each timing every impl once in
    the same order, so that a drift of the GPU's clock over the run meets all impls alike; each time is the median
    of its N medians, which are kept too (``*_rounds``, with each round's window in ``timed_utc_rounds``).
    Every impl differentiates the same leaf copies of the inputs and weights, so that N impls set up at once hold
    one copy of the weights and, where they run in FP8, one set of its cached FP8 copies (the 235B layer's weights
    are 4.5 GiB in bf16: eight impls with a copy each did not fit an 80 GB GPU)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    leaves = leaf_copies(problem)
    if rounds == 1:
        results = []
        for impl in impls:
            timed = set_up(impl, problem, leaves)
            results.append(_with_step(impl, {**time_once(timed, rep_ms), **memory(timed)}))
            del timed
        return results
    timed = [set_up(impl, problem, leaves) for impl in impls]
    runs = [[time_once(t, rep_ms) for t in timed] for _ in range(rounds)]
    results = []
    for i, t in enumerate(timed):
        mine = [run[i] for run in runs]
        r = {key: statistics.median(m[key] for m in mine) for key in ("fwd_ms", "fwd_bwd_ms")}
        r["timed_utc"] = [mine[0]["timed_utc"][0], mine[-1]["timed_utc"][1]]
        r |= {f"{key}_rounds": [m[key] for m in mine] for key in ("fwd_ms", "fwd_bwd_ms")}
        r["timed_utc_rounds"] = [m["timed_utc"] for m in mine]
        results.append(_with_step(t.impl, {**r, **memory(t)}))
    return results


def _with_step(impl: Impl, r: dict) -> dict:
    """``r`` with the activation-checkpointing step (forward + forward-and-backward for an impl that keeps
    activations, else its forward+backward) and the forward plus the forward+backward."""
    ac_ms = r["fwd_ms"] + r["fwd_bwd_ms"] if impl.keeps_activations else r["fwd_bwd_ms"]
    return {**r, "ac_step_ms": ac_ms, "fwd_plus_fwd_bwd_ms": r["fwd_ms"] + r["fwd_bwd_ms"]}


def cuda_graphed(fn: Callable) -> tuple[Callable, object]:
    """``fn``'s launches captured once in a CUDA graph (after a warm-up call on a side stream); returns
    the graph's replay, which reruns them on the same tensors, and what the captured call returned (the
    tensors each replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def run_cpu(args) -> None:
    dim, inter, num_experts, top_k = PRESETS["tiny"]
    interp = interpreting()
    print("No CUDA GPU: timings need a GPU. Checking correctness on a tiny problem instead")
    print(f"(T={CPU_TOKENS}, D={dim}, I={inter}, E={num_experts}, K={top_k}, fp32, {args.routing[0]} routing; megamoe "
          f"runs {'the Triton kernels in the interpreter' if interp else 'the reference'}"
          f"{'' if interp else ' — set TRITON_INTERPRET=1 to run its Triton kernels'}).")
    ignored = sorted(args.explicit & {"preset", "tokens", "impls", "rep_ms", "rounds", "out", "profile", "no_plot"})
    if ignored:
        print(f"Ignored without a GPU: {', '.join('--' + name.replace('_', '-') for name in ignored)} (the check "
              f"always runs the tiny preset through {', '.join(CPU_IMPLS)}, and megamoe's FP8 path at D = I = "
              f"{CPU_FP8_DIM}, and writes nothing).")
    problem = make_problem(CPU_TOKENS, dim, inter, num_experts, top_k, args.routing[0], torch.float32, "cpu",
                           args.seed)
    worst = 0.0
    for impl in make_impls(CPU_IMPLS, "cpu"):
        err = max_rel_err(impl.fn, problem)
        worst = max(worst, err)
        print(f"  {impl.name:24s} max rel err vs fp32 reference (y and all grads): {err:.2e}")
    if worst > 1e-4:
        sys.exit(f"FAILED: an implementation disagrees with the fp32 reference ({worst:.2e} > 1e-4)")
    # Blockwise FP8 (its groups need D and I multiples of 128), against the fp32 reference with the recipe's own error
    # (the recipe computed in PyTorch, reference.moe_loop_fp8) as the measure.
    fp8_problem = make_problem(CPU_TOKENS, CPU_FP8_DIM, CPU_FP8_DIM, num_experts, top_k, args.routing[0],
                               torch.float32, "cpu", args.seed)
    recipe = max_rel_err(reference.moe_loop_fp8, fp8_problem)
    fp8 = max_rel_err(functools.partial(megamoe.moe, precision="fp8"), fp8_problem)
    print(f"  {'megamoe, precision=fp8':24s} max rel err vs fp32 reference (y and all grads): {fp8:.2e}; the FP8 "
          f"recipe's own: {recipe:.2e} (D=I={CPU_FP8_DIM})")
    if fp8 > 2 * recipe:
        sys.exit(f"FAILED: megamoe's FP8 path is further from the fp32 reference than twice its recipe's own error "
                 f"({fp8:.2e} > 2 x {recipe:.2e})")
    print("OK. Run on a CUDA GPU for timings.")


def run_gpu(args, preset: str, tokens: int, routing: str, matmul_tflops: float) -> dict:
    device = torch.device("cuda")
    dim, inter, num_experts, top_k = PRESETS[preset]
    torch._dynamo.reset()  # a fresh, static-shape compile of the baseline for every problem
    impls = make_impls([n.strip() for n in args.impls.split(",") if n.strip()], device, args.sonicmoe_autotune)
    info = {
        **gpu_record("python -m megamoe.bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])),  # MEGAMOE_* too
        "megamoe": megamoe.__version__, "preset": preset, "tokens": tokens, "routing": routing, "ep": 1,
        "rounds": args.rounds,
        "dim": dim, "intermediate": inter, "experts": num_experts, "top_k": top_k, "dtype": "bfloat16",
        "megamoe_backend": backend_for(torch.empty(0, device=device)),
        "megamoe_autotune": autotune_enabled(torch.bfloat16),
        "megamoe_wgrad_by_size": gluon_sm90.WGRAD_BY_SIZE,  # MEGAMOE_WGRAD_BY_SIZE
        "megamoe_wgrad_taken": sorted(gluon_sm90.WGRAD_TAKEN),  # MEGAMOE_WGRAD_TAKEN
        "megamoe_fp8_wgrad_x_scales": autograd.FP8_WGRAD_X_SCALES,  # MEGAMOE_FP8_WGRAD_X_SCALES
    }
    if any(impl.name == "sonicmoe" for impl in impls):
        info["sonicmoe_gemms"] = "autotuned" if args.sonicmoe_autotune else "default config (pinned)"
    info["matmul_tflops"] = matmul_tflops
    problem = make_problem(tokens, dim, inter, num_experts, top_k, routing, torch.bfloat16, device, args.seed)
    rows = int((problem[1] >= 0).sum())
    unit = rows * dim * inter
    small = make_problem(256, dim, inter, num_experts, top_k, routing, torch.bfloat16, device, args.seed + 1)
    if args.rounds > 1:
        print(f"  {args.rounds} rounds, every impl timed once in each; times: the median of each impl's rounds",
              flush=True)
    results = []
    for impl, timed in zip(impls, time_impls(impls, problem, args.rep_ms, args.rounds)):
        r = {"impl": impl.name, **timed}
        executed = (24 if impl.keeps_activations else 22) * unit
        r["tflops"] = executed / r["ac_step_ms"] / 1e9
        r["model_tflops"] = 18 * unit / r["ac_step_ms"] / 1e9
        with impl.settings():
            r["max_rel_err"] = max_rel_err(impl.fn, small)
        results.append(r)
        rounds = f" (rounds: {', '.join(f'{v:.3f}' for v in r['fwd_bwd_ms_rounds'])})" if args.rounds > 1 else ""
        print(f"  {impl.name}: fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwd_bwd_ms']:.3f} ms{rounds}", flush=True)
    by_name = {r["impl"]: r for r in results}
    for r in results:
        for base in BASELINES:
            if base in by_name and base != r["impl"]:
                b = by_name[base]
                r[f"speedup_vs_{base}"] = {k: b[k] / r[k] for k in ("fwd_ms", "fwd_bwd_ms", "ac_step_ms")}
    info["results"] = results
    if args.profile:  # a CUDA-graph impl launches its eager twin's kernels: profiling it again would repeat that
        leaves = leaf_copies(problem)  # one copy for all impls, as their timing had
        info["_profile"] = kernel_tables({impl.name: impl.within(training_step(impl.fn, problem, leaves)[1])
                                          for impl in impls if not impl.cuda_graph})
    return info


def print_table(info: dict) -> None:
    print(f"\n{info['preset']}  T={info['tokens']}  routing={info['routing']}  {info['gpu']}  "
          f"(megamoe backend: {info['megamoe_backend']}; ceiling {info['matmul_tflops']:.0f} TFLOP/s)")
    head = (f"{'impl':26s} {'fwd ms':>8s} {'fwd+bwd':>8s} {'AC step':>8s} {'TFLOP/s':>8s} {'saved MiB':>9s} "
            f"{'peak MiB':>9s} {'rel err':>8s} {'AC x vs compiled':>17s}")
    print(head)
    print("-" * len(head))
    for r in info["results"]:
        sp = r.get("speedup_vs_grouped_mm_compiled", {}).get("ac_step_ms")
        print(f"{r['impl']:26s} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} {r['ac_step_ms']:8.3f} "
              f"{r['tflops']:8.0f} {r['saved_activation_bytes'] / 2**20:9.0f} {r['peak_extra_bytes'] / 2**20:9.0f} "
              f"{r['max_rel_err']:8.1e} {'' if sp is None else f'{sp:.2f}x':>17s}")


PLOT_KEYS = (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward"), ("ac_step_ms", "AC step"))


def plot(info: dict, path: Path, keys=PLOT_KEYS, problem: str | None = None) -> None:
    """Bars of ``info["results"]`` (one group per impl, one bar per (key, label) of ``keys``), titled by
    ``problem`` (default: preset, tokens, routing) and the run's GPU, versions and date."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["impl"] for r in info["results"]]
    problem = problem or f"{info['preset']} T={info['tokens']} {info['routing']} routing"
    # Past four impls the figure widens and the names slant, so that neither they nor the bars' labels overlap.
    many = len(names) > 4
    fig, ax = plt.subplots(figsize=(max(8.0, 1.5 * len(names)), 5.0 if many else 4.5))
    width = 0.8 / len(keys)
    for i, (k, label) in enumerate(keys):
        vals = [r[k] for r in info["results"]]
        bars = ax.bar([j + i * width for j in range(len(names))], vals, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(names))], names,
                  rotation=20 if many else 0, ha="right" if many else "center")
    ax.set_ylabel("ms (lower is better)")
    ax.set_title(f"{problem} — {info['gpu']}\ntorch {info['torch']}, triton {info.get('triton', '?')}, "
                 f"{info['date'][:10]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> None:
    """The layer benchmark for parsed arguments (``megamoe.bench.cli``)."""
    args.impls = args.impls or DEFAULT_IMPLS
    if not torch.cuda.is_available():
        run_cpu(args)
        return
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}  torch {torch.__version__}")
    matmul_tflops = dense_matmul_tflops(device)
    print(f"dense bf16 8192^3 matmul: {matmul_tflops:.0f} TFLOP/s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for preset, tokens, routing in itertools.product(args.preset, args.tokens, args.routing):
        print(f"\n== {preset} T={tokens} {routing}", flush=True)
        info = run_gpu(args, preset, tokens, routing, matmul_tflops)
        tables = info.pop("_profile", None)
        print_table(info)
        stem = f"{info['preset']}-t{info['tokens']}-{info['routing']}-ep{info['ep']}"
        (out / f"{stem}.json").write_text(json.dumps(info, indent=1) + "\n")
        if tables:
            (out / f"{stem}-profile.txt").write_text(tables)
            print(f"wrote {out / stem}-profile.txt")
        if not args.no_plot:
            plot(info, out / f"{stem}.png")
        print(f"wrote {out / stem}.json" + ("" if args.no_plot else " and .png"))
