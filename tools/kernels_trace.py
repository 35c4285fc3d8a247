"""Where the bf16 Gluon GEMMs' blocks spend their time (an sm90 GPU):

    python -m tools.kernels_trace [--preset P] [--tokens T] [--routing R]
                                  [--kernels up,up_saved,dh,act,dw13,dw13_alone,dw2]
                                  [--out DIR]

Runs each warp-specialized bf16 kernel of the layer (``kernels.gluon_sm90``: the up kernel, with the gate/up products
stored too, dh' with x's copy beside, the act kernel, dW13 with the dx combine beside and alone — as the low-peak
backward, the default, runs it — and dW2) on the layer benchmark's problem as the layer launches it, untraced and then
traced (``trace=``: the cycle counter and the global timer at fixed points of every block in each partition,
``gluon_sm90.TRACE_BLOCKS``), checks that the traced outputs are bitwise the untraced ones, and reports per partition
the medians per block (us) of the phases of ``tools.block_trace.PHASES`` and the main loops' share of its time: "mma"
(both MMA warpgroups, one partition) and, for the act kernel, "epilogue" (its SwiGLU-backward partition: "wait" is its
wait for the block's products, "main" its work on them). "main TF/s" is the kernel's rate over its MMA partition's
share: the rate of its main loops.
The stamps cost a few percent of the kernel's time: the phases say where the time goes, not the exact time.
For the weight gradients also their blocks by their experts' rows (``tools.block_trace.blocks_by_rows``, the blocks
dealt as the layer deals them, ``tools.wgrad_schedule.layer_blocks``): per class of expert size the blocks' phases,
their main loop per K-step and their part of the programs' time, and the launch's tail (its last program's end after
the median program's): under a skewed routing, whether the big experts' K-steps run slower, the small experts'
blocks cost more than their K-steps, or the programs end apart. Not with the bf16 blocks taken in turn
(``MEGAMOE_WGRAD_TAKEN``: dW13 by default), whose programs' blocks are known only at run time: their phases only.
Prints a table and, with ``--out``, writes JSON (GPU, versions, date, commit, command):
``kernels-block-trace-PRESET-tTOKENS[-ROUTING].json`` (the routing named where it is not random).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from megamoe.arguments import HelpFormatter, positive_int
from megamoe.bench.common import PRESETS, ROUTINGS, make_problem
from megamoe.kernels import expert_bwd, expert_fwd, gluon_sm90
from megamoe.kernels.plan import BLOCK_M, build_plan
from megamoe.provenance import write_record
from tools.block_trace import (
    BY_ROWS_LEGEND,
    COLUMNS,
    block_phases,
    blocks_by_rows,
    by_rows_table,
)
from tools.wgrad_schedule import dealt_before_launch, layer_blocks

KERNELS = ["up", "up_saved", "dh", "act", "dw13", "dw13_alone", "dw2"]
# The weight-gradient kernels among them, by their name in ``tools.wgrad_schedule.gemms`` (not ``env.WGRAD_GEMMS``,
# the names ``MEGAMOE_WGRAD_TAKEN`` takes).
WGRAD_KERNELS = {"dw13": "bf16 dW13", "dw13_alone": "bf16 dW13", "dw2": "bf16 dW2"}


def launches(problem, num_experts: int) -> dict:
    """Kernel name -> (its launch: (outputs, trace or None) -> None, a maker of fresh outputs, FLOPs, its partitions
    in the trace), each launched as the layer launches it, on the inputs the layer gives it."""
    x, topk_idx, topk_weights, w13, w2, dy = problem
    top_k = topk_idx.shape[1]
    rows, inter = topk_idx.numel(), w2.shape[2]
    unit = rows * x.shape[1] * inter
    plan = build_plan(topk_idx, num_experts)
    h = expert_fwd.up_swiglu_fwd(x, w13, plan, top_k)
    slots = expert_fwd.down_fwd(h, w2, topk_weights, plan)
    x_sorted, dy_sorted, dh = expert_bwd.sorted_rows_and_dh(x, dy, w2, plan, top_k)
    dz, hw, _ = expert_bwd.act_bwd(x_sorted, dh, w13, topk_weights, plan, top_k)
    slot_row = torch.empty_like(plan.row_slot_N)  # each slot's sorted row (every slot routed here)
    slot_row[plan.row_slot_N.long()] = torch.arange(rows, device=x.device, dtype=slot_row.dtype)
    weights = topk_weights.reshape(-1)

    def empty(*shapes, dtype=x.dtype):
        return lambda: tuple(torch.empty(s, device=x.device, dtype=dtype) for s in shapes)

    mma = {"mma": 0}
    return {
        "up": (lambda o, tr: gluon_sm90.up_swiglu_ws(x, w13, o[0], plan, top_k, BLOCK_M, trace=tr),
               empty((rows, inter)), 4 * unit, mma),
        "up_saved": (lambda o, tr: gluon_sm90.up_swiglu_ws(x, w13, o[0], plan, top_k, BLOCK_M, o[1], trace=tr),
                     empty((rows, inter), (rows, 2 * inter)), 4 * unit, mma),
        "dh": (lambda o, tr: gluon_sm90.dh_ws(dy_sorted, w2, o[0], plan, BLOCK_M,
                                              copy_x=(x, o[1], slot_row, top_k), trace=tr),
               empty((rows, inter), tuple(x_sorted.shape)), 2 * unit, mma),
        "act": (lambda o, tr: gluon_sm90.act_bwd_ws(x_sorted, dh, w13, weights, plan, o[0], o[1], o[2], BLOCK_M,
                                                    expert_bwd.PART_COLS, trace=tr),
                lambda: (*empty((rows, 2 * inter), (rows, inter))(),
                         torch.empty(-(-inter // expert_bwd.PART_COLS), rows, device=x.device, dtype=torch.float32)),
                4 * unit, {**mma, "epilogue": 1}),
        "dw13": (lambda o, tr: gluon_sm90.expert_wgrad_ws(dz, x_sorted, plan.offsets_E1, o[0],
                                                          combine=(slots, topk_idx, o[1]), gemm="dw13",
                                                          trace=tr),
                 empty(tuple(w13.shape), tuple(x.shape)), 4 * unit, mma),
        "dw13_alone": (lambda o, tr: gluon_sm90.expert_wgrad_ws(dz, x_sorted, plan.offsets_E1, o[0], gemm="dw13",
                                                                trace=tr),
                       empty(tuple(w13.shape)), 4 * unit, mma),
        "dw2": (lambda o, tr: gluon_sm90.expert_wgrad_ws(dy_sorted, hw, plan.offsets_E1, o[0], gemm="dw2", trace=tr),
                empty(tuple(w2.shape)), 2 * unit, mma),
    }


def main(argv=None) -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(prog="python -m tools.kernels_trace", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS), help="the layer's D, I, E and K")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per step (T)")
    p.add_argument("--routing", choices=ROUTINGS, default="random", help="how the tokens pick their experts")
    p.add_argument("--kernels", type=lambda s: s.split(","), default=KERNELS,
                   help="comma-separated, from " + ", ".join(KERNELS))
    p.add_argument("--out", type=Path, help="folder for the JSON record")
    args = p.parse_args(argv)
    if unknown := set(args.kernels) - set(KERNELS):
        raise SystemExit(f"--kernels: unknown {sorted(unknown)}; choose from {', '.join(KERNELS)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("tools.kernels_trace traces the sm90 Gluon bf16 kernels: it needs a Hopper GPU")
    dim, inter, num_experts, top_k = PRESETS[args.preset]
    problem = make_problem(args.tokens, dim, inter, num_experts, top_k, args.routing, torch.bfloat16,
                           torch.device("cuda"), 0)
    if bool((problem[1] < 0).any()):
        raise SystemExit("tools.kernels_trace expects every slot routed (the layer benchmark's routings are)")
    runs = launches(problem, num_experts)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.empty(gluon_sm90.trace_size(programs), device="cuda", dtype=torch.int64)
    print(f"{torch.cuda.get_device_name()}  {args.preset}  T={args.tokens}  {args.routing}  (medians per block, us)")
    print(f"{'kernel':8s} {'ms':>6s} {'traced':>6s} {'TF/s':>5s} {'main':>5s}  {'partition':9s} "
          + " ".join(f"{k:>7s}" for k in COLUMNS))
    expert_rows = build_plan(problem[1], num_experts).offsets_E1.diff().tolist()
    results, by_rows = [], {}
    for name in args.kernels:
        launch, fresh, flops, parts = runs[name]
        outs = fresh()
        ms, traced_ms = (do_bench(lambda tr=tr, launch=launch, outs=outs: launch(outs, tr), warmup=25, rep=300)
                         for tr in (None, trace))
        plain, traced = fresh(), fresh()
        launch(plain, None)
        trace.fill_(-1)
        launch(traced, trace)
        if not all(map(torch.equal, plain, traced)):
            raise SystemExit(f"{name}: the traced kernel's outputs differ from the untraced one's")
        phases = block_phases(trace.cpu(), programs, parts)
        tflops = flops / ms / 1e9
        main_tflops = tflops / phases["mma"]["share"]
        results.append({"kernel": name, "ms": ms, "traced_ms": traced_ms, "tflops": tflops,
                        "main_loop_tflops": main_tflops, "phases": phases})
        if name in WGRAD_KERNELS and dealt_before_launch(WGRAD_KERNELS[name]):  # else no deal to read them by
            dealt, bk = layer_blocks(WGRAD_KERNELS[name], expert_rows, dim, inter, programs)
            by_rows[name] = results[-1]["by_rows"] = blocks_by_rows(trace.cpu(), len(dealt), 0, dealt, bk)
        for part, ph in phases.items():
            print(f"{name:8s} {ms:6.3f} {traced_ms:6.3f} {tflops:5.0f} {main_tflops:5.0f}  {part:9s} "
                  + " ".join(f"{ph[k]:7.2f}" for k in COLUMNS), flush=True)
    for name, found in by_rows.items():
        print(by_rows_table(name, found), flush=True)
    if args.out:
        named = "" if args.routing == "random" else f"-{args.routing}"
        write_record(args.out, f"kernels-block-trace-{args.preset}-t{args.tokens}{named}.json",
                     "python -m tools.kernels_trace " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                     preset=args.preset, tokens=args.tokens, routing=args.routing, phases=COLUMNS,
                     main_loop_tflops="the kernel's TFLOP/s over its MMA partition's share: its main loops' rate",
                     **BY_ROWS_LEGEND, kernels=results)


if __name__ == "__main__":
    main()
