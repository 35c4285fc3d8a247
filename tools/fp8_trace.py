"""Where the FP8 GEMMs' blocks spend their time (an sm90 GPU):

    python -m tools.fp8_trace [--preset P] [--tokens T] [--routing R] [--gemms down,dh,dx,up,dw13,dw2] [--wide]
                              [--out DIR]

Runs each GEMM of the FP8 path's sorted-rows kernel (``gluon_fp8_sm90.fp8_rows_gemm_ws``: down, dh', dx) and, with
``up`` in ``--gemms``, its gate/up kernel (``fp8_up_swiglu_ws``, h quantised; its epilogue between the main loop's end
and the block's), with ``dw13`` or ``dw2`` its weight gradients (``fp8_wgrad_ws`` in blocks of ``wgrad_block_n``
columns, on random sorted rows quantised 128x1), on the layer benchmark's problem, untraced and then traced
(``trace=``: the cycle counter and the global timer at fixed points of every block in each partition,
``gluon_sm90.TRACE_BLOCKS``), checks that the traced output is bitwise the untraced one, and reports per MMA
warpgroup the medians per block (us) of the phases of ``tools.block_trace.PHASES`` and the main loops' share of its
time. The sorted-rows GEMMs run in blocks of 128 columns; ``--wide`` also in blocks of 256 (``block_n``, where N is
a multiple of 256). The stamps cost a few percent of the kernel's time: the phases say where the
time goes, not the exact time. The weight gradients' blocks also by their experts' rows
(``tools.block_trace.blocks_by_rows``, warpgroup 0's, the blocks dealt as the layer deals them), as
``tools.kernels_trace`` reads the bf16 ones. Prints a table and, with ``--out``, writes JSON (GPU, versions, date,
commit, command): ``fp8-block-trace-PRESET-tTOKENS.json``, the GEMMs named after it when they are not the default
three, then the routing where it is not random.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from megamoe.arguments import HelpFormatter, positive_int
from megamoe.bench.common import PRESETS, ROUTINGS, make_problem
from megamoe.kernels import expert_fwd, gluon_fp8_sm90, gluon_sm90, quant
from megamoe.kernels.plan import build_plan
from megamoe.provenance import write_record
from tools.block_trace import (
    BY_ROWS_LEGEND,
    COLUMNS,
    block_phases,
    blocks_by_rows,
    by_rows_table,
)
from tools.wgrad_schedule import layer_blocks

# The GEMMs traced unless --gemms names others (the sorted-rows kernel's three); a run of others names them in its file.
DEFAULT_GEMMS = ["down", "dh", "dx"]


def main(argv=None) -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(prog="python -m tools.fp8_trace", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS), help="the layer's D, I, E and K")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per step (T)")
    p.add_argument("--routing", choices=ROUTINGS, default="random", help="how the tokens pick their experts")
    p.add_argument("--gemms", type=lambda s: s.split(","), default=DEFAULT_GEMMS,
                   help="comma-separated, from down, dh (dh'), dx, up, dw13, dw2")
    p.add_argument("--wide", action="store_true", help="also blocks of 256 columns (fp8_rows_gemm_ws's block_n)")
    p.add_argument("--out", type=Path, help="folder for the JSON record")
    args = p.parse_args(argv)
    if unknown := set(args.gemms) - {"down", "dh", "dx", "up", "dw13", "dw2"}:
        raise SystemExit(f"--gemms: unknown {sorted(unknown)}; choose from down, dh, dx, up, dw13, dw2")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("tools.fp8_trace traces the sm90 Gluon FP8 kernel: it needs a Hopper GPU")
    dim, inter, num_experts, top_k = PRESETS[args.preset]
    x, idx, weights, w13, w2, _ = make_problem(args.tokens, dim, inter, num_experts, top_k, args.routing,
                                               torch.bfloat16, torch.device("cuda"), 0)
    plan = build_plan(idx, num_experts)
    expert_rows = plan.offsets_E1.diff().tolist()
    rows = idx.numel()
    xq, xs = quant.quantize_rows(x)
    w13q, w13s, w13tq, w13ts = quant.quantize_weight(w13)
    _, _, w2tq, w2ts = w2_fp8 = quant.quantize_weight(w2)
    hq, hs = expert_fwd.up_swiglu_fp8(xq, xs, w13q, w13s, plan, top_k)
    dyq, dys = quant.quantize_rows(torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16))
    dzq, dzs = quant.quantize_rows(torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16))
    gemms = {  # a, its scales, w, its scales, routing weights, to slots, flops
        "down": (hq, hs, w2_fp8[0], w2_fp8[1], weights.reshape(-1).float(), True, 2 * rows * dim * inter),
        "dh": (dyq, dys, w2tq, w2ts, None, False, 2 * rows * dim * inter),
        "dx": (dzq, dzs, w13tq, w13ts, None, True, 4 * rows * dim * inter),
    }
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.empty(gluon_sm90.trace_size(programs), device="cuda", dtype=torch.int64)
    # the sorted-rows kernel's block columns: 128 first (issue-ahead: the "issue-ahead" column)
    widths = [128, 256] if args.wide else [128]
    # (GEMM, block columns, issue-ahead, stores deferred, its launch (traced or not) -> its outputs, FLOPs, and for a
    # weight gradient its blocks as dealt and the rows of a K-step: ``layer_blocks``)
    variants = []
    for name in args.gemms:
        if name in ("dw13", "dw2"):  # dW13 = dzᵀ x, dW2 = dyᵀ (h·w), the sorted rows' tile columns
            p_dim, q_dim = (2 * inter, dim) if name == "dw13" else (dim, inter)
            a_t, b_t = (quant.quantize_tile_cols(torch.randn(rows, c, device="cuda", dtype=torch.bfloat16), plan)
                        for c in (p_dim, q_dim))
            block_n = gluon_fp8_sm90.wgrad_block_n(q_dim)

            def run(traced, a_t=a_t, b_t=b_t, p_dim=p_dim, q_dim=q_dim, block_n=block_n):
                out = torch.empty(num_experts, p_dim, q_dim, device="cuda", dtype=torch.bfloat16)
                gluon_fp8_sm90.fp8_wgrad_ws(*a_t, *b_t, out, plan.offsets_E1, block_n,
                                            trace=trace if traced else None)
                return (out, )
            dealt = layer_blocks("FP8 dW13" if name == "dw13" else "FP8 dW2", expert_rows, dim, inter, programs)
            variants.append((name, block_n, block_n == 128, False, run, 2 * rows * p_dim * q_dim, dealt))
            continue
        if name == "up":
            def run(traced):
                h_q = torch.zeros(rows, inter, device="cuda", dtype=torch.float8_e4m3fn)
                h_s = torch.zeros(inter // 128, rows, device="cuda", dtype=torch.float32)
                gluon_fp8_sm90.fp8_up_swiglu_ws(xq, xs, w13q, w13s, h_q, h_s, plan, top_k,
                                                trace=trace if traced else None)
                return h_q.view(torch.uint8), h_s
            variants.append((name, 128, False, False, run, 4 * rows * dim * inter, None))
            continue
        a, a_s, w, w_s, wts, to_slots, flops = gemms[name]
        for block_n in widths:
            if w.shape[1] % block_n:
                continue

            def run(traced, a=a, a_s=a_s, w=w, w_s=w_s, wts=wts, to_slots=to_slots, block_n=block_n):
                out = torch.empty(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
                gluon_fp8_sm90.fp8_rows_gemm_ws(a, a_s, w, w_s, out, plan, weights=wts, to_slots=to_slots,
                                                block_n=block_n, trace=trace if traced else None)
                return (out, )
            variants.append((name, block_n, block_n == 128, True, run, flops, None))
    results, by_rows = [], {}
    print(f"{torch.cuda.get_device_name()}  {args.preset}  T={args.tokens}  {args.routing}  (medians per block, us)")
    print(f"{'GEMM':5s} {'cols':>4s} {'issue-ahead':>11s} {'deferred':>8s} {'us':>7s} {'traced':>7s} "
          f"{'TF/s':>5s}  wg " + " ".join(f"{k:>7s}" for k in COLUMNS))
    for name, block_n, issue_ahead, defer, run, flops, dealt in variants:
        plain_ms = do_bench(lambda run=run: run(False), warmup=25, rep=300)
        traced_ms = do_bench(lambda run=run: run(True), warmup=25, rep=300)
        trace.fill_(-1)
        if not all(map(torch.equal, run(True), run(False))):
            raise SystemExit(f"{name}: the traced kernel's output differs from the untraced one's")
        phases = block_phases(trace.cpu(), programs)
        results.append({"gemm": name, "block_n": block_n, "issue_ahead": issue_ahead, "defer_epilogue": defer,
                        "ms": plain_ms, "traced_ms": traced_ms, "tflops": flops / plain_ms / 1e9,
                        "phases": phases})
        if dealt is not None:
            blocks, bk = dealt
            by_rows[name] = results[-1]["by_rows"] = blocks_by_rows(trace.cpu(), len(blocks), 0, blocks, bk)
        for wg, ph in phases.items():
            print(f"{name:5s} {block_n:4d} {issue_ahead!s:>11s} {defer!s:>8s} {plain_ms * 1e3:7.1f} "
                  f"{traced_ms * 1e3:7.1f} {flops / plain_ms / 1e9:5.0f}  {wg[-1]}  "
                  + " ".join(f"{ph[k]:7.2f}" for k in COLUMNS))
    for name, found in by_rows.items():
        print(by_rows_table(f"FP8 {name}", found), flush=True)
    if args.out:
        named = "" if args.gemms == DEFAULT_GEMMS else "-" + "-".join(args.gemms)  # a run of other GEMMs
        named += "" if args.routing == "random" else f"-{args.routing}"
        write_record(args.out, f"fp8-block-trace-{args.preset}-t{args.tokens}{named}.json",
                     "python -m tools.fp8_trace " + " ".join(shlex.quote(a) for a in sys.argv[1:]), preset=args.preset,
                     tokens=args.tokens, routing=args.routing, phases=COLUMNS, **BY_ROWS_LEGEND,
                     results=results)


if __name__ == "__main__":
    main()
