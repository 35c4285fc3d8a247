"""Reading the Gluon GEMM kernels' block trace (``gluon_sm90.TRACE_BLOCKS``, their launchers' ``trace=``): where each
partition's blocks spend their time. Used by ``tools.fp8_trace`` (the FP8 kernels, one partition per MMA warpgroup)
and ``tools.kernels_trace`` (the bf16 kernels, one MMA partition of both warpgroups)."""

from __future__ import annotations

import statistics

import torch

from megamoe.kernels import gluon_sm90

# What one block of an MMA partition is made of, from its stamps: points 0-3 are the block's start, its first stage
# ready, its main loop done, its end; the loader's (partition 2) 0-2 its start, its first K-step's copies issued, all of
# them issued.
PHASES = {
    "wait": "start -> first stage ready: the wait for the block's first operands",
    "main": "first stage ready -> main loop done (MMAs, and the FP8 kernels' promotions)",
    "rest": "main loop done -> next block's start (epilogue, loop overhead)",
    "block": "start -> next block's start",
    "lead": "the loader's first copy of the block issued -> the partition's block start",
    "latency": "the loader's first copy of the block issued -> the partition's first stage ready",
    "drift": "partition 1's block start - partition 0's (the same block)",
}
# What ``block_phases`` reports: PHASES' medians (us) and the main loops' share of the time (a fraction).
COLUMNS = {**PHASES, "share": "the sum over blocks of main / of block: the part of the partition's time in main loops"}
# The FP8 kernels' MMA partitions: one per warpgroup.
WARPGROUPS = {"wg0": 0, "wg1": 1}
LOADER = 2


def stamps(trace: torch.Tensor, programs: int) -> list:
    """A traced launch's stamps (int64, -1 where none was taken) of ``programs`` programs as nested lists:
    [program][partition][block][cycles, global ns][point]."""
    return trace[: gluon_sm90.trace_size(programs)].view(programs, gluon_sm90.TRACE_PARTS.value,
                                                         gluon_sm90.TRACE_BLOCKS.value, 2,
                                                         gluon_sm90.TRACE_POINTS.value).tolist()


def cycles_per_us(blocks: list) -> float:
    """A partition's cycle counter's rate over a launch: its programs' cycle spans (first block's start to last
    block's end) over their global-timer spans, summed; ``blocks`` per program its stamped blocks (``stamps``' [block]
    lists whose start was stamped)."""
    spans = [(b[-1][0][3] - b[0][0][0], b[-1][1][3] - b[0][1][0]) for b in blocks if b]
    ns = sum(n for _, n in spans)
    return sum(c for c, _ in spans) / ns * 1e3 if ns > 0 else float("nan")


def block_phases(trace: torch.Tensor, programs: int,
                 parts: dict[str, int] | None = None) -> dict[str, dict[str, float]]:
    """Per partition named in ``parts`` (name -> its index in the trace; None: the FP8 kernels' ``WARPGROUPS``), the
    medians (us) of :data:`PHASES` over its blocks and the main loops' "share" of its time (:data:`COLUMNS`); "drift"
    where partition 0 is named too. Cycles become time at each partition's rate over the launch (its programs' cycle
    spans over their global-timer spans, summed): the SM clock moves with power, and a program may hold one short
    block, too short for the global timer alone."""
    parts = WARPGROUPS if parts is None else parts
    progs = stamps(trace, programs)
    taken = {part: [[b for b in prog[part] if b[0][0] >= 0] for prog in progs] for part in {0, *parts.values()}}
    samples: dict[str, dict[str, list[float]]] = {name: {k: [] for k in PHASES} for name in parts}
    sums = {name: [0.0, 0.0] for name in parts}  # main, block: over the busy blocks that have a next one
    for name, part in parts.items():
        per_us = cycles_per_us(taken[part])
        out = samples[name]
        for prog, blocks, first in zip(progs, taken[part], taken[0]):
            loader = prog[LOADER]
            for i, (cyc, _) in enumerate(blocks):
                busy = cyc[1] >= 0 and cyc[2] >= 0  # an FP8 warpgroup whose rows all lie past the expert stamps 0, 3
                nxt = blocks[i + 1][0][0] if i + 1 < len(blocks) else None
                if busy:
                    out["wait"].append((cyc[1] - cyc[0]) / per_us)
                    out["main"].append((cyc[2] - cyc[1]) / per_us)
                    if loader[i][0][1] >= 0:
                        out["latency"].append((cyc[1] - loader[i][0][1]) / per_us)
                    if nxt is not None:
                        out["rest"].append((nxt - cyc[2]) / per_us)
                        sums[name][0] += (cyc[2] - cyc[1]) / per_us
                        sums[name][1] += (nxt - cyc[0]) / per_us
                if nxt is not None:
                    out["block"].append((nxt - cyc[0]) / per_us)
                if loader[i][0][1] >= 0:
                    out["lead"].append((cyc[0] - loader[i][0][1]) / per_us)
            if part != 0 and 0 in parts.values():
                n = min(len(first), len(blocks))
                out["drift"].extend((blocks[i][0][0] - first[i][0][0]) / per_us for i in range(n))
    return {name: {**{k: statistics.median(v) if v else float("nan") for k, v in phases.items()},
                   "share": sums[name][0] / sums[name][1] if sums[name][1] > 0 else float("nan")}
            for name, phases in samples.items()}


