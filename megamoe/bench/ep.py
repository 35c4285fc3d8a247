"""Expert-parallel layer benchmark: ``torchrun --nproc-per-node N -m megamoe.bench --ep``.

Every rank holds T tokens (``--tokens`` is per rank) and E/N experts of the preset (rank r owns
experts [r·E/N, (r+1)·E/N)). Implementations, all through the all-to-all dispatcher of
:mod:`megamoe.parallel.all_to_all` (TorchTitan's path: host-synced splits, ``all_to_all_single``):

* ``a2a_grouped_mm`` / ``a2a_grouped_mm_compiled`` — local experts by ``torch._grouped_mm``, eager or
  ``torch.compile``'d: the baselines of issue 4;
* ``a2a_megamoe`` — the same exchange with megamoe's fused kernels for the local experts (what
  ``megamoe.moe(group=...)`` runs where the fused protocol cannot, or with ``MEGAMOE_EP=all_to_all``);
* ``fused`` — the device-side protocol (:mod:`megamoe.parallel.fused`) with ``comm_sms=0``: GPUs only;
  ``fused_smsN`` (``--comm-sms N``) — the same with the rows sent from N programs of the up kernel's
  launch, overlapping its GEMM; ``fused_smsF_B`` (``--comm-sms-split F:B``) — F such programs in the
  forward, B in the backward.

Per impl: forward, forward+backward and the activation-checkpointing step, as the maximum over ranks of
each rank's median. The all-to-all impls keep the exchanged rows for their backward, so their step is
forward + forward-and-backward; the fused impls keep only their inputs and the routing plan (the
backward sends the rows again), so their step is their forward-and-backward, as for megamoe in the layer
benchmark; and, for the exchange alone, the time of the two ``all_to_all_single`` of a forward and the
bytes they move (GB/s per rank). Every rank runs the same fixed number of iterations (``do_bench`` picks
its own count per rank, which would desynchronise the collectives).

The overlap figure (with ``fused``): the fused forward against ``compute_only`` — the same rank's expert
work with no communication, megamoe's one-device kernels on the rows its experts receive — and
``comm_only`` — the fused protocol's rows out and back with no experts (:func:`round_trip`),
both timed in the same run: per fused impl, ``overlap_fwd = fwd / max(compute_only fwd, comm_only fwd)``
(1.0 is perfect overlap; compute + comm, no overlap at all, is up to 2.0).

Without GPUs (gloo on CPU): the tiny preset, checked against the one-device fp32 reference on the
gathered problem, outputs and every gradient; it says that timings need GPUs.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import triton

import megamoe
from megamoe import reference
from megamoe.bench.common import (
    PRESETS,
    git_commit,
    grads_of,
    kernel_tables,
    make_problem,
    source_digest,
    training_step,
    utc_now,
)
from megamoe.env import interpreting
from megamoe.kernels.plan import build_plan
from megamoe.parallel import protocol
from megamoe.parallel.all_to_all import AllToAll, exchange_splits, moe_all_to_all
from megamoe.parallel.fused import moe_fused_ep, workspace_for
from megamoe.parallel.loopback import loopback_backward, loopback_forward, round_trip
from megamoe.parallel.workspace import loopback_workspaces
from megamoe.provenance import gpu_record

EP_IMPLS = ("a2a_grouped_mm", "a2a_grouped_mm_compiled", "a2a_megamoe", "fused")
ERROR_TOKENS_PER_RANK = 64  # each rank's tokens in the small problem every impl is checked on


def rank_share(problem, rank: int, num_ranks: int) -> tuple[slice, slice]:
    """This rank's tokens and experts of a problem made for all ranks (tokens split evenly)."""
    num_tokens, per_rank = problem[0].shape[0], problem[3].shape[0] // num_ranks
    return (slice(rank * num_tokens // num_ranks, (rank + 1) * num_tokens // num_ranks),
            slice(rank * per_rank, (rank + 1) * per_rank))


def local_problem(problem, rank: int, num_ranks: int):
    """(x, topk_idx, topk_weights, w13, w2, dy) of this rank's share."""
    x, idx, w, w13, w2, dy = problem
    tok, exp = rank_share(problem, rank, num_ranks)
    return x[tok], idx[tok], w[tok], w13[exp].contiguous(), w2[exp].contiguous(), dy[tok]


def received_problem(problem, rank: int, num_ranks: int):
    """The expert work this rank does in an EP step, as a one-device problem with no communication:
    every row routed to its experts, from every rank's tokens, with K = 1 and routing weight 1 (the
    compute-only figure). Host-synchronising (``nonzero``): set-up only."""
    x, idx, _, w13, w2, dy = problem
    _, exp = rank_share(problem, rank, num_ranks)
    token, k = ((idx >= exp.start) & (idx < exp.stop)).nonzero(as_tuple=True)
    local = (idx[token, k] - exp.start)[:, None]
    return (x[token], local, torch.ones(local.shape, device=x.device, dtype=torch.float32), w13[exp].contiguous(),
            w2[exp].contiguous(), dy[token])


def ep_impls(names, group, max_tokens_per_rank: int, comm_sms=()) -> dict:
    """name → fn(x, topk_idx, topk_weights, w13, w2) for ``names`` (of EP_IMPLS), plus ``fused_smsN`` for each
    N of ``comm_sms`` (``fused_smsF_B`` for a pair (F, B): forward, backward); the fused impls size their
    workspace for ``max_tokens_per_rank`` (at least the largest timed problem and
    :data:`ERROR_TOKENS_PER_RANK`)."""
    unknown = [n for n in names if n not in EP_IMPLS]
    if unknown:
        raise ValueError(f"unknown EP impl(s) {unknown}; choose from {EP_IMPLS}")
    impls = {}
    for name in names:
        if name == "a2a_grouped_mm":
            experts = reference.moe_grouped_mm
        elif name == "a2a_grouped_mm_compiled":
            experts = torch.compile(reference.moe_grouped_mm, fullgraph=True)
        elif name == "fused":
            impls[name] = functools.partial(moe_fused_ep, group=group, max_tokens_per_rank=max_tokens_per_rank)
            continue
        else:
            experts = megamoe.moe
        impls[name] = functools.partial(_with_group, group=group, experts=experts)
    if comm_sms:
        for n in comm_sms:  # an int, or a pair (forward, backward)
            name = f"fused_sms{n}" if isinstance(n, int) else "fused_sms{}_{}".format(*n)
            impls[name] = functools.partial(moe_fused_ep, group=group, comm_sms=n,
                                            max_tokens_per_rank=max_tokens_per_rank)
    return impls


def _with_group(*problem, group, experts):
    return moe_all_to_all(*problem, group, experts=experts)


def timed(fn, iters: int, warmup: int, device) -> float:
    """Median ms of ``fn`` over ``iters`` calls, the same count on every rank. On a GPU, CUDA events around
    each call and no host sync between calls, as ``triton.testing.do_bench`` times the one-device layer: the
    host runs ahead of the GPU as in training, so a call's launch time shows only where the host is slower
    than the GPU (impls that sync the host, like the all-to-all's splits, still pay it). Wall clock on CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def reference_share(problem, rank: int, num_ranks: int) -> list[torch.Tensor]:
    """(y, dx, d weights) of this rank's tokens and (dw13, dw2) of its experts, from the one-device fp32
    layer on the whole problem."""
    ref = grads_of(lambda *a: reference.moe_loop(*a, fp32=True),
                   *[t.float() if t.is_floating_point() else t for t in problem])
    tok, exp = rank_share(problem, rank, num_ranks)
    return [ref[0][tok], ref[1][tok], ref[2][tok], ref[3][exp], ref[4][exp]]


def gathered_error(fn, problem, ref_share, rank: int, num_ranks: int) -> float:
    """max over (y, dx, d weights, dw13, dw2) of max|out - ref| / max|ref| for this rank's share."""
    out = grads_of(fn, *local_problem(problem, rank, num_ranks))
    return max(((o.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for o, r in zip(out, ref_share))


def exchange_only(problem_local, group):
    """The forward's two ``all_to_all_single`` of rows on this problem's splits (no experts): a function
    to time, and the bytes this rank sends out and back."""
    x, idx, _, w13, *_ = problem_local
    _, _, send_splits, recv_splits = exchange_splits(idx, w13.shape[0], group)
    rows = x.new_empty(sum(send_splits), x.shape[1])

    def run():
        return AllToAll.apply(AllToAll.apply(rows, recv_splits, send_splits, group), send_splits, recv_splits, group)

    moved = (sum(send_splits) + sum(recv_splits)) * x.shape[1] * x.element_size()
    return run, moved


def main(args) -> None:
    """Entry point of ``python -m megamoe.bench --ep`` (under torchrun, or with a process group already
    initialised by the caller); with ``--loopback R``, one process and R virtual ranks."""
    cuda = torch.cuda.is_available()
    if args.loopback:
        run_loopback(args, cuda)
        return
    owns_group = not dist.is_initialized()
    if owns_group:
        if "RANK" not in os.environ:
            raise SystemExit("--ep runs under torchrun: torchrun --nproc-per-node N -m megamoe.bench --ep ...")
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        run(args, cuda)
        dist.barrier()  # rank 0 hosts the rendezvous store: nobody tears down while others still use it
    finally:
        if owns_group:
            dist.destroy_process_group()


def run(args, cuda: bool) -> None:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = dist.group.WORLD
    names = [n.strip() for n in args.impls.split(",") if n.strip()] if args.impls else list(EP_IMPLS)
    if not cuda:  # the compiled grouped_mm takes bf16 only, which the CPU check does not use; the fused
        names = [n for n in names if n not in ("a2a_grouped_mm_compiled", "fused")]  # protocol needs GPUs
    impls = ep_impls(names, group, max(*args.tokens, ERROR_TOKENS_PER_RANK),
                     [*args.comm_sms, *args.comm_sms_split] if cuda else ())
    say = print if rank == 0 else (lambda *a, **k: None)
    if not cuda:
        dim, inter, num_experts, top_k = PRESETS["tiny"]
        say(f"No CUDA GPU: timings need GPUs. Checking the EP path with {num_ranks} gloo ranks on a tiny "
            f"problem instead (8 tokens per rank, D={dim}, I={inter}, E={num_experts}, K={top_k}, fp32).")
        if num_experts % num_ranks:
            raise SystemExit(f"the tiny preset's {num_experts} experts do not split over {num_ranks} ranks")
        problem = make_problem(8 * num_ranks, dim, inter, num_experts, top_k, args.routing[0], torch.float32,
                               "cpu", args.seed)
        worst = 0.0
        ref = reference_share(problem, rank, num_ranks)
        for name, fn in impls.items():
            err = max_over_ranks(gathered_error(fn, problem, ref, rank, num_ranks), device)
            worst = max(worst, err)
            say(f"  {name:26s} max rel err vs the one-device fp32 reference (y and all grads): {err:.2e}")
        if worst > 1e-4:
            raise SystemExit(f"FAILED: an EP implementation disagrees with the reference ({worst:.2e} > 1e-4)")
        say("OK. Run on GPUs (torchrun --nproc-per-node N) for timings.")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for preset, tokens, routing in itertools.product(args.preset, args.tokens, args.routing):
        info = measure(impls, group, preset, tokens, routing, device, args.ep_iters, args.seed, args.profile)
        tables = info.pop("_profile", None)
        say(f"\n{preset} T={tokens}/rank {routing} EP={num_ranks}: exchange {info['exchange_fwd_ms']:.3f} ms "
            f"({info['exchange_gb_per_s_rank0']:.0f} GB/s on rank 0); compute only: fwd "
            f"{info['compute_only_fwd_ms']:.3f}, fwd+bwd {info['compute_only_fwd_bwd_ms']:.3f} ms")
        if "comm_only_fwd_ms" in info:
            say(f"  fused protocol, rows out and back only: {info['comm_only_fwd_ms']:.3f} ms")
        for r in info["results"]:
            overlap = f"  overlap figure {r['overlap_fwd']:.2f}" if "overlap_fwd" in r else ""
            say(f"  {r['impl']:26s} fwd {r['fwd_ms']:8.3f}  fwd+bwd {r['fwd_bwd_ms']:8.3f}  "
                f"AC step {r['ac_step_ms']:8.3f} ms  rel err {r['max_rel_err']:.1e}{overlap}")
        stem = f"{preset}-t{tokens}-per-rank-{routing}-ep{num_ranks}"  # not the layer benchmark's names
        if rank == 0:
            (out / f"{stem}.json").write_text(json.dumps(info, indent=1) + "\n")
            say(f"wrote {out / stem}.json")
        if tables:  # every rank's: an owner that waits longer for its rows shows it
            (out / f"{stem}-rank{rank}-profile.txt").write_text(tables)
            say(f"wrote {out / stem}-rank<r>-profile.txt, one per rank")


def measure(impls: dict, group, preset: str, tokens: int, routing: str, device, iters: int, seed: int,
            profile: bool = False) -> dict:
    """Times and errors of every impl on one problem (``tokens`` per rank), as the result JSON holds them.
    bf16 on a GPU; fp32 on CPU (where it only exercises the code: CPU timings mean nothing). ``profile``:
    also ``"_profile"``, this rank's per-kernel CUDA time tables (:func:`kernel_tables`) of each fused impl's
    forward and forward+backward and of the halves of the overlap figure (compute only: forward and
    forward+backward; comm only: forward): where the fused forward's time goes beyond max(compute only,
    comm only), and the backward's beyond the compute-only backward."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    dim, inter, num_experts, top_k = PRESETS[preset]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    problem = make_problem(tokens * num_ranks, dim, inter, num_experts, top_k, routing, dtype, device, seed)
    small = make_problem(ERROR_TOKENS_PER_RANK * num_ranks, dim, inter, num_experts, top_k, routing, dtype, device,
                         seed + 1)
    small_ref = reference_share(small, rank, num_ranks)
    local = local_problem(problem, rank, num_ranks)
    results, profiled = [], {}
    for name, fn in impls.items():
        fwd, fwd_bwd = training_step(fn, local)
        if name.startswith("fused"):
            profiled[f"{name} forward"] = fwd
            profiled[f"{name} forward+backward"] = fwd_bwd
        fwd_ms = max_over_ranks(timed(fwd, iters, 3, device), device)
        fwd_bwd_ms = max_over_ranks(timed(fwd_bwd, iters, 3, device), device)
        err = max_over_ranks(gathered_error(fn, small, small_ref, rank, num_ranks), device)
        keeps_activations = not name.startswith("fused")  # see the module docstring
        results.append({"impl": name, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
                        "ac_step_ms": fwd_ms + fwd_bwd_ms if keeps_activations else fwd_bwd_ms,
                        "fwd_plus_fwd_bwd_ms": fwd_ms + fwd_bwd_ms, "max_rel_err": err})
    exchange, moved = exchange_only(local, group)
    comm_ms = max_over_ranks(timed(exchange, iters, 3, device), device)
    fused = [r for r in results if r["impl"].startswith("fused")]
    overlap, halves = compute_and_comm_only(problem, local, group, device, iters, fused_comm=bool(fused))
    for r in fused:
        r["overlap_fwd"] = r["fwd_ms"] / max(overlap["compute_only_fwd_ms"], overlap["comm_only_fwd_ms"])
    if profile:  # every rank profiles the same calls in the same order: the fused ones wait on each other
        overlap["_profile"] = kernel_tables({**profiled, **halves})
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "ranks": num_ranks, "commit": git_commit(),
        "source_sha256": source_digest(),
        "date": utc_now("seconds"),
        "command": f"torchrun --nproc-per-node {num_ranks} -m megamoe.bench " + " ".join(sys.argv[1:]),
        "preset": preset, "tokens_per_rank": tokens, "routing": routing, "ep": num_ranks, "dtype": str(dtype),
        "dim": dim, "intermediate": inter, "experts": num_experts, "top_k": top_k,
        "exchange_fwd_ms": comm_ms, "exchange_fwd_bytes_rank0": moved,
        "exchange_gb_per_s_rank0": moved / comm_ms / 1e6, **overlap, "results": results,
    }


def compute_and_comm_only(problem, local, group, device, iters: int, fused_comm: bool) -> tuple[dict, dict]:
    """The two halves of the overlap figure, as the maximum over ranks of each rank's median: this rank's
    expert work alone (one-device megamoe on :func:`received_problem`, forward and forward+backward) and,
    if ``fused_comm``, the fused protocol's forward communication alone (:func:`round_trip`).
    Also the calls timed (name → function: compute only forward and forward+backward, comm only forward),
    for a profile."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    received = received_problem(problem, rank, num_ranks)
    fwd, fwd_bwd = training_step(megamoe.moe, received)
    halves = {"compute only forward": fwd, "compute only forward+backward": fwd_bwd}
    out = {"compute_only_fwd_ms": max_over_ranks(timed(fwd, iters, 3, device), device),
           "compute_only_fwd_bwd_ms": max_over_ranks(timed(fwd_bwd, iters, 3, device), device)}
    if fused_comm:
        x, idx, w, w13, *_ = local
        ws = workspace_for(group, w13.shape[0], x.shape[0], idx.shape[1], x.shape[1], x.dtype)
        plan = build_plan(idx, w13.shape[0] * num_ranks)
        halves["comm only forward"] = functools.partial(round_trip, ws, x, idx, w, plan)
        out["comm_only_fwd_ms"] = max_over_ranks(timed(halves["comm only forward"], iters, 3, device), device)
    return out, halves


def run_loopback(args, cuda: bool) -> None:
    """``--ep --loopback R``: the fused protocol's R virtual ranks on one device against the plain
    one-device fused layer on the same (gathered) problem: the cost of the EP machinery (counts, waits,
    row copies out and back) with no NVLink in the way. Forward and forward+backward. Without a GPU: a
    tiny problem through the interpreter, checked against the fp32 reference."""
    num_ranks = args.loopback
    if not cuda:
        print(f"No CUDA GPU: timings need a GPU. Checking the loopback protocol ({num_ranks} virtual ranks) on "
              "a tiny problem instead.")
        if not interpreting():
            raise SystemExit("set TRITON_INTERPRET=1: the protocol's kernels are Triton kernels")
        info = loopback_case("tiny", 8, args.routing[0], num_ranks, args.seed, timed=False, comm_sms=args.comm_sms)
        err = max(v for k, v in info.items() if k.startswith("loopback_fwd_max_rel_err"))
        print(f"  loopback forward, max rel err vs the fp32 reference: {err:.2e}")
        if err > 1e-4:
            raise SystemExit("FAILED: the loopback forward disagrees with the reference")
        print("OK. Run on a GPU for timings.")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for preset, tokens, routing in itertools.product(args.preset, args.tokens, args.routing):
        info = loopback_case(preset, tokens, routing, num_ranks, args.seed, timed=True, comm_sms=args.comm_sms,
                             profile=args.profile)
        tables = info.pop("_profile", None)
        print(f"{preset} T={tokens}/rank {routing} loopback R={num_ranks}: fwd {info['loopback_fwd_ms']:.3f} ms "
              f"(plain {info['plain_fwd_ms']:.3f}, {100 * info['machinery_cost_fwd']:+.1f}%), fwd+bwd "
              f"{info['loopback_fwd_bwd_ms']:.3f} ms (plain {info['plain_fwd_bwd_ms']:.3f}, "
              f"{100 * info['machinery_cost_fwd_bwd']:+.1f}%), rel err {info['loopback_fwd_max_rel_err']:.1e}; "
              f"between ranks {sum(info['bytes_between_ranks'].values()) / 1e6:.1f} MB per fwd+bwd "
              f"({info['bytes_between_ranks']['fwd_out'] / 1e6:.1f} MB of rows out in the forward)")
        if info["fp8"]:
            print(f"  blockwise FP8: fwd {info['loopback_fp8_fwd_ms']:.3f} ms, fwd+bwd "
                  f"{info['loopback_fp8_fwd_bwd_ms']:.3f} ms ({info['fp8_speedup_fwd_bwd']:.2f}x the bf16 "
                  f"loopback's; plain FP8 {info['plain_fp8_fwd_bwd_ms']:.3f} ms, "
                  f"{info['machinery_cost_fp8_fwd_bwd']:+.1%}), rel err "
                  f"{info['loopback_fp8_fwd_max_rel_err']:.1e} (plain FP8 {info['plain_fp8_fwd_max_rel_err']:.1e}); "
                  f"rows out in the forward {info['bytes_between_ranks_fp8']['fwd_out'] / 1e6:.1f} MB")
        for n in args.comm_sms:
            print(f"  rows sent from {n} programs of the expert kernels: fwd {info[f'loopback_fwd_ms_sms{n}']:.3f} ms "
                  f"({100 * info[f'machinery_cost_fwd_sms{n}']:+.1f}%), fwd+bwd "
                  f"{info[f'loopback_fwd_bwd_ms_sms{n}']:.3f} ms ({100 * info[f'machinery_cost_fwd_bwd_sms{n}']:+.1f}%), "
                  f"rel err {info[f'loopback_fwd_max_rel_err_sms{n}']:.1e}")
        stem = f"{preset}-t{tokens}-{routing}-loopback{num_ranks}" + ("" if protocol.BOUNDED else "-unbounded-waits")
        (out / f"{stem}.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"wrote {out / stem}.json")
        if tables:
            (out / f"{stem}-profile.txt").write_text(tables)
            print(f"wrote {out / stem}-profile.txt")


def loopback_case(preset: str, tokens: int, routing: str, num_ranks: int, seed: int, timed: bool,
                  comm_sms=(), profile: bool = False) -> dict:
    """One problem (``tokens`` per virtual rank): the loopback forward's error against the fp32
    reference (and the plain one-device layer's, the bar it is held to) and, if ``timed`` (a GPU), its
    times against the plain layer; the same with the rows sent from N programs of the expert kernels'
    launches for each N of ``comm_sms`` (the error: forward); where D and I are multiples of 128, the same in
    blockwise FP8 (``loopback_forward(fp8=True)``, its rows out in e4m3; the bar: the plain layer's FP8 error),
    its bytes between ranks, its forward+backward speed-up over the bf16 loopback's and its machinery cost over the
    plain FP8 layer's forward+backward.
    ``profile``: also ``"_profile"``, per-kernel CUDA time tables of every variant (text)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    dim, inter, num_experts, top_k = PRESETS[preset]
    if num_experts % num_ranks:
        raise SystemExit(f"{preset}: {num_experts} experts do not split over {num_ranks} ranks")
    problem = make_problem(tokens * num_ranks, dim, inter, num_experts, top_k, routing, dtype, device, seed)
    x, idx, w, w13, w2, _ = problem
    shares = [local_problem(problem, r, num_ranks) for r in range(num_ranks)]
    ranks, dys = [share[:5] for share in shares], [share[5] for share in shares]
    ref = reference.moe_loop(*[t.float() if t.is_floating_point() else t for t in problem[:5]], fp32=True)
    info = {"preset": preset, "tokens_per_rank": tokens, "routing": routing, "loopback_ranks": num_ranks,
            "dim": dim, "intermediate": inter, "experts": num_experts, "top_k": top_k,
            "bounded_waits": bool(protocol.BOUNDED)}  # False only under MEGAMOE_EP_UNBOUNDED_WAITS=1
    # What crosses between the virtual ranks (each rank's rows for its own experts stay), all ranks together
    def moved(fp8_rows: bool = False) -> dict[str, int]:
        per_rank = [protocol.bytes_between_ranks(idx_r, r, num_experts // num_ranks, dim, x.element_size(),
                                                 fp8_rows=fp8_rows) for r, (_, idx_r, *_) in enumerate(ranks)]
        return {k: sum(m[k] for m in per_rank) for k in per_rank[0]}

    info["bytes_between_ranks"] = moved()
    fp8 = info["fp8"] = dim % 128 == 0 and inter % 128 == 0
    if fp8:
        info["bytes_between_ranks_fp8"] = moved(fp8_rows=True)

    def rel_err(y):
        return ((y.float() - ref).abs().max() / ref.abs().max()).item()

    info["plain_fwd_max_rel_err"] = rel_err(megamoe.moe(*problem[:5]))
    if fp8:
        info["plain_fp8_fwd_max_rel_err"] = rel_err(megamoe.moe(*problem[:5], precision="fp8"))

    windows = {}  # each variant's timing window (UTC), to read against gpu-check's clocks.csv

    def timed_variants(variants: dict) -> dict[str, float]:
        from triton.testing import do_bench

        for fn in variants.values():  # every variant autotunes (or takes its twin's tiles) before any is timed
            fn()
        torch.cuda.synchronize()
        ms = {}
        for name, fn in variants.items():
            started = utc_now()
            ms[name] = do_bench(fn, return_mode="median")
            windows[name] = [started, utc_now()]
        return ms

    # The plain layer is timed first, before the loopback's workspaces exist and its variants run: timed after them,
    # its medians read 12-20% slow on the H200 in some runs (docs/PERFORMANCE.md; the cause is not found).
    if timed:
        plain = {"plain forward": lambda: megamoe.moe(x, idx, w, w13, w2),
                 "plain forward+backward": training_step(megamoe.moe, problem)[1]}
        if fp8:
            plain["plain forward+backward, fp8"] = training_step(functools.partial(megamoe.moe, precision="fp8"),
                                                                 problem)[1]
        ms = timed_variants(plain)
    workspaces = loopback_workspaces(num_ranks, num_experts // num_ranks, num_ranks * tokens * top_k,
                                     tokens, tokens * top_k, dim, dtype, device)
    for n, suffix in [(0, ""), *((n, f"_sms{n}") for n in comm_sms)]:
        info[f"loopback_fwd_max_rel_err{suffix}"] = rel_err(torch.cat(loopback_forward(workspaces, ranks,
                                                                                               comm_sms=n)))
    if fp8:
        info["loopback_fp8_fwd_max_rel_err"] = rel_err(torch.cat(loopback_forward(workspaces, ranks, fp8=True)))
    if not timed:
        return info

    def fwd(n=0):
        return loopback_forward(workspaces, ranks, comm_sms=n)

    def bwd(n=0):
        return loopback_backward(workspaces, ranks, dys, comm_sms=n)

    variants = {"loopback forward": fwd, "loopback backward": bwd}
    for n in comm_sms:
        variants[f"loopback forward, comm_sms={n}"] = functools.partial(fwd, n)
        variants[f"loopback backward, comm_sms={n}"] = functools.partial(bwd, n)
    if fp8:
        variants["loopback forward, fp8"] = lambda: loopback_forward(workspaces, ranks, fp8=True)
        variants["loopback backward, fp8"] = lambda: loopback_backward(workspaces, ranks, dys, fp8=True)
    ms.update(timed_variants(variants))
    times = {"loopback_fwd_ms": ms["loopback forward"], "loopback_bwd_ms": ms["loopback backward"],
             "plain_fwd_ms": ms["plain forward"], "plain_fwd_bwd_ms": ms["plain forward+backward"]}
    times["loopback_fwd_bwd_ms"] = times["loopback_fwd_ms"] + times["loopback_bwd_ms"]
    for n in comm_sms:
        f_ms = ms[f"loopback forward, comm_sms={n}"]
        fb_ms = f_ms + ms[f"loopback backward, comm_sms={n}"]
        times.update({f"loopback_fwd_ms_sms{n}": f_ms, f"loopback_fwd_bwd_ms_sms{n}": fb_ms,
                      f"machinery_cost_fwd_sms{n}": f_ms / times["plain_fwd_ms"] - 1,
                      f"machinery_cost_fwd_bwd_sms{n}": fb_ms / times["plain_fwd_bwd_ms"] - 1})
    if fp8:
        times["loopback_fp8_fwd_ms"] = ms["loopback forward, fp8"]
        times["loopback_fp8_fwd_bwd_ms"] = times["loopback_fp8_fwd_ms"] + ms["loopback backward, fp8"]
        times["fp8_speedup_fwd_bwd"] = times["loopback_fwd_bwd_ms"] / times["loopback_fp8_fwd_bwd_ms"]
        times["plain_fp8_fwd_bwd_ms"] = ms["plain forward+backward, fp8"]
        times["machinery_cost_fp8_fwd_bwd"] = times["loopback_fp8_fwd_bwd_ms"] / times["plain_fp8_fwd_bwd_ms"] - 1
    if profile:
        times["_profile"] = kernel_tables({**plain, **variants})
    return {
        **gpu_record("python -m megamoe.bench " + " ".join(sys.argv[1:])), **info, **times, "timed_utc": windows,
        "machinery_cost_fwd": times["loopback_fwd_ms"] / times["plain_fwd_ms"] - 1,
        "machinery_cost_fwd_bwd": times["loopback_fwd_bwd_ms"] / times["plain_fwd_bwd_ms"] - 1,
    }


