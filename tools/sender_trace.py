"""Where the EP kernels that send rows spend their time — the forward's send + up and the backward's send + dh'
— on real ranks (GPUs only):

    torchrun --nproc-per-node N -m tools.sender_trace [--preset P] [--tokens T] [--routing R,...]
                                                            [--comm-sms S] [--out DIR]

Runs the fused forward and backward (``comm_sms`` senders each way) a few times, then three times more with
the kernels' stamps on (``parallel.trace.recording``: the GPU's global timer at fixed points of every sending program
and of every GEMM tile program), and reports per rank and kernel, for the third traced step, from the
kernel's first stamp: when the senders have the counts and when they finish, what a block costs in each phase
(:data:`PHASES`) and their first rounds one by one (:data:`ROUNDS`), and the GEMM tiles: when the first starts
and the last ends, how long the busy ones waited for their rows and how long they worked (SM time), and, per
eighth of them in launch order, when their rows came. The stamps
cost a few registers and stores: the traced call is a little slower than an untraced one; its phases say
where the time goes, not the exact time. One JSON per (preset, routing) under ``--out``, with every
rank's figures per kernel ("up", "dh")."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megamoe.bench.common import (
    PRESETS,
    make_problem,
    source_digest,
    training_step,
    utc_now,
)
from megamoe.bench.ep import local_problem
from megamoe.parallel import trace
from megamoe.parallel.fused import moe_fused_ep

# A block's phases, between its stamps (parallel.senders.sender, send_rows): the destination rows, the routing weights'
# load and the row copies (loads, then stores into the owner); the slot ids and weights stored into the owner;
# the block barrier and the system-scope release of its arrival counts; from there to the next block's start.
PHASES = ("rows and copies", "store metadata", "barrier + release", "overflow + next entries")
ROUNDS = 8  # the senders' first rounds reported one by one (a round: every sender's j-th block)


def summarize(stamps: torch.Tensor, senders: int, stride: int, head: int, per_block: int, per_tile: int) -> dict:
    """Figures (µs from the kernel's first stamp, and per-phase block costs) from one traced call's stamps
    (``parallel.trace``: -1 where none was taken)."""
    s = stamps.cpu()
    t0 = int(s[s >= 0].min())

    def us(t):
        return (t - t0) / 1e3

    sender = s[: senders * stride].view(senders, stride)
    heads = sender[:, :head]
    blocks = sender[:, head:].reshape(senders, -1, per_block)
    phases = {name: [] for name in PHASES}
    for prog in blocks:
        taken = prog[(prog >= 0).all(dim=1)]
        for j, name in enumerate(PHASES[:3]):
            phases[name] += ((taken[:, j + 1] - taken[:, j]).double() / 1e3).tolist()
        phases[PHASES[3]] += ((taken[1:, 0] - taken[:-1, 3]).double() / 1e3).tolist()  # to the next block's start
    rounds = [blocks[:, j][(blocks[:, j] >= 0).all(dim=1)] for j in range(min(ROUNDS, blocks.shape[1]))]
    rounds = [r for r in rounds if r.shape[0]]  # round j: every sender's j-th block
    tiles = s[senders * stride:].view(-1, per_tile)
    ran = tiles[(tiles[:, 0] >= 0) & (tiles[:, 2] >= 0)]
    busy = ran[ran[:, 1] >= 0]  # in launch order, which is expert order
    wait = (busy[:, 1] - busy[:, 0]).double() / 1e3
    work = (busy[:, 2] - busy[:, 1]).double() / 1e3
    eighths = [chunk for chunk in torch.arange(busy.shape[0]).chunk(8) if chunk.numel()]
    return {
        "senders": senders,
        "counts_in_us": {"median": statistics.median(us(int(t)) for t in heads[:, 1]),
                         "max": max(us(int(t)) for t in heads[:, 1])},
        "senders_done_us": {"min": min(us(int(t)) for t in heads[:, 2]),
                            "median": statistics.median(us(int(t)) for t in heads[:, 2]),
                            "max": max(us(int(t)) for t in heads[:, 2])},
        "blocks_traced": len(phases[PHASES[0]]),
        "block_phase_us": {name: {"median": statistics.median(v), "mean": sum(v) / len(v), "total_sm_ms": sum(v) / 1e3}
                           for name, v in phases.items() if v},
        # the senders' first rounds: how long a block took (start to released), and when the round was released
        "block_us_by_round": [statistics.median(((r[:, 3] - r[:, 0]).double() / 1e3).tolist()) for r in rounds],
        "released_us_by_round": [statistics.median(us(int(t)) for t in r[:, 3]) for r in rounds],
        "tiles_busy": int(busy.shape[0]), "tiles_idle": int(ran.shape[0] - busy.shape[0]),
        "tiles_first_start_us": us(int(ran[:, 0].min())),
        "tiles_last_end_us": us(int(ran[:, 2].max())),
        "tile_wait_us": {"median": float(wait.median()), "p90": float(wait.quantile(0.9)),
                         "total_sm_ms": float(wait.sum()) / 1e3},
        "tile_work_us": {"median": float(work.median()), "total_sm_ms": float(work.sum()) / 1e3},
        # the busy tiles in eighths of launch (expert) order: when their rows were in, how long they waited
        "rows_in_us_by_eighth": [us(int(busy[c, 1].median())) for c in eighths],
        "wait_us_by_eighth": [float(wait[c].mean()) for c in eighths],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m tools.sender_trace",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--routing", default="random,skewed", help="comma-separated routings")
    p.add_argument("--comm-sms", type=int, default=32, help="sending programs of each kernel traced")
    p.add_argument("--out", default="benchmarks/results/traces")
    args = p.parse_args(argv)
    if args.comm_sms <= 0:
        p.error("--comm-sms must be at least 1: the trace is of the senders in the GEMMs' launches")
    if not torch.cuda.is_available():
        raise SystemExit("sender_trace reads the GPU's timer inside the kernels: it needs GPUs (torchrun on a "
                         "multi-GPU machine)")
    dist.init_process_group("nccl")
    try:
        rank, num_ranks = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dim, inter, num_experts, top_k = PRESETS[args.preset]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for routing in args.routing.split(","):
            problem = make_problem(args.tokens * num_ranks, dim, inter, num_experts, top_k, routing, torch.bfloat16,
                                   device, seed=0)
            _, call = training_step(functools.partial(moe_fused_ep, group=dist.group.WORLD, comm_sms=args.comm_sms),
                                    local_problem(problem, rank, num_ranks))
            for _ in range(3):
                call()
            with trace.recording() as recorded:
                # The first traced call compiles the traced kernels, which one rank may take much longer to do
                # than the other; the kept call, the third, is queued behind the second, so that the hosts'
                # launch times cannot skew the ranks (kept right after the barrier, 3 of 16 launches had one
                # rank's first rows ~1 ms late).
                call()
                torch.cuda.synchronize(device)
                dist.barrier()
                for _ in range(2):
                    call()
                torch.cuda.synchronize(device)
            mine = {kernel: summarize(t["stamps"], t["senders"], t["stride"], trace.TRACE_HEAD.value,
                                      trace.TRACE_PER_BLOCK.value, trace.TRACE_PER_TILE.value)
                    for kernel, t in recorded.items()}
            every = [None] * num_ranks
            dist.all_gather_object(every, mine)
            if rank == 0:
                info = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "ranks": num_ranks,
                        "source_sha256": source_digest(), "date": utc_now("seconds"),
                        "command": f"torchrun --nproc-per-node {num_ranks} -m tools.sender_trace "
                                   + " ".join(argv if argv is not None else sys.argv[1:]),
                        "preset": args.preset, "tokens_per_rank": args.tokens, "routing": routing,
                        "comm_sms": args.comm_sms, "per_rank": every}
                path = out / f"{args.preset}-t{args.tokens}-{routing}-ep{num_ranks}-sms{args.comm_sms}-trace.json"
                path.write_text(json.dumps(info, indent=1) + "\n")
                for (r, per_kernel), kernel in itertools.product(enumerate(every), ("up", "dh")):
                    f = per_kernel[kernel]
                    phases = ", ".join(f"{name} {v['median']:.2f}" for name, v in f["block_phase_us"].items())
                    print(f"{args.preset} {routing} rank {r} send + {kernel}: counts in {f['counts_in_us']['max']:.0f} µs; senders "
                          f"done {f['senders_done_us']['min']:.0f}-{f['senders_done_us']['max']:.0f} µs; tiles "
                          f"{f['tiles_first_start_us']:.0f}-{f['tiles_last_end_us']:.0f} µs ({f['tiles_busy']} busy: "
                          f"wait {f['tile_wait_us']['total_sm_ms']:.1f} SM-ms, work {f['tile_work_us']['total_sm_ms']:.1f}"
                          f" SM-ms, median {f['tile_work_us']['median']:.1f} µs); rows in by eighth "
                          f"{[round(t) for t in f['rows_in_us_by_eighth']]} µs, mean wait "
                          f"{[round(t) for t in f['wait_us_by_eighth']]} µs; first rounds released at "
                          f"{[round(t) for t in f['released_us_by_round']]} µs; block phases, median µs: {phases}",
                          flush=True)
                print(f"wrote {path}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
