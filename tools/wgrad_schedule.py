"""The weight-gradient kernels' blocks dealt to the programs, modelled on the CPU (no GPU needed):

    python -m tools.wgrad_schedule [--preset P] [--tokens T] [--routing random,skewed] [--block-cost C]

A persistent kernel's program walks its blocks in a grid-stride loop, and a weight-gradient block's time grows with
its expert's rows (a K-step per BK of them). The model counts each program's K-steps (plus ``--block-cost`` per block,
its fixed cost in K-steps) for the layer benchmark's routing (``bench.common.make_routing``, seed 0) and reports the
launch's time, the most loaded program's count, over the balanced time (the mean), for each weight gradient of the
bf16 and FP8 kernels: in expert order (``gluon_sm90.wgrad_block`` without BY_SIZE), in size order (with it: the
experts by rows, most first, each full round of blocks dealt from alternate ends), and, for comparison, taken in size
order by whichever program is free first (a dynamic scheduler, not built: an atomic block counter). It ignores what
else a block's time depends on (L2 hits, the programs' drift); it says how much of a launch a skewed routing's long
blocks can cost.
"""

from __future__ import annotations

import argparse
import heapq

import torch

from megamoe.arguments import HelpFormatter, positive_int
from megamoe.bench.common import PRESETS, ROUTINGS, make_routing
from megamoe.kernels import gluon_fp8_sm90, gluon_sm90

PROGRAMS = 132  # the H200's SMs: one program each


