"""The FP8 path's kernels one by one against the same process's dense FP8 matmul: each FP8 GEMM's time and TFLOP/s,
and each quantiser's GB/s.

``python -m tools.fp8 [--preset qwen3-30b-a3b] [--tokens 16384] [--routing random] [--rounds N] [--out DIR]`` on an sm90
GPU.
Stages (bf16 inputs, the layer benchmark's problem): the row quantisation of x (T, D) and of the sorted dy rows (N,
D), and the backward's sort of the x and dy rows with and without dy's quantisation fused in (the FP8 path's); the
weights' quantisation (both orientations of w13 and w2, and each alone, as a call makes them under
the "call" cache policy, ``quant.set_fp8_weight_cache``); the gate/up GEMM (+ SwiGLU + h's quantisation), with and
without the products' store, and the products alone (the backward's recompute); down, dh' and dx
(``expert_fwd.sorted_rows_gemm_fp8``) in blocks of 128 columns and, where N allows, of 256 (``ROWS_BLOCK_N``: the
"(256 columns)" stages, as the layer runs them).
Then the weight gradients both ways, to choose ``autograd.FP8_WGRAD``: the 128x1 tile-column quantisation of (N, D),
(N, 2I) and (N, I) sorted rows (``quant.quantize_tile_cols``; (N, D) also read from the tokens' rows, as x and dy can
be), the FP8 dW13 and dW2 GEMMs on them (``expert_bwd.wgrad_fp8``; in blocks of 128 columns, and of 256 where Q
allows: ``gluon_fp8_sm90.WGRAD_BLOCK_N``; the layer's width also with its blocks in the other order than
``gluon_sm90.WGRAD_BY_SIZE``), the bf16 ones the FP8 path runs without them
(``expert_bwd.expert_wgrad``; dW13 without the dx combine it carries in the layer), and the part of the FP8 backward
that ``FP8_WGRAD`` changes both ways: with it, dh' from dy's rows quantised per token (``expert_bwd.dh_fp8_from_rows``,
as the layer runs it), x and dy quantised into tile columns from the tokens' rows, the act step writing dz's and h·w's
tile columns (``expert_bwd.act_bwd_tile_cols``), the two FP8 GEMMs and dx's combine; without, the sort of x and dy
with dy quantised beside and dh' on the sorted rows, the act step writing dz and h·w in bf16, and the two bf16 GEMMs,
dW13's with the combine inside; and dW13 with x's scales one per channel over the layer (``autograd.FP8_WGRAD_X_SCALES
= "layer"``: x's channel amax, its tile columns with it, the GEMM told that B's scales are its expert's in every tile;
not the recipe's sums, so checked against nothing here), and the FP8 part again with it, and with x's scales per
expert (``"expert"``: x's channel amax per expert, its tile columns with it). dh' is also timed both ways on
its own, and the tile-column quantiser's Triton kernel ("(Triton)") beside the layer's (on sm90 the Gluon one,
``quant.TILE_COLS_GLUON``), checked bitwise against it. The
act step into tile columns is also timed on its own, beside the act step followed by the tile-column quantiser on its
dz and h·w. The ceiling beside them: ``torch._scaled_mm`` with one scale per tensor (e4m3) on an (N, K) x (K, n)
product of each GEMM's size, and the device copy rate. Medians of ``triton.testing.do_bench`` (``--rounds N``: the
median of N, each stage timed once a round, the stages in turn: run to run, the 235B weight gradients' times move by
more than many variants differ, docs/PERFORMANCE.md); bytes counted as each
kernel reads and writes them once. ``--stages down,dx``: only the stages whose names contain one of these (each first
call compiles its kernel: the whole table takes minutes on a fresh machine). Each variant that changes only when a
kernel's instructions run (its blocks' width and order; the up kernel's products stored beside h) is checked to write
bitwise what the layer's own variant of that GEMM writes, where both write (column "same"; a variant that differs is
named at the end and the command exits with 1 after writing its record). Prints a table and writes JSON (GPU,
versions, date, commit, command) if ``--out`` is given, the routing named in its name where it is not random.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import torch

from megamoe.arguments import HelpFormatter, positive_int
from megamoe.bench.common import PRESETS, ROUTINGS, make_problem
from megamoe.kernels import expert_bwd, expert_fwd, gluon_fp8_sm90, gluon_sm90, quant
from megamoe.kernels.combine import combine
from megamoe.kernels.plan import build_plan
from megamoe.provenance import write_record
from tools.kernels import ORDERS, same_outputs


def scaled_mm_tflops(m: int, n: int, k: int) -> float:
    """Dense e4m3 (m, k) x (k, n) through ``torch._scaled_mm`` with per-tensor scales, bf16 out."""
    from triton.testing import do_bench

    a = torch.randn(m, k, device="cuda").to(quant.FP8)
    b = torch.randn(n, k, device="cuda").to(quant.FP8).t()
    one = torch.ones((), device="cuda")
    ms = do_bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), warmup=25, rep=200)
    return 2 * m * n * k / ms / 1e9


def select_stages(stages: list[tuple], patterns: list[str] | None) -> list[tuple]:
    """The stages (name first) whose names contain any of ``patterns`` (case-insensitive), in their order; all of them
    without patterns. A pattern that names no stage is an error, not an empty table."""
    if not patterns:
        return stages

    def named(stage, pattern):
        return pattern.lower() in stage[0].lower()

    unmatched = [p for p in patterns if not any(named(stage, p) for stage in stages)]
    if unmatched:
        raise SystemExit(f"--stages: no stage's name contains {unmatched}; the stages: {[s[0] for s in stages]}")
    return [stage for stage in stages if any(named(stage, p) for p in patterns)]


def main(argv=None, device: str = "cuda") -> None:
    """The command line's entry; ``device``: "cpu" runs the table's stages through the Triton interpreter (for its
    tests: without a GPU's kernels every variant runs the same code, and the times and rates mean nothing)."""
    from triton.testing import do_bench

    p = argparse.ArgumentParser(prog="python -m tools.fp8", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS), help="the layer's D, I, E and K")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per step (T)")
    p.add_argument("--out", type=Path, help="folder for the JSON record")
    p.add_argument("--stages", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                   help="comma-separated parts of stage names: time only those stages")
    p.add_argument("--routing", choices=ROUTINGS, default="random", help="how the tokens pick their experts")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="time every stage once in each of N rounds, the stages taking turns, and report each one's "
                        "median (all N kept in the JSON, their spread printed), so that the GPU's clock drifting over "
                        "the run meets every stage alike")
    args = p.parse_args(argv)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tools.fp8 times GPU kernels: it needs a CUDA GPU")
    dim, inter, num_experts, top_k = PRESETS[args.preset]
    x, idx, weights, w13, w2, dy = make_problem(args.tokens, dim, inter, num_experts, top_k, args.routing,
                                                torch.bfloat16, torch.device(device), 0)
    plan = build_plan(idx, num_experts)
    num_slots = idx.numel()
    rows = int((idx >= 0).sum())
    xq, xs = quant.quantize_rows(x)
    w13q, w13s, w13tq, w13ts = quant.quantize_weight(w13)
    w2q, w2s, w2tq, w2ts = quant.quantize_weight(w2)
    _, dy_sorted = expert_bwd.gather_rows(x, dy, plan, top_k)
    dyq, dys = quant.quantize_rows(dy_sorted)
    hq, hs = expert_fwd.up_swiglu_fp8(xq, xs, w13q, w13s, plan, top_k)
    preact = torch.empty(num_slots, 2 * inter, device=device, dtype=torch.bfloat16)
    dzq, dzs = quant.quantize_rows(torch.randn(num_slots, 2 * inter, device=device, dtype=torch.bfloat16))
    flat_weights = weights.reshape(-1)
    # The weight gradients' operands: sorted rows in bf16 (dz and h·w random: only their shapes matter here).
    x_sorted = expert_bwd.gather_rows(x, dy, plan, top_k)[0]
    dz = torch.randn(num_slots, 2 * inter, device=device, dtype=torch.bfloat16)
    hw = torch.randn(num_slots, inter, device=device, dtype=torch.bfloat16)
    dzt, xt, dyt, hwt = (quant.quantize_tile_cols(t, plan) for t in (dz, x_sorted, dy_sorted, hw))
    x_amax = quant.channel_amax(x)  # x's scales per channel over the layer (autograd.FP8_WGRAD_X_SCALES = "layer")
    xt_layer = quant.quantize_tile_cols(x, plan, top_k, col_amax=x_amax)
    x_expert_amax = quant.expert_channel_amax(x, plan, top_k)  # ... and per expert ("expert")
    num_tiles = plan.tile_expert_NT.numel()

    def tile_cols_bytes(cols):  # bf16 rows read; e4m3 tile columns and fp32 scales written
        return num_slots * cols * 2 + cols * num_tiles * 128 + num_tiles * cols * 4

    # the products and dh' read; dz 1x128, dz's and h·w's tile columns and their scales written
    act_tile_cols_bytes = num_slots * inter * (4 + 2 + 2) + dzs.numel() * 4 + 3 * inter * num_tiles * (128 + 4)
    dx_slots = torch.randn(num_slots, dim, device=device, dtype=torch.bfloat16)
    products = torch.randn(num_slots, 2 * inter, device=device, dtype=torch.bfloat16)  # the act step's inputs
    dh = torch.randn(num_slots, inter, device=device, dtype=torch.bfloat16)

    def fp8_wgrads(x_scales="tile"):  # what the FP8 backward runs with autograd.FP8_WGRAD and bf16 runs without it
        expert_bwd.dh_fp8_from_rows(dy, w2tq, w2ts, plan, plan, top_k, torch.bfloat16)
        amax = quant.x_scales_amax(x_scales, x, plan, top_k)
        xt_, dyt_ = quant.quantize_tile_cols(x, plan, top_k, col_amax=amax), quant.quantize_tile_cols(dy, plan, top_k)
        _, _, _, dzt_, hwt_ = expert_bwd.act_bwd_tile_cols(products, dh, weights, plan, top_k)
        expert_bwd.wgrad_fp8(*dyt_, *hwt_, plan, torch.bfloat16)
        expert_bwd.wgrad_fp8(*dzt_, *xt_, plan, torch.bfloat16, b_const=amax is not None)
        combine(dx_slots, idx, torch.bfloat16)

    def bf16_wgrads():
        x_sorted_, dy_sorted_, dyq_, dys_ = expert_bwd.gather_rows(x, dy, plan, top_k, quantize_dy=True)
        expert_bwd.dh_fp8(dyq_, dys_, w2tq, w2ts, plan, torch.bfloat16)
        dz_, hw_, *_ = expert_bwd.act_bwd_from_preact(products, dh, weights, plan, top_k, quant_dz=True)
        expert_bwd.expert_wgrad(dy_sorted_, hw_, plan, torch.bfloat16, gemm="dw2")
        expert_bwd.expert_wgrad_and_combine(dz_, x_sorted_, plan, torch.bfloat16, dx_slots, idx, torch.bfloat16)

    def rows_gemm(kernel, a, a_s, w, w_s, wts, block_n=128):
        return lambda: expert_fwd.sorted_rows_gemm_fp8(kernel, a, a_s, w, w_s, wts, plan, torch.bfloat16,
                                                       block_n=block_n)

    def up(preact_NH=None):
        return lambda: expert_fwd.up_swiglu_fp8(xq, xs, w13q, w13s, plan, top_k, preact_NH=preact_NH)

    # The variants checked bitwise against the layer's own variant of their GEMM: stage → (that stage, the part of the
    # outputs that both write).
    twins = {"up, products stored": ("up (+ SwiGLU, h quantised)", lambda out: (out[0][:rows], out[1][:, :rows]))}
    kept_slots = idx.reshape(-1) >= 0  # the rows down writes (to slots); dh' and dx write the first `rows`

    up_flops, down_flops = 2 * rows * dim * 2 * inter, 2 * rows * dim * inter
    # (name, function, FLOPs or None, bytes moved or None, the dense FP8 GEMM of the same size (m, n, k) or None)
    stages = [
        ("quantize x (T, D)", lambda: quant.quantize_rows(x), None, x.numel() * 3 + xs.numel() * 4, None),
        ("quantize dy rows (N, D)", lambda: quant.quantize_rows(dy_sorted), None,
         dy_sorted.numel() * 3 + dys.numel() * 4, None),
        ("sort x, dy rows (N, D) each", lambda: expert_bwd.gather_rows(x, dy, plan, top_k), None,
         x.numel() * 4 + num_slots * dim * 4, None),
        ("sort x, dy rows, dy quantised beside", lambda: expert_bwd.gather_rows(x, dy, plan, top_k, quantize_dy=True),
         None, x.numel() * 4 + num_slots * dim * 5 + dys.numel() * 4, None),
        ("dy rows quantised, then copied sorted", lambda: expert_bwd.sorted_quantized_rows(dy, plan, top_k), None,
         dy.numel() * 3 + num_slots * dim * 2 + dys.numel() * 4, None),
        ("quantize w13 + w2 (both ways)", lambda: (quant.quantize_weight(w13), quant.quantize_weight(w2)), None,
         (w13.numel() + w2.numel()) * 4 + (w13s.numel() + w2s.numel()) * 8, None),
        # what a call makes under the "call" cache policy: the forward's straight copies, the backward's transposed
        ("quantize w13 + w2 (straight)", lambda: (quant.quantize_weight(w13, transposed=False),
                                                  quant.quantize_weight(w2, transposed=False)), None,
         (w13.numel() + w2.numel()) * 3 + (w13s.numel() + w2s.numel()) * 4, None),
        ("quantize w13 + w2 (transposed)", lambda: (quant.quantize_weight(w13, straight=False),
                                                    quant.quantize_weight(w2, straight=False)), None,
         (w13.numel() + w2.numel()) * 3 + (w13s.numel() + w2s.numel()) * 4, None),
        ("up (+ SwiGLU, h quantised)", up(), up_flops, None, (rows, 2 * inter, dim)),
        ("up, products stored", up(preact), up_flops, None, (rows, 2 * inter, dim)),
        ("up, products only (the backward's recompute)",
         lambda: expert_fwd.up_products_fp8(xq, xs, w13q, w13s, plan, top_k, preact), up_flops, None,
         (rows, 2 * inter, dim)),
    ]
    rows_gemms = (("down", (expert_fwd.DOWN_FP8, hq, hs, w2q, w2s, flat_weights), down_flops, (rows, dim, inter)),
                  ("dh'", (expert_bwd.DH_FP8, dyq, dys, w2tq, w2ts, None), down_flops, (rows, inter, dim)),
                  ("dx", (expert_bwd.DX_FP8, dzq, dzs, w13tq, w13ts, None), up_flops, (rows, dim, 2 * inter)))
    for name, operands, flops, dense in rows_gemms:
        stages.append((name, rows_gemm(*operands), flops, None, dense))
        if operands[3].shape[1] % 256 == 0:
            stages.append((name + " (256 columns)", rows_gemm(*operands, block_n=256), flops, None, dense))
        # the layer's variant (gluon_fp8_sm90.rows_block_n)
        layer = name + (" (256 columns)" if gluon_fp8_sm90.rows_block_n(operands[3].shape[1]) == 256 else "")
        view = (lambda out: out[kept_slots]) if name == "down" else (lambda out: out[:rows])
        twins.update({stage[0]: (layer, view) for stage in stages
                      if stage[0].split(" (")[0] == name and stage[0] != layer})
    stages += [
        ("dy's sorted 1x128 copy, then dh' (on sorted rows)", lambda: expert_bwd.dh_fp8(
            *expert_bwd.sorted_quantized_rows(dy, plan, top_k), w2tq, w2ts, plan, torch.bfloat16), down_flops, None,
         (rows, inter, dim)),
        ("dh' from dy's rows (dy quantised per row)", lambda: expert_bwd.dh_fp8_from_rows(
            dy, w2tq, w2ts, plan, plan, top_k, torch.bfloat16), down_flops, None, (rows, inter, dim)),
    ]
    twins["dh' from dy's rows (dy quantised per row)"] = ("dy's sorted 1x128 copy, then dh' (on sorted rows)",
                                                          lambda out: out[:rows])
    stages += [
        ("wgrad: quantize 128x1 (N, D)", lambda: quant.quantize_tile_cols(x_sorted, plan), None, tile_cols_bytes(dim),
         None),
        ("wgrad: quantize 128x1 (N, D) from the tokens' rows", lambda: quant.quantize_tile_cols(x, plan, top_k),
         None, tile_cols_bytes(dim), None),
        ("wgrad: quantize 128x1 (N, D) (Triton)", lambda: quant.quantize_tile_cols(x_sorted, plan, gluon=False), None,
         tile_cols_bytes(dim), None),
        ("wgrad: quantize 128x1 (N, D) from the tokens' rows (Triton)",
         lambda: quant.quantize_tile_cols(x, plan, top_k, gluon=False), None, tile_cols_bytes(dim), None),
        ("wgrad: x's channel amax (T, D)", lambda: quant.channel_amax(x), None, x.numel() * 2, None),
        ("wgrad: quantize 128x1 (N, D) from the tokens' rows, the layer's amax",
         lambda: quant.quantize_tile_cols(x, plan, top_k, col_amax=x_amax), None, tile_cols_bytes(dim), None),
        ("wgrad: x's channel amax per expert (N, D) from the tokens' rows",
         lambda: quant.expert_channel_amax(x, plan, top_k), None, num_slots * dim * 2, None),
        ("wgrad: quantize 128x1 (N, D) from the tokens' rows, the experts' amax",
         lambda: quant.quantize_tile_cols(x, plan, top_k, col_amax=x_expert_amax), None, tile_cols_bytes(dim), None),
        ("act step on the products, dz 1x128 beside",
         lambda: expert_bwd.act_bwd_from_preact(products, dh, weights, plan, top_k, quant_dz=True), None,
         num_slots * inter * (4 + 2 + 4 + 2 + 2) + dzs.numel() * 4, None),
        ("wgrad: quantize 128x1 (N, 2I)", lambda: quant.quantize_tile_cols(dz, plan), None, tile_cols_bytes(2 * inter),
         None),
        ("wgrad: quantize 128x1 (N, I)", lambda: quant.quantize_tile_cols(hw, plan), None, tile_cols_bytes(inter),
         None),
        ("wgrad: quantize 128x1 (N, 2I) (Triton)", lambda: quant.quantize_tile_cols(dz, plan, gluon=False), None,
         tile_cols_bytes(2 * inter), None),
        ("act step, then dz's and h·w's 128x1",
         lambda: expert_bwd.act_bwd_tile_cols(products, dh, weights, plan, top_k, gluon=False), None,
         act_tile_cols_bytes, None),
        ("act step into dz's and h·w's 128x1 (one kernel)",
         lambda: expert_bwd.act_bwd_tile_cols(products, dh, weights, plan, top_k), None, act_tile_cols_bytes, None),
    ]
    busy = int(sum(-(-c // 128) for c in (plan.offsets_E1[1:] - plan.offsets_E1[:-1]).tolist()))

    def busy_tiles(out):  # the tile columns that the quantisers write (idle tiles' columns are never written)
        return out[0][:, :busy * 128], out[1][:busy]

    twins.update({name + " (Triton)": (name, busy_tiles) for name in (
        "wgrad: quantize 128x1 (N, D)", "wgrad: quantize 128x1 (N, D) from the tokens' rows",
        "wgrad: quantize 128x1 (N, 2I)")})
    wgrad_gemms = (("dW13", dzt, xt, up_flops, (2 * inter, dim, rows)),
                   ("dW2", dyt, hwt, down_flops, (dim, inter, rows)))
    # each weight gradient in blocks of 128 and 256 columns, the layer's width also in the other order
    for name, a, b, flops, dense in wgrad_gemms:
        for block_n in (128, 256):
            if b[0].shape[0] % block_n:
                continue
            base = name + " FP8" + (" (256 columns)" if block_n == 256 else "")
            stages.append((base, lambda a=a, b=b, block_n=block_n: expert_bwd.wgrad_fp8(
                *a, *b, plan, torch.bfloat16, block_n), flops, None, dense))
            if block_n == gluon_fp8_sm90.wgrad_block_n(b[0].shape[0]):
                by_size = not gluon_sm90.WGRAD_BY_SIZE
                stages.append((base + ORDERS["size" if by_size else "expert"][0],
                               lambda a=a, b=b, block_n=block_n, by_size=by_size: expert_bwd.wgrad_fp8(
                                   *a, *b, plan, torch.bfloat16, block_n, by_size=by_size), flops, None, dense))
    for block_n in (128, 256):  # dW13 with x's scales per channel over the layer: not the recipe's sums
        if dim % block_n == 0:
            stages.append(("dW13, x's scales over the layer (FP8" + (", 256 columns)" if block_n == 256 else ")"),
                           lambda block_n=block_n: expert_bwd.wgrad_fp8(*dzt, *xt_layer, plan, torch.bfloat16, block_n,
                                                                         b_const=True), up_flops, None,
                           (2 * inter, dim, rows)))
    for name, _, b, _, _ in wgrad_gemms:  # every FP8 variant of a weight gradient against the layer's width and order
        wide = gluon_fp8_sm90.wgrad_block_n(b[0].shape[0]) == 256
        layer = name + " FP8" + (" (256 columns)" if wide else "")
        twins.update({stage[0]: (layer, lambda out: out) for stage in stages
                      if stage[0].startswith(name + " FP8") and stage[0] != layer})
    stages += [
        ("dW13 bf16", lambda: expert_bwd.expert_wgrad(dz, x_sorted, plan, torch.bfloat16, gemm="dw13"), up_flops,
         None, None),
        ("dW2 bf16", lambda: expert_bwd.expert_wgrad(dy_sorted, hw, plan, torch.bfloat16, gemm="dw2"), down_flops,
         None, None),
        ("the FP8 backward's part that FP8_WGRAD changes, FP8", fp8_wgrads, up_flops + 2 * down_flops, None, None),
        ("the same, x's scales over the layer", lambda: fp8_wgrads("layer"), up_flops + 2 * down_flops, None, None),
        ("the same, x's scales per expert", lambda: fp8_wgrads("expert"), up_flops + 2 * down_flops, None, None),
        ("the FP8 backward's part that FP8_WGRAD changes, bf16", bf16_wgrads, up_flops + 2 * down_flops, None,
         None),
    ]
    every_stage = {stage[0]: stage[1] for stage in stages}
    stages = select_stages(stages, args.stages)
    src = torch.empty(256 * 2**20, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / do_bench(lambda: dst.copy_(src), warmup=25, rep=200) / 1e6
    ceilings = {}
    results = []
    times = {stage[0]: [] for stage in stages}
    for round_ in range(1, args.rounds):  # all but the last round, the stages in turn; the last one prints the table
        for name, fn, *_ in stages:
            times[name].append(do_bench(fn, warmup=25, rep=200))
        print(f"round {round_} of {args.rounds}: {len(stages)} stages timed", flush=True)
    print(f"{torch.cuda.get_device_name()}  {args.preset}  T={args.tokens}  (device copy {copy_gbs:.0f} GB/s)")
    spread_head = f" {'spread':>7s}" if args.rounds > 1 else ""
    print(f"{'stage':36s} {'ms':>8s} {'TF/s':>7s} {'dense FP8 TF/s':>15s} {'GB/s':>7s} {'same':>5s}{spread_head}")
    for name, fn, flops, nbytes, dense in stages:
        times[name].append(do_bench(fn, warmup=25, rep=200))
        ms = statistics.median(times[name])
        if dense is not None and dense not in ceilings:
            ceilings[dense] = scaled_mm_tflops(*dense)
        r = {"stage": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
             "dense_fp8_tflops": ceilings.get(dense), "gbs": nbytes / ms / 1e6 if nbytes else None}
        if args.rounds > 1:
            r["ms_rounds"] = times[name]
        if name in twins:
            layer, view = twins[name]
            r["bitwise_as"], r["bitwise_equal"] = layer, same_outputs(view(fn()), view(every_stage[layer]()))
        results.append(r)
        same = {True: "yes", False: "NO"}.get(r.get("bitwise_equal"), "")
        spread = f" {(max(times[name]) - min(times[name])) / ms:7.1%}" if args.rounds > 1 else ""
        print(f"{name:36s} {ms:8.3f} {r['tflops'] or 0:7.0f} {r['dense_fp8_tflops'] or 0:15.0f} {r['gbs'] or 0:7.0f} "
              f"{same:>5s}{spread}")
    if args.out:
        subset = "-some-stages" if args.stages else ""  # never in place of a whole table's record
        routing = "" if args.routing == "random" else f"-{args.routing}"
        write_record(args.out, f"fp8-kernels-{args.preset}-t{args.tokens}{routing}{subset}.json",
                     "python -m tools.fp8 " + " ".join(shlex.quote(a) for a in sys.argv[1:]), preset=args.preset,
                     tokens=args.tokens, routing=args.routing, rounds=args.rounds, device_copy_gbs=copy_gbs,
                     stages=results)
    differ = [r["stage"] for r in results if r.get("bitwise_equal") is False]
    if differ:
        raise SystemExit(f"these variants do not write bitwise what the layer's variant of their GEMM writes: {differ}")


if __name__ == "__main__":
    main()
