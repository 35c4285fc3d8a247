"""What the benchmarks share, and the tests with them: the problem presets (:mod:`megamoe.models`) and how a
problem is made, the gradients of an implementation and its error against the fp32 reference, a training step to
time, per-kernel profiles, and the provenance every result records (:mod:`megamoe.provenance`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from megamoe import reference
from megamoe.models import PRESETS
from megamoe.provenance import git_commit, source_digest, utc_now
from megamoe.routing import route

# PRESETS and the provenance helpers live in the package (the training script uses them too); the benchmarks
# take them from here, with the rest of what they share.
__all__ = ["PRESETS", "ROUTINGS", "dense_matmul_tflops", "git_commit", "grads_of", "kernel_tables",
           "leaf_copies", "make_problem", "make_routing", "max_rel_err", "source_digest", "training_step", "utc_now"]

ROUTINGS = ("random", "balanced", "skewed")


def make_routing(kind: str, num_tokens: int, num_experts: int, top_k: int, device, generator) -> tuple:
    """(topk_idx int64, topk_weights fp32). ``random``: softmax router over N(0,1) logits, top-k,
    renormalised. ``balanced``: every expert gets the same number of rows (±1). ``skewed``: the same
    router with Zipf-like expert popularity (logit bias -1.2·ln(rank+1) over a random permutation)."""
    logits = torch.randn(num_tokens, num_experts, device=device, generator=generator)
    if kind == "skewed":
        rank = torch.randperm(num_experts, device=device, generator=generator).float()
        logits = logits - 1.2 * torch.log1p(rank)
    topk_idx, topk_weights = route(logits, top_k, score_func="softmax", norm_topk_prob=True)
    if kind == "balanced":
        slot = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k)
        topk_idx = slot % num_experts
    return topk_idx, topk_weights


def make_problem(num_tokens, dim, inter, num_experts, top_k, routing, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, dim, device=device, dtype=dtype, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, dim, device=device, dtype=dtype, generator=gen) / dim**0.5
    w2 = torch.randn(num_experts, dim, inter, device=device, dtype=dtype, generator=gen) / inter**0.5
    topk_idx, topk_weights = make_routing(routing, num_tokens, num_experts, top_k, device, gen)
    dy = torch.randn(num_tokens, dim, device=device, dtype=dtype, generator=gen)
    return x, topk_idx, topk_weights, w13, w2, dy


def grads_of(fn, x, topk_idx, topk_weights, w13, w2, dy):
    """[y, dx, d topk_weights, dw13, dw2] of ``fn`` for the output gradient ``dy`` (fresh leaves)."""
    leaves = [t.detach().requires_grad_() for t in (x, topk_weights, w13, w2)]
    xl, wl, w13l, w2l = leaves
    y = fn(xl, topk_idx, wl, w13l, w2l)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return [y.detach(), *grads]


def max_rel_err(fn, problem) -> float:
    """max over (y, dx, d topk_weights, dw13, dw2) of max|out - ref| / max|ref|, ref = fp32 loop."""
    x, topk_idx, topk_weights, w13, w2, dy = problem
    ref = grads_of(lambda *a: reference.moe_loop(*a, fp32=True), x, topk_idx, topk_weights, w13, w2, dy)
    out = grads_of(fn, x, topk_idx, topk_weights, w13, w2, dy)
    return max(((o.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for o, r in zip(out, ref))


def dense_matmul_tflops(device, m: int = 8192, n: int = 8192, k: int = 8192, batch: int = 1) -> float:
    """TFLOP/s of torch's bf16 (m, k) x (k, n) matmul (cuBLAS), ``batch`` of them at once where more than one (the
    equal-work ceiling of a grouped GEMM over ``batch`` experts of ``m`` rows each)."""
    from triton.testing import do_bench

    lead = () if batch == 1 else (batch,)
    a = torch.randn(*lead, m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(*lead, k, n, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * batch * m * n * k / ms / 1e9


def leaf_copies(problem) -> list:
    """Fresh leaf copies of ``problem``'s x, routing weights, w13 and w2: what a timed step differentiates."""
    x, _, topk_weights, w13, w2, _ = problem
    return [t.detach().clone().requires_grad_() for t in (x, topk_weights, w13, w2)]


def training_step(fn: Callable, problem, leaves: list | None = None) -> tuple[Callable, Callable]:
    """``(fwd, fwd_bwd)`` over ``leaves`` (default: fresh :func:`leaf_copies` of ``problem``): ``fwd()`` runs
    ``fn`` on them; ``fwd_bwd()`` also runs the backward with the problem's dy and then drops the gradients, so
    that no step accumulates into the last one's."""
    topk_idx, dy = problem[1], problem[5]
    leaves = leaf_copies(problem) if leaves is None else leaves

    def fwd():
        return fn(leaves[0], topk_idx, *leaves[1:])

    def fwd_bwd():
        fwd().backward(dy)
        for t in leaves:
            t.grad = None

    return fwd, fwd_bwd


def kernel_tables(variants: dict, calls: int = 5, rows: int = 15) -> str:
    """Per-kernel CUDA time of each variant (name → function), ``calls`` calls after three warm-up calls,
    as torch.profiler tables of ``rows`` rows: where a variant's time goes, kernel by kernel (CPU time without a
    GPU). On
    a GPU each variant also gets its host-side table (CUDA runtime calls: a synchronising call or a
    cudaMalloc shows there) and the wall time of the back-to-back calls: the GPU idled at most the wall
    time less the kernels' total (which also holds the first launch's latency and the profiler's own
    host work). Without a GPU (kernels in Triton's interpreter: which kernels run, not how fast) one call each,
    without warm-up."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls = calls if cuda else 1
    out = []
    for name, fn in variants.items():
        for _ in range(3 if cuda else 0):
            fn()
        sync()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            wall_ms = (time.perf_counter() - start) * 1e3 / calls
        averages = prof.key_averages()
        out.append(f"===== {name} ({calls} calls, {wall_ms:.3f} ms wall per call under the profiler)\n"
                   + averages.table(sort_by="self_cuda_time_total" if cuda else "cpu_time_total", row_limit=rows,
                                    max_name_column_width=50))
        if cuda:
            out.append(f"----- {name}: host side\n"
                       + averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    return "\n".join(out) + "\n"