def expert_rows(routing: str, num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    """Each expert's rows under the layer benchmark's ``routing`` (seed 0)."""
    idx, _ = make_routing(routing, num_tokens, num_experts, top_k, "cpu", torch.Generator().manual_seed(0))
    return torch.bincount(idx.reshape(-1), minlength=num_experts).tolist()


def program_blocks(rows: list[int], blocks_per_expert: int, by_size: bool,
                   programs: int = PROGRAMS) -> list[list[int]]:
    """Each program's blocks in the order it runs them, as their experts' rows, for experts of ``rows`` rows with
    ``blocks_per_expert`` blocks each, dealt to a grid-stride loop of ``programs`` programs (fewer where there are fewer
    blocks) as ``gluon_sm90.wgrad_block`` deals them: in expert order or (``by_size``) the experts by their rows, most
    first (ties: the lower index first, as ``plan.experts_by_size``), each full round of blocks from alternate ends."""
    experts = sorted(range(len(rows)), key=lambda e: (-rows[e], e)) if by_size else range(len(rows))
    blocks = [rows[e] for e in experts for _ in range(blocks_per_expert)]
    n = min(programs, len(blocks))
    dealt: list[list[int]] = [[] for _ in range(n)]
    for w in range(len(blocks)):
        r, j = divmod(w, n)
        back = by_size and r % 2 == 1 and (r + 1) * n <= len(blocks)
        dealt[j].append(blocks[w + (n - 1 - 2 * j if back else 0)])
    return dealt


def makespan(rows: list[int], blocks_per_expert: int, bk: int, block_cost: float, by_size: bool,
             programs: int = PROGRAMS) -> float:
    """The most loaded program's K-steps (and ``block_cost`` per block) over the mean, for experts of ``rows`` rows,
    each with ``blocks_per_expert`` blocks of ceil(rows / ``bk``) K-steps, in expert order or (``by_size``) in size
    order dealt from alternate ends (``program_blocks``)."""
    load = [sum(-(-r // bk) + block_cost for r in blocks)
            for blocks in program_blocks(rows, blocks_per_expert, by_size, programs)]
    return max(load) / (sum(load) / len(load))


def makespan_dynamic(rows: list[int], blocks_per_expert: int, bk: int, block_cost: float,
                     programs: int = PROGRAMS) -> float:
    """As ``makespan``, the blocks in size order each taken by the program that is free first."""
    cost = [-(-r // bk) + block_cost for r in sorted(rows, reverse=True) for _ in range(blocks_per_expert)]
    n = min(programs, len(cost))
    free = [0.0] * n
    for c in cost:
        heapq.heapreplace(free, free[0] + c)
    return max(free) / (sum(cost) / n)


def gemms(dim: int, inter: int) -> dict[str, tuple[int, int]]:
    """Weight gradient -> (its blocks per expert, rows per K-step): the bf16 kernel's 128 x 256 blocks over BK rows
    (``gluon_sm90.WGRAD_TILE``) and the FP8 kernel's 128 x ``wgrad_block_n`` blocks over 128-row plan tiles."""
    bm, bn, bk, _ = gluon_sm90.WGRAD_TILE
    out = {}
    for name, p, q in (("dW13", 2 * inter, dim), ("dW2", dim, inter)):
        out[f"bf16 {name}"] = (-(-p // bm) * -(-q // bn), bk)
        fp8_blocks = p // gluon_fp8_sm90.FP8_BM * (q // gluon_fp8_sm90.wgrad_block_n(q))
        out[f"FP8 {name}"] = (fp8_blocks, gluon_fp8_sm90.FP8_BK)
    return out


def dealt_before_launch(gemm: str) -> bool:
    """Whether the layer deals the weight gradient ``gemm`` (a key of ``gemms``) its blocks before the launch: all but
    the bf16 kernel's blocks taken in turn (``gluon_sm90.WGRAD_TAKEN``), which no program knows until it runs."""
    precision, name = gemm.split()
    return not (precision == "bf16" and name.lower() in gluon_sm90.WGRAD_TAKEN)


def layer_blocks(gemm: str, expert_rows: list[int], dim: int, inter: int,
                 programs: int = PROGRAMS) -> tuple[list[list[int]], int]:
    """The weight gradient ``gemm`` (a key of ``gemms``: "bf16 dW13", "FP8 dW2", ...) with its blocks dealt as the
    layer deals them (``gluon_sm90.WGRAD_BY_SIZE``) to at most ``programs`` programs: each program's blocks' expert
    rows in order (``program_blocks``), and the rows of a K-step. A weight gradient whose blocks are not dealt before
    the launch (``dealt_before_launch``) is refused."""
    if not dealt_before_launch(gemm):
        raise ValueError(f"{gemm}: its blocks are taken in turn (gluon_sm90.WGRAD_TAKEN), no program's blocks are "
                         "known before the launch")
    blocks, bk = gemms(dim, inter)[gemm]
    return program_blocks(expert_rows, blocks, gluon_sm90.WGRAD_BY_SIZE, programs), bk


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.wgrad_schedule", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS), help="the layer's D, I, E and K")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per step (T)")
    p.add_argument("--routing", type=lambda s: s.split(","), default=["random", "skewed"],
                   help="comma-separated, from " + ", ".join(ROUTINGS))
    p.add_argument("--block-cost", type=float, default=1.0, help="a block's fixed cost, in K-steps")
    args = p.parse_args(argv)
    if unknown := set(args.routing) - set(ROUTINGS):
        raise SystemExit(f"--routing: unknown {sorted(unknown)}; choose from {', '.join(ROUTINGS)}")
    dim, inter, num_experts, top_k = PRESETS[args.preset]
    print(f"{args.preset}  T={args.tokens}  {PROGRAMS} programs  (the launch over the balanced time)")
    print(f"{'routing':8s} {'max/mean rows':>13s}  {'GEMM':9s} {'expert order':>12s} {'size order':>10s} "
          f"{'dynamic':>8s}")
    for routing in args.routing:
        rows = expert_rows(routing, args.tokens, num_experts, top_k)
        skew = max(rows) / (sum(rows) / len(rows))
        for name, (blocks, bk) in gemms(dim, inter).items():
            print(f"{routing:8s} {skew:13.2f}  {name:9s} "
                  f"{makespan(rows, blocks, bk, args.block_cost, False):12.3f} "
                  f"{makespan(rows, blocks, bk, args.block_cost, True):10.3f} "
                  f"{makespan_dynamic(rows, blocks, bk, args.block_cost):8.3f}")


if __name__ == "__main__":
    main()
