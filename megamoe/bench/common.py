"""What the benchmarks share, and the tests with them: the problem presets and how a problem is made, the
gradients of an implementation and its error against the fp32 reference, a training step to time, per-kernel
profiles, and the provenance every result records (GPU and versions are read where it is written; the code's
commit and source digest, the date and the command here)."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megamoe import reference
from megamoe.routing import route

PRESETS = {
    # name: (D hidden, I expert intermediate, E experts, K top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "tiny": (64, 32, 8, 2),
}
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


def dense_matmul_tflops(device) -> float:
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * n**3 / ms / 1e9


def training_step(fn: Callable, problem) -> tuple[Callable, Callable]:
    """``(fwd, fwd_bwd)`` over fresh leaf copies of ``problem``'s x, routing weights, w13 and w2: ``fwd()``
    runs ``fn`` on them; ``fwd_bwd()`` also runs the backward with the problem's dy and then drops the
    gradients, so that no step accumulates into the last one's."""
    x, topk_idx, topk_weights, w13, w2, dy = problem
    leaves = [t.detach().clone().requires_grad_() for t in (x, topk_weights, w13, w2)]

    def fwd():
        return fn(leaves[0], topk_idx, *leaves[1:])

    def fwd_bwd():
        fwd().backward(dy)
        for t in leaves:
            t.grad = None

    return fwd, fwd_bwd


def csv_of(allowed):
    """argparse type: a comma-separated list, each item in ``allowed`` (or converted by it)."""
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if callable(allowed):
            return [allowed(item) for item in items]
        bad = [item for item in items if item not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{bad or text!r} not in {sorted(allowed)}")
        return items
    return parse


def source_digest() -> str:
    """sha256 over the megamoe package's sources (paths and bytes): identifies the code that ran even
    where the checkout's git metadata is stale (a copy of the working tree run on another machine
    whose .git can lag behind). Recompute on any commit with the same function to match a result."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def utc_now(timespec: str = "milliseconds") -> str:
    """The time in UTC, ISO 8601: a result's ``date`` (seconds) and its timing windows (milliseconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec=timespec)


def git_commit() -> str | None:
    """HEAD of the checkout the running megamoe package belongs to ("-dirty" with uncommitted changes), or
    None when the package is not that checkout's own: a copied working tree, or a copy of another branch
    inside this checkout (an ``_exp/B`` folder, say), whose enclosing repository's HEAD
    would name code that did not run."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=root).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None  # not a git checkout


def kernel_tables(variants: dict, calls: int = 5) -> str:
    """Per-kernel CUDA time of each variant (name → function), ``calls`` calls after three warm-up calls,
    as torch.profiler tables: where a variant's time goes, kernel by kernel (CPU time without a GPU). On
    a GPU each variant also gets its host-side table (CUDA runtime calls: a synchronising call or a
    cudaMalloc shows there) and the wall time of the back-to-back calls: the GPU idled at most the wall
    time less the kernels' total (which also holds the first launch's latency and the profiler's own
    host work)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = []
    for name, fn in variants.items():
        for _ in range(3):
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
                   + averages.table(sort_by="self_cuda_time_total" if cuda else "cpu_time_total", row_limit=15,
                                    max_name_column_width=50))
        if cuda:
            out.append(f"----- {name}: host side\n"
                       + averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    return "\n".join(out) + "\n"