# The weight gradients' blocks by their expert's rows (``blocks_by_rows``), against the launch's mean rows per expert.
ROW_CLASSES = {
    "tiny": "at most 2 K-steps",
    "small": "more, but under half the mean rows",
    "mean": "half to twice the mean rows",
    "big": "over twice the mean rows",
}
BY_ROWS = {
    "blocks": "the class's blocks",
    "rows": "their experts' median rows",
    "wait": "median us, start -> first stage ready",
    "main": "median us, first stage ready -> main loop done",
    "per step": "median us of the main loop per K-step",
    "rest": "median us, main loop done -> next block's start (the last block: its end): epilogue, store",
    "share": "the class's part of the programs' time (its blocks' start -> next start or end)",
}
# What a trace tool's record says of its ``blocks_by_rows`` figures.
BY_ROWS_LEGEND = {"row_classes": ROW_CLASSES, "by_rows": BY_ROWS}


def row_class(rows: int, mean: float, bk: int) -> str:
    """A weight-gradient block's class in ``ROW_CLASSES``: its expert's ``rows`` against ``mean`` rows, ``bk`` a
    K-step."""
    if -(-rows // bk) <= 2:
        return "tiny"
    if rows < mean / 2:
        return "small"
    return "mean" if rows <= 2 * mean else "big"


def blocks_by_rows(trace: torch.Tensor, programs: int, part: int, block_rows: list[list[int]],
                   bk: int) -> dict:
    """A weight-gradient launch's blocks of partition ``part`` by their experts' rows: ``block_rows`` holds, per
    program, its blocks' expert rows in the order it ran them (``tools.wgrad_schedule.program_blocks``), ``bk`` rows
    a K-step. Per class of ``ROW_CLASSES`` (against the mean over blocks: every expert has as many blocks) the figures
    of ``BY_ROWS``; by the global timer, which the SMs share, "span": the first block's start to the last block's end
    over all programs (us: against the kernel's time, what the partition's blocks leave to the rest of the launch) and
    "tail": the last program's end after the median program's (us); "traced": whether every block was stamped (a
    program holds ``TRACE_BLOCKS`` at most)."""
    progs = stamps(trace, programs)
    blocks = [prog[part][:len(rows)] for prog, rows in zip(progs, block_rows)]
    per_us = cycles_per_us([[b for b in prog if b[0][0] >= 0] for prog in blocks])
    mean = sum(map(sum, block_rows)) / max(1, sum(map(len, block_rows)))
    samples = {c: {k: [] for k in ("rows", "wait", "main", "per step", "rest")} for c in ROW_CLASSES}
    time = dict.fromkeys(ROW_CLASSES, 0.0)
    starts, ends = [], []
    for prog, rows in zip(blocks, block_rows):
        for i, ((cyc, _), r) in enumerate(zip(prog, rows)):
            if cyc[0] < 0 or cyc[3] < 0:
                continue
            c = samples[row_class(r, mean, bk)]
            nxt = prog[i + 1][0][0] if i + 1 < len(prog) and prog[i + 1][0][0] >= 0 else cyc[3]
            c["rows"].append(r)
            if cyc[1] >= 0:  # (an expert without rows runs no K-step: its block has no first stage)
                c["wait"].append((cyc[1] - cyc[0]) / per_us)
                c["main"].append((cyc[2] - cyc[1]) / per_us)
                c["per step"].append((cyc[2] - cyc[1]) / per_us / -(-r // bk))
            c["rest"].append((nxt - cyc[2]) / per_us)
            time[row_class(r, mean, bk)] += (nxt - cyc[0]) / per_us
        done = [b[1][3] for b in prog if b[1][3] >= 0]
        if done:
            ends.append(max(done))
            starts.append(min(b[1][0] for b in prog if b[1][0] >= 0))
    total = sum(time.values())
    classes = {c: {"blocks": len(v["rows"]),
                   **{k: statistics.median(x) if x else float("nan") for k, x in v.items()},
                   "share": time[c] / total if total > 0 else float("nan")}
               for c, v in samples.items()}
    tail = (max(ends) - statistics.median(ends)) / 1e3 if ends else float("nan")
    span = (max(ends) - min(starts)) / 1e3 if ends else float("nan")
    traced = all(len(rows) <= gluon_sm90.TRACE_BLOCKS.value for rows in block_rows)
    return {"classes": classes, "mean_rows": mean, "span_us": span, "tail_us": tail, "traced": traced}


def by_rows_table(name: str, found: dict) -> str:
    """``blocks_by_rows``' figures for the weight gradient ``name`` as the trace tools print them."""
    lines = [f"{name}: blocks by their experts' rows (mean {found['mean_rows']:.0f}; {', '.join(ROW_CLASSES)}: "
             f"{'; '.join(ROW_CLASSES.values())}), blocks' span {found['span_us']:.1f} us, "
             f"tail {found['tail_us']:.1f} us"
             + ("" if found["traced"] else " (programs past the trace's blocks: the first ones only)"),
             f"  {'class':6s} " + " ".join(f"{k:>8s}" for k in BY_ROWS)]
    for cls, ph in found["classes"].items():
        lines.append(f"  {cls:6s} " + " ".join(f"{ph[k]:8.0f}" if k in ("blocks", "rows") else f"{ph[k]:8.2f}"
                                               for k in BY_ROWS))
    return "\n".join(lines)
