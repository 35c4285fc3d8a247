"""Backward expert kernels. Keeping nothing (the default memory mode) the gate/up GEMM is recomputed (step 3); in
the saved mode the act step reads the forward's gate/up products instead (``act_bwd_from_preact``,
``_act_from_preact_kernel``).

Shape legend as in expert_fwd.py; NI = ceil(I / BN_ACT) intermediate blocks.

One device:

1. ``_scatter_rows_kernel`` — x and dy rows copied into sorted order (for every later step), token-major.
2. dh' = dy W2[e] (N, I), sorted rows: a grouped GEMM through TMA (``expert_fwd.sorted_rows_gemm_kernel``,
   the down projection's kernel, its output rows left in sorted order).
3. ``_act_bwd_kernel`` — per tile × I-block, one loop over D recomputes g and u from the
   sorted x rows (TMA); epilogue, with dh' read back: h, a partial d(routing weight) = sum_i dh'·h per
   I-block, dz = [dg | du] (scaled by the routing weight) and h·w (for dW2). Computing dh' in the same
   K-loop instead (three 128×128 fp32 accumulators: 255 registers, spills) measured 8–11% slower for
   the two steps together (docs/PERFORMANCE.md).
4. dx — dz W13 → unweighted dx slot rows (``expert_fwd.sorted_rows_gemm_kernel`` again); combine.py
   reduces them per token.
5. ``_expert_wgrad_kernel`` — per expert, K-grouped GEMMs over that expert's sorted rows:
   dW13[e] = dz^T x_rows, dW2[e] = dy_rows^T (h·w). An expert with no rows gets exact zeros. The FP8 path may
   run them in FP8 instead (``wgrad_fp8``: both operands quantised 128x1 per plan tile by
   ``quant.quantize_tile_cols``, then ``_expert_wgrad_fp8_kernel`` or, on sm90,
   ``gluon_fp8_sm90_details.wgrad``).

On sm90 with 16-bit operands, steps 2, 3 and 5 run warp-specialized Gluon twins instead (``gluon_sm90.py``:
``_dh_ws_kernel``, ``_act_ws_kernel``, ``_wgrad_ws_kernel``; same operands and outputs), and two copies move
into them, run by a partition of their own beside the MMAs: step 1 copies only dy ahead, x's rows are copied
inside the dh' kernel (``sorted_rows_and_dh``); with ``autograd.LOW_PEAK_BACKWARD`` off
(``MEGAMOE_LOW_PEAK_BACKWARD=0``) step 4's combine runs inside the dW13 kernel (``expert_wgrad_and_combine``), by
default on its own after dW13.

Expert parallelism runs steps 3–5 on its receive buffers, which are already in expert order; its dh' GEMM
waits for the rows as they arrive (``parallel.owner.send_and_dh``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.env import fp8_pow2_scales
from megamoe.kernels.combine import combine
from megamoe.kernels.common import (
    busy_tiles,
    descriptor,
    dot_precision,
    tile_grid,
    tile_rows,
)
from megamoe.kernels.expert_fwd import (
    DOWN,
    FP8_ROWS_CONFIG,
    sorted_rows_gemm,
    sorted_rows_gemm_fp8,
    sorted_rows_gemm_kernel,
    up_products_fp8,
)
from megamoe.kernels.gluon_fp8_sm90 import (
    FP8_BN,
    fp8_act_tile_cols_ws,
    fp8_wgrad_ws,
    fp8_ws_supported,
)
from megamoe.kernels.gluon_sm90 import act_bwd_ws, dh_ws, expert_wgrad_ws, ws_supported
from megamoe.kernels.plan import BLOCK_M, Plan
from megamoe.kernels.quant import (
    FP8,
    quantize_groups,
    quantize_rows,
    quantize_tile_cols,
    tile_cols_outputs,
)
from megamoe.kernels.tuning import TunedKernel, configs


@triton.jit
def _act_bwd_kernel(
    x_desc,  # (N, D) sorted x rows; block (BM, BK)
    dh_ptr,  # (N, I) dh' = dy W2[e], sorted rows
    w13_desc,  # (E, 2, I, D) view of w13 (gate, up); block (1, 1, BN, BK)
    weights_ptr,  # (N,) routing weights, flat slots
    dz_ptr,  # (N, 2I) out: [dg | du], sorted rows
    hw_ptr,  # (N, I) out: h * weight, sorted rows
    dweight_part_ptr,  # (NI, N) fp32 out: partial d(routing weight) per PART_COLS columns, flat slots
    row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
    N, D, I, E,
    PREC: tl.constexpr, TILE_M: tl.constexpr, PART_COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):
    """The x operand comes in through TMA from row ``row0`` of the sorted rows. Past the expert's last row
    those are the next expert's rows (or rows nobody wrote, after the last routed one, or TMA's zeros past
    N); each output row depends only on its own x row, and every store and d(weight) partial is masked to
    the expert's rows, so those rows change nothing."""
    e, row0, rows, rmask, pid_n = tile_rows(tl.program_id(0), tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                             tl.cdiv(I, BN), BM, TILE_M)
    if e >= E:
        return
    slots = tl.load(row_slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
    n0 = pid_n * BN
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        # The descriptors zero-fill past D and past this expert's I columns.
        a = x_desc.load([row0, k0])
        bg = w13_desc.load([e, 0, n0, k0]).reshape(BN, BK)
        bu = w13_desc.load([e, 1, n0, k0]).reshape(BN, BK)
        acc_g = tl.dot(a, bg.T, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, bu.T, acc_u, input_precision=PREC)
    _swiglu_bwd_epilogue(acc_g, acc_u, rows, rmask, slots, pid_n, dh_ptr, weights_ptr, dz_ptr, hw_ptr, dweight_part_ptr,
                         N, I, PART_COLS, BN)


@triton.jit
def _swiglu_bwd_values(acc_g, acc_u, acc_d, wt):
    """A block's SwiGLU backward in fp32 from its gate and up products, dh' and its rows' routing weights: (h, dg,
    du), dz = [dg | du] (h's routing weight is applied to dh' before both)."""
    sig = tl.sigmoid(acc_g)
    silu = acc_g * sig
    h = silu * acc_u
    dh = acc_d * wt[:, None]
    du = dh * silu
    dg = dh * acc_u * (sig + silu * (1.0 - sig))
    return h, dg, du


@triton.jit
def _store_dweight_parts(dwh, rmask, slots, pid_n, dweight_part_ptr, N, I, PART_COLS: tl.constexpr, BN: tl.constexpr):
    """The d(routing weight) partials of a block, dh' * h summed per PART_COLS columns (``dwh``), one row each."""
    # One partial per PART_COLS columns, whatever BN is: every config writes every partial row, so a
    # config switch (the autotuner runs several on the same buffers) leaves no stale partial behind.
    # Columns past I hold zeros (masked weights), so they add nothing.
    local = tl.arange(0, BN) // PART_COLS
    for j in tl.static_range(BN // PART_COLS):
        part_row = pid_n * (BN // PART_COLS) + j
        tl.store(dweight_part_ptr + part_row.to(tl.int64) * N + slots,
                 tl.sum(tl.where((local == j)[None, :], dwh, 0.0), axis=1),
                 mask=rmask & (part_row * PART_COLS < I))


@triton.jit
def _store_dz_rows_fp8(dg, du, rows, rmask, pid_n, dzq_ptr, dzs_ptr, N, I, POW2: tl.constexpr):
    """A block's dz quantised 1x128 (BN = 128) into dzq (N, 2I) e4m3 and dzs (2I/128, N): its dg columns are
    group ``pid_n`` of a row, its du columns group I/128 + ``pid_n``."""
    cols = pid_n * 128 + tl.arange(0, 128)
    omask = rmask[:, None] & (cols < I)[None, :]
    dzq_ptrs = dzq_ptr + rows[:, None].to(tl.int64) * 2 * I + cols[None, :]
    dg_q, dg_s = quantize_groups(dg, POW2)
    du_q, du_s = quantize_groups(du, POW2)
    tl.store(dzq_ptrs, dg_q, mask=omask)
    tl.store(dzq_ptrs + I, du_q, mask=omask)
    tl.store(dzs_ptr + pid_n * N + rows, dg_s, mask=rmask)
    tl.store(dzs_ptr + (I // 128 + pid_n) * N + rows, du_s, mask=rmask)


@triton.jit
def _swiglu_bwd_epilogue(acc_g, acc_u, rows, rmask, slots, pid_n, dh_ptr, weights_ptr, dz_ptr, hw_ptr, dweight_part_ptr,
                         N, I, PART_COLS: tl.constexpr, BN: tl.constexpr, dzq_ptr=None, dzs_ptr=None,
                         QUANT_DZ: tl.constexpr = False, POW2: tl.constexpr = False):
    """The SwiGLU backward of one (rows, N-block ``pid_n``) block from its gate and up products (fp32): h, the
    d(routing weight) partials, dz = [dg | du] and h·w (arguments as for ``_act_bwd_kernel``). QUANT_DZ (BN =
    128): dz as written (in dz_ptr's dtype) also 1x128-quantised into ``dzq`` (N, 2I) e4m3 and its scales ``dzs``
    (2I/128, N) (``_store_dz_rows_fp8``; POW2: power-of-two scales, ``quant.scale_and_inverse``)."""
    cols = pid_n * BN + tl.arange(0, BN)
    omask = rmask[:, None] & (cols < I)[None, :]
    rows64 = rows[:, None].to(tl.int64)
    acc_d = tl.load(dh_ptr + rows64 * I + cols[None, :], mask=omask, other=0.0).to(tl.float32)
    wt = tl.load(weights_ptr + slots, mask=rmask, other=0.0).to(tl.float32)
    h, dg, du = _swiglu_bwd_values(acc_g, acc_u, acc_d, wt)
    _store_dweight_parts(acc_d * h, rmask, slots, pid_n, dweight_part_ptr, N, I, PART_COLS, BN)
    dz_ptrs = dz_ptr + rows64 * 2 * I + cols[None, :]
    dg_w = dg.to(dz_ptr.dtype.element_ty)
    du_w = du.to(dz_ptr.dtype.element_ty)
    tl.store(dz_ptrs, dg_w, mask=omask)
    tl.store(dz_ptrs + I, du_w, mask=omask)
    tl.store(hw_ptr + rows64 * I + cols[None, :], (h * wt[:, None]).to(hw_ptr.dtype.element_ty), mask=omask)
    if QUANT_DZ:  # dz as written, quantised
        _store_dz_rows_fp8(dg_w.to(tl.float32), du_w.to(tl.float32), rows, rmask, pid_n, dzq_ptr, dzs_ptr, N, I, POW2)


@triton.jit
def _act_from_preact_kernel(
    preact_ptr,  # (N, 2I) the forward's [g | u], sorted rows (the saved-activation mode)
    dh_ptr, weights_ptr, dz_ptr, hw_ptr, dweight_part_ptr,  # as for _act_bwd_kernel
    row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
    dzq_ptr,  # (N, 2I) e4m3 out, if QUANT_DZ: dz quantised 1x128, the FP8 dx GEMM's operand
    dzs_ptr,  # (2I/128, N) fp32 out, if QUANT_DZ: its scales
    N, I, E,
    QUANT_DZ: tl.constexpr, TILE_M: tl.constexpr, PART_COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    POW2: tl.constexpr,
):
    """The act kernel's epilogue on the saved gate and up products instead of a recomputed GEMM: memory-bound,
    one program per (sub-)tile x N-block. QUANT_DZ: dz also quantised 1x128 (the FP8 path; BN = 128; POW2: with
    power-of-two scales)."""
    e, _, rows, rmask, pid_n = tile_rows(tl.program_id(0), tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                         tl.cdiv(I, BN), BM, TILE_M)
    if e >= E:
        return
    slots = tl.load(row_slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    omask = rmask[:, None] & (cols < I)[None, :]
    g_ptrs = preact_ptr + rows[:, None].to(tl.int64) * 2 * I + cols[None, :]
    acc_g = tl.load(g_ptrs, mask=omask, other=0.0).to(tl.float32)
    acc_u = tl.load(g_ptrs + I, mask=omask, other=0.0).to(tl.float32)
    _swiglu_bwd_epilogue(acc_g, acc_u, rows, rmask, slots, pid_n, dh_ptr, weights_ptr, dz_ptr, hw_ptr, dweight_part_ptr,
                         N, I, PART_COLS, BN, dzq_ptr, dzs_ptr, QUANT_DZ, POW2)


@triton.jit
def _invert_rows_kernel(row_slot_ptr, slot_row_ptr, N, BLOCK: tl.constexpr):
    """slot_row[row_slot[r]] = r: the sorted row of every slot (row_slot is a permutation of the N slots)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < N
    tl.store(slot_row_ptr + tl.load(row_slot_ptr + rows, mask=mask, other=0), rows, mask=mask)


@triton.jit
def _scatter_rows_kernel(
    a_ptr,  # (T, D)
    b_ptr,  # (T, D), with HAS_B
    a_out_ptr,  # (N, D) out: a's rows in sorted order (rows past the routed count not written)
    b_out_ptr,  # (N, D) out: b's rows in sorted order, with HAS_B
    bq_ptr,  # (N, D) e4m3 out, with QUANT_B: b's sorted rows quantised 1x128 (``quant.quantize_rows``' format)
    bs_ptr,  # (D / 128, N) fp32 out, with QUANT_B: their scales
    slot_row_ptr, offsets_ptr,
    T, D, E, top_k, N,
    HAS_B: tl.constexpr, QUANT_B: tl.constexpr, POW2: tl.constexpr, TB: tl.constexpr, BD: tl.constexpr,
):
    """Token-major: each program reads TB tokens' columns once and writes them to each of their top_k sorted
    rows. (Row-major, gathering each sorted row from its token, re-reads a token's row once per slot, from
    DRAM once the rows outgrow L2.) QUANT_B (BD a multiple of 128): b's rows also quantised, once per token, and
    written beside it (a row's quantisation depends on the row alone, so it is that of its sorted copy)."""
    toks = tl.program_id(0) * TB + tl.arange(0, TB)
    tmask = toks < T
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = (cols < D)[None, :]
    src = toks[:, None].to(tl.int64) * D + cols[None, :]
    a = tl.load(a_ptr + src, mask=tmask[:, None] & cmask)
    if HAS_B:
        b = tl.load(b_ptr + src, mask=tmask[:, None] & cmask, other=0.0)
        if QUANT_B:
            G: tl.constexpr = BD // 128
            bq, bs = quantize_groups(tl.reshape(b.to(tl.float32), (TB * G, 128)), POW2)
            bq = tl.reshape(bq, (TB, BD))
            bs = tl.reshape(bs, (TB, G))
            groups = tl.program_id(1) * G + tl.arange(0, G)
    routed = tl.load(offsets_ptr + E)
    for k in range(top_k):
        rows = tl.load(slot_row_ptr + toks * top_k + k, mask=tmask, other=0)
        written = tmask & (rows < routed)
        mask = written[:, None] & cmask
        dst = rows[:, None].to(tl.int64) * D + cols[None, :]
        tl.store(a_out_ptr + dst, a, mask=mask)
        if HAS_B:
            tl.store(b_out_ptr + dst, b, mask=mask)
            if QUANT_B:
                tl.store(bq_ptr + dst, bq, mask=mask)
                tl.store(bs_ptr + groups[None, :].to(tl.int64) * N + rows[:, None], bs,
                         mask=written[:, None] & (groups < D // 128)[None, :])


@triton.jit
def _wgrad_block(pid, offsets_ptr, P, Q, BM: tl.constexpr, BN: tl.constexpr):
    """Block ``pid`` of the weight gradients' expert-major grid: its expert, first P and Q, and the expert's
    sorted rows [start, end)."""
    num_p = tl.cdiv(P, BM)
    num_q = tl.cdiv(Q, BN)
    e = pid // (num_p * num_q)
    pq = pid % (num_p * num_q)
    return e, (pq // num_q) * BM, (pq % num_q) * BN, tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1)


@triton.jit
def _expert_wgrad_kernel(
    a_desc,  # (N, P) sorted rows; block (BK, BM)
    b_desc,  # (N, Q) sorted rows; block (BK, BN)
    a_ptr, b_ptr,  # the same rows, for the masked last step
    dw_desc,  # (E, P, Q) out: dW[e] = sum over the expert's rows r of a[r]^T b[r]; block (1, BM, BN)
    offsets_ptr,
    P, Q,
    PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """One (expert, P-block, Q-block) per program; the K-loop runs over that expert's rows. Both
    operands are in sorted row order and come in through TMA (gathering through the row map inside the
    K-loop measured 1.45x slower: the dependent index loads stall the pipeline). TMA zero-fills past N,
    P and Q but not past the expert's last row, whose next rows are the next expert's (or, in a receive
    buffer, never written: possibly NaN, which a zero in the other operand would not cancel): the last,
    partial step reads both operands through masked pointer loads instead. The 1-D grid is
    expert-major, so the programs running at once share one expert's rows in L2 (expert-minor order
    re-reads them from DRAM once per output block)."""
    e, p0, q0, start, end = _wgrad_block(tl.program_id(0), offsets_ptr, P, Q, BM, BN)
    ps = p0 + tl.arange(0, BM)
    qs = q0 + tl.arange(0, BN)
    full_end = start + (end - start) // BK * BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(start, full_end, BK):
        acc = tl.dot(a_desc.load([r0, p0]).T, b_desc.load([r0, q0]), acc, input_precision=PREC)
    if full_end < end:
        rows = (full_end + tl.arange(0, BK)).to(tl.int64)
        a = tl.load(a_ptr + rows[None, :] * P + ps[:, None], mask=(ps < P)[:, None] & (rows < end)[None, :], other=0.0)
        b = tl.load(b_ptr + rows[:, None] * Q + qs[None, :], mask=(rows < end)[:, None] & (qs < Q)[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    # A TMA store: the block is this program's alone, and the copy engine clips it at P and Q.
    dw_desc.store([e, p0, q0], acc.to(dw_desc.dtype).reshape(1, BM, BN))


@triton.jit
def _expert_wgrad_fp8_kernel(
    a_desc,  # (P, NT * 128) e4m3: a's sorted rows in tile columns (quant.quantize_tile_cols); block (BM, BK)
    b_desc,  # (Q, NT * 128) e4m3: b's, the same; block (BN, BK)
    a_scale_ptr,  # (NT, P) fp32
    b_scale_ptr,  # (NT, Q) fp32
    out_ptr,  # (E, P, Q) out: dW[e] = sum over the expert's tiles t of deq(a)[tile t]^T deq(b)[tile t]
    offsets_ptr,
    P, Q,
    EB: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    B_CONST: tl.constexpr,
):
    """``_expert_wgrad_kernel`` on FP8 operands quantised 128x1 along the tokens: one K-step per plan tile of the
    expert (BK = TILE_M), whose product is promoted with the outer product of the two operands' scales of that
    tile. Tiles hold zeros past their expert's end, so no step needs a mask. P and Q multiples of 128. B_CONST: b's
    scales are the same in every tile of the expert (``quant.quantize_tile_cols``'s ``col_amax``): each step is
    promoted with a's scales alone, and the sum times b's column scales of its last tile once, at the end."""
    tl.static_assert(BK == TILE_M, "a K-step is one plan tile: one scale per column and operand")
    e, p0, q0, start, end = _wgrad_block(tl.program_id(0), offsets_ptr, P, Q, BM, BN)
    ps = p0 + tl.arange(0, BM)
    qs = q0 + tl.arange(0, BN)
    first = busy_tiles(offsets_ptr, e, EB, TILE_M)  # the tiles of the experts before e
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    last = first + tl.cdiv(end - start, BK)
    for t in range(first, last):
        sa = tl.load(a_scale_ptr + t * P + ps)
        if B_CONST:
            acc += tl.dot(a_desc.load([p0, t * BK]), b_desc.load([q0, t * BK]).T) * sa[:, None]
        else:
            sb = tl.load(b_scale_ptr + t * Q + qs)
            acc += tl.dot(a_desc.load([p0, t * BK]), b_desc.load([q0, t * BK]).T) * (sa[:, None] * sb[None, :])
    if B_CONST:  # an expert without rows has no tile to read: its zeros stay
        acc = acc * tl.load(b_scale_ptr + (last - 1) * Q + qs, mask=(qs < Q) & (last > first), other=1.0)[None, :]
    tl.store(out_ptr + e.to(tl.int64) * P * Q + ps[:, None] * Q + qs[None, :], acc.to(out_ptr.dtype.element_ty))


# Columns per partial d(routing weight) in the act kernel; every config's BN is a multiple of it.
PART_COLS = 64

# Defaults and candidates of the next three: a sweep on the 30B and 235B layers (docs/PERFORMANCE.md), in which
# the then expert-parallel act kernel's default (set in §7) was still the fastest of its list.
# Sorted x rows and dh' from ``DH``: two accumulators, as the up kernel.
ACT_BWD = TunedKernel(
    _act_bwd_kernel, default=configs((128, 128, 64, 8, 4))[0],
    candidates=configs((128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 128, 8, 3)),
    key=["D", "I"], even_k=None,  # the descriptors zero-fill the K tail
    blocks=lambda c: {"x_desc": [c["BM"], c["BK"]], "w13_desc": [1, 1, c["BN"], c["BK"]]},
)
# dh', down and dx: PERSISTENT or not per config (docs/DESIGN.md, "Tile configs": it wins on some shapes, not all).
DH = sorted_rows_gemm_kernel(
    default=configs((128, 256, 64, 8, 3), PERSISTENT=True)[0],
    candidates=configs((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), PERSISTENT=True)
    + configs((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), PERSISTENT=False),
    key=["N_OUT", "K"], even_k=None,  # the descriptors zero-fill the K tail
    blocks=lambda c: {"a_desc": [c["BM"], c["BK"]], "w_desc": [1, c["BK"], c["BN"]]},
    constants={"W_K_LAST": False, "WEIGHTED": False, "TO_SLOTS": False, "SCALED": False},
)
DX = sorted_rows_gemm_kernel(
    default=configs((128, 256, 64, 8, 4), PERSISTENT=False)[0],
    candidates=configs((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3), PERSISTENT=False)
    + configs((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), PERSISTENT=True),
    key=["N_OUT", "K"], even_k=None,  # the descriptors zero-fill the K tail
    blocks=lambda c: {"a_desc": [c["BM"], c["BK"]], "w_desc": [1, c["BK"], c["BN"]]},
    constants={"W_K_LAST": False, "WEIGHTED": False, "TO_SLOTS": True, "SCALED": False},
)
# Blockwise FP8 (kernels.quant), fixed configs as expert_fwd.DOWN_FP8: dh' and dx on the weights' transposed copies
# (K-major, as FP8 MMAs need them). The FP8 backward has no act GEMM of its own: it recomputes g and u with the
# forward's up kernel (``expert_fwd.up_products_fp8``) and runs the act step on them (``act_bwd_from_preact``).
DH_FP8 = sorted_rows_gemm_kernel(default=FP8_ROWS_CONFIG, candidates=[], key=DH.key, even_k=None, blocks=DOWN.blocks,
                                 constants={**DH.constants, "W_K_LAST": True, "SCALED": True})
DX_FP8 = sorted_rows_gemm_kernel(default=FP8_ROWS_CONFIG, candidates=[], key=DX.key, even_k=None, blocks=DOWN.blocks,
                                 constants={**DX.constants, "W_K_LAST": True, "SCALED": True})
# Where the Gluon kernel (gluon_sm90.py) does not run: fp32, GPUs other than sm90, the interpreter. The last
# three candidates: one warp group per program and little shared memory, 3 to 5 programs per SM, for small
# batches, where each expert has a K-step or two and the kernel is its stores and latencies.
WGRAD = TunedKernel(
    _expert_wgrad_kernel, default=configs((128, 128, 64, 8, 3))[0],
    candidates=configs((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 256, 64, 8, 3), (128, 128, 32, 8, 4),
                       (128, 128, 32, 4, 3), (64, 128, 64, 4, 2), (64, 128, 32, 4, 3)),
    key=["P", "Q"], even_k=None,
    blocks=lambda c: {"a_desc": [c["BK"], c["BM"]], "b_desc": [c["BK"], c["BN"]], "dw_desc": [1, c["BM"], c["BN"]]},
)

# FP8 weight gradients (``autograd.FP8_WGRAD``), where the Gluon kernel (gluon_fp8_sm90.py) does not run: a fixed
# config as the other FP8 kernels; BK is one plan tile.
WGRAD_FP8 = TunedKernel(
    _expert_wgrad_fp8_kernel, default=configs((128, 128, 128, 8, 3))[0], candidates=[], key=["P", "Q"], even_k=None,
    blocks=lambda c: {"a_desc": [c["BM"], c["BK"]], "b_desc": [c["BN"], c["BK"]]},
)


# The kernels without a tile config, for the ahead-of-time compile check (``tools.resources``).
KERNELS = (_invert_rows_kernel, _scatter_rows_kernel, _act_from_preact_kernel)
# Block of the act kernel on saved products (memory-bound: small row blocks, many programs per SM); BN a multiple
# of PART_COLS.
# The act step on saved products: memory-bound, one program per (rows, 128 columns) block (BN = 128: a block's dz
# columns are one 1x128 group of the FP8 path's quantisation). Its one config was 32 rows at 4 warps, which spills
# 0.7 KB per thread (0.9 with dz's quantisation) on sm_90a; the FP8 backward measured the step at 0.54 ms on the 30B
# layer, ~68% of HBM (docs/PERFORMANCE.md). 16 rows at 8 warps: 95 / 128 registers, no spills (``tools.resources``).
# The candidates: the old config, and other rows per program and warps.
ACT_FROM_PREACT = TunedKernel(
    _act_from_preact_kernel, default=configs((16, 128, 64, 8, 1))[0],
    candidates=configs((32, 128, 64, 4, 1), (16, 128, 64, 4, 1), (32, 128, 64, 8, 1), (8, 128, 64, 4, 1)),
    key=["I", "QUANT_DZ"], even_k=None, blocks=lambda c: {},
    restore=("preact_ptr",),  # dz may be written over the products (``act_bwd_from_preact``)
)


def act_bwd(x_sorted_ND, dh_NI, w13_EHD, topk_weights_TK, plan: Plan, top_k: int):
    """Returns dz (N, 2I), h·w (N, I) in sorted rows and d(routing weight) (T, K) fp32, from the sorted x rows
    (``gather_rows``) and dh' (``dh_sorted``)."""
    dz_NH, hw_NI, dweight_part = act_bwd_outputs(plan.row_slot_N.numel(), w13_EHD.shape[1], x_sorted_ND)
    act_bwd_into(x_sorted_ND, dh_NI, w13_EHD, topk_weights_TK, plan, dz_NH, hw_NI, dweight_part)
    # Fixed-order sum over the column groups: deterministic.
    return dz_NH, hw_NI, dweight_part.sum(dim=0).view(-1, top_k)


def act_bwd_outputs(num_slots: int, two_i: int, like: torch.Tensor, dz_NH: torch.Tensor | None = None):
    """The act kernel's outputs: dz (N, 2I) (``dz_NH`` where the caller gives its place) and h·w (N, I) in
    ``like``'s dtype, and the partial d(routing weight) (ceil(I / PART_COLS), N) fp32, zeroed: dropped slots are
    never written, so their d(weight) is exactly zero."""
    if dz_NH is None:
        dz_NH = torch.empty(num_slots, two_i, device=like.device, dtype=like.dtype)
    hw_NI = torch.empty(num_slots, two_i // 2, device=like.device, dtype=like.dtype)
    dweight_part = torch.zeros(triton.cdiv(two_i // 2, PART_COLS), num_slots, device=like.device, dtype=torch.float32)
    return dz_NH, hw_NI, dweight_part


def act_bwd_into(x_sorted_ND, dh_NI, w13_EHD, topk_weights_TK, plan: Plan, dz_NH, hw_NI, dweight_part,
                 gluon: bool = True) -> None:
    """Launch the act kernel (``ACT_BWD`` — on sm90 with 16-bit operands its warp-specialized Gluon twin
    ``gluon_sm90._act_ws_kernel`` instead, unless ``gluon=False``; operands as for ``act_bwd``) into given buffers;
    ``dweight_part`` is (ceil(I / PART_COLS), N) fp32."""
    num_experts, two_i, dim = w13_EHD.shape
    inter = two_i // 2
    if plan.row_slot_N.numel() == 0:  # an empty batch (a TMA descriptor cannot be empty)
        return
    if gluon and ws_supported(x_sorted_ND):
        act_bwd_ws(x_sorted_ND, dh_NI, w13_EHD, topk_weights_TK.reshape(-1), plan, dz_NH, hw_NI, dweight_part,
                   BLOCK_M, PART_COLS)
        return
    ACT_BWD[tile_grid(plan, inter)](
        x_desc=descriptor(x_sorted_ND), dh_ptr=dh_NI, w13_desc=descriptor(w13_EHD.view(num_experts, 2, inter, dim)),
        weights_ptr=topk_weights_TK.reshape(-1), dz_ptr=dz_NH, hw_ptr=hw_NI, dweight_part_ptr=dweight_part,
        row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, N=plan.row_slot_N.numel(), D=dim, I=inter, E=num_experts,
        PREC=dot_precision(dz_NH.dtype), TILE_M=BLOCK_M, PART_COLS=PART_COLS, dtype=dz_NH.dtype,
    )


def dz_fp8_outputs(num_slots: int, two_i: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """dz quantised 1x128 for the FP8 dx GEMM: (N, 2I) e4m3 and its (2I/128, N) fp32 scales."""
    return (torch.empty(num_slots, two_i, device=device, dtype=FP8),
            torch.empty(two_i // 128, num_slots, device=device, dtype=torch.float32))


def act_bwd_from_preact(preact_NH, dh_NI, topk_weights_TK, plan: Plan, top_k: int, quant_dz: bool = False,
                        dz_over_preact: bool = False):
    """``act_bwd``'s outputs from the forward's saved gate and up products (N, 2I) instead of a recomputed GEMM;
    with ``quant_dz`` (the FP8 path) also dz quantised 1x128 (``dz_fp8_outputs``). ``dz_over_preact``: dz is
    written over ``preact_NH`` (each program reads its g and u before it writes their dz to the same places), so
    that the step allocates no (N, 2I) block; for a caller that will not read the products again."""
    num_slots, two_i = preact_NH.shape
    inter = two_i // 2
    dz_NH, hw_NI, dweight_part = act_bwd_outputs(num_slots, two_i, preact_NH,
                                                 dz_NH=preact_NH if dz_over_preact else None)
    dzq, dzs = dz_fp8_outputs(num_slots, two_i, preact_NH.device) if quant_dz else (None, None)
    if num_slots:
        ACT_FROM_PREACT[tile_grid(plan, inter)](
            preact_ptr=preact_NH, dh_ptr=dh_NI, weights_ptr=topk_weights_TK.reshape(-1), dz_ptr=dz_NH, hw_ptr=hw_NI,
            dweight_part_ptr=dweight_part, row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1,
            tile_expert_ptr=plan.tile_expert_NT, tile_row_ptr=plan.tile_row_NT, dzq_ptr=dzq, dzs_ptr=dzs, N=num_slots,
            I=inter, E=plan.offsets_E1.numel() - 1, QUANT_DZ=quant_dz, TILE_M=BLOCK_M, PART_COLS=PART_COLS,
            POW2=quant_dz and fp8_pow2_scales(), dtype=preact_NH.dtype)
    outputs = dz_NH, hw_NI, dweight_part.sum(dim=0).view(-1, top_k)
    return (*outputs, dzq, dzs) if quant_dz else outputs


def act_bwd_tile_cols(preact_NH, dh_NI, topk_weights_TK, plan: Plan, top_k: int, gluon: bool = True):
    """The act step for the FP8 weight gradients (``autograd.FP8_WGRAD``), from the forward's gate and up products
    (N, 2I): d(routing weight) (T, K) fp32, dz quantised 1x128 (dzq, dzs: ``dz_fp8_outputs``), and dz's and h·w's
    tile columns ((q, s) each, ``quant.quantize_tile_cols``'s format) quantised from their values in the products'
    dtype. On sm90 with bf16 products in one kernel (``gluon_fp8_sm90.fp8_act_tile_cols_ws``: neither dz nor h·w is
    written to memory in bf16), bit for bit what ``act_bwd_from_preact`` and ``quantize_tile_cols`` make of them
    (the products left as they were), which run elsewhere or with ``gluon=False``."""
    num_slots, two_i = preact_NH.shape
    if not (gluon and num_slots and fp8_ws_supported(preact_NH, preact_NH.dtype)):
        dz_NH, hw_NI, dweight_TK, dzq, dzs = act_bwd_from_preact(preact_NH, dh_NI, topk_weights_TK, plan, top_k,
                                                                 quant_dz=True)
        return dweight_TK, dzq, dzs, quantize_tile_cols(dz_NH, plan), quantize_tile_cols(hw_NI, plan)
    inter = two_i // 2
    dweight_part = torch.zeros(inter // PART_COLS, num_slots, device=preact_NH.device, dtype=torch.float32)
    dzq, dzs = dz_fp8_outputs(num_slots, two_i, preact_NH.device)
    dz_t, hw_t = tile_cols_outputs(two_i, plan, preact_NH.device), tile_cols_outputs(inter, plan, preact_NH.device)
    fp8_act_tile_cols_ws(preact_NH, dh_NI, topk_weights_TK.reshape(-1), plan, dweight_part, dzq, dzs, dz_t, hw_t,
                         PART_COLS)
    return dweight_part.sum(dim=0).view(-1, top_k), dzq, dzs, dz_t, hw_t


def dh_sorted(dy_sorted_ND, w2_EDI, plan: Plan) -> torch.Tensor:
    """dh' = dy W2[e] (N, I) in dy's dtype, sorted rows, from the sorted dy rows (``gather_rows``); rows
    past the routed count are not written. On sm90 with 16-bit operands through the warp-specialized Gluon
    kernel ``gluon_sm90._dh_ws_kernel``, elsewhere ``DH``."""
    num_slots = dy_sorted_ND.shape[0]
    if not (num_slots and ws_supported(dy_sorted_ND)):
        return sorted_rows_gemm(DH, dy_sorted_ND, w2_EDI, None, plan, w2_EDI.shape[2])
    out = torch.empty(num_slots, w2_EDI.shape[2], device=dy_sorted_ND.device, dtype=dy_sorted_ND.dtype)
    dh_ws(dy_sorted_ND, w2_EDI, out, plan, BLOCK_M)
    return out


def dx_slots(dz_NH, w13_EHD, plan: Plan) -> torch.Tensor:
    """Unweighted dx slot rows (N, D), token-major; dropped slots' rows are not written."""
    return sorted_rows_gemm(DX, dz_NH, w13_EHD, None, plan, w13_EHD.shape[2])


def dh_fp8(dyq_sorted_ND, dys_sorted, w2tq_EID, w2ts, plan: Plan, out_dtype: torch.dtype) -> torch.Tensor:
    """``dh_sorted`` on blockwise FP8 operands: the sorted dy rows in e4m3 with their (D/128, N) scales, and w2's
    transposed copy (E, I, D) in e4m3 with its (E, I/128, D/128) block scales; dh' in ``out_dtype``."""
    return sorted_rows_gemm_fp8(DH_FP8, dyq_sorted_ND, dys_sorted, w2tq_EID, w2ts, None, plan, out_dtype)


def dh_fp8_from_rows(dy_TD, w2tq_EID, w2ts, plan: Plan, read_plan: Plan, top_k: int, out_dtype: torch.dtype,
                     gather: bool = False) -> torch.Tensor:
    """``dh_fp8`` for ``plan``'s sorted rows with each row's dy read from row ``read_plan.row_slot[r] // top_k`` of
    ``dy_TD`` (``read_plan``: ``plan``'s tiles; its rows may share a row of dy with ``gather``, as
    ``sorted_quantized_rows`` takes them). On sm90 with bf16 rows and I a multiple of 256 (each half of I a multiple
    of the up kernel's block width), dy is quantised 1x128 per row and read through that map by the up kernel's
    products-only variant (``expert_fwd.up_products_fp8``), w2's transposed copy standing for w13 (its first and
    second halves of I for the gate and up rows, whose products are dh''s two halves): no sorted copy of dy is made.
    Elsewhere the sorted copy (``sorted_quantized_rows``) and ``dh_fp8``."""
    num_rows, inter = plan.row_slot_N.numel(), w2tq_EID.shape[1]
    if num_rows and inter % (2 * FP8_BN) == 0 and fp8_ws_supported(dy_TD, out_dtype):
        dh = torch.empty(num_rows, inter, device=dy_TD.device, dtype=out_dtype)
        up_products_fp8(*quantize_rows(dy_TD), w2tq_EID, w2ts, read_plan, top_k, dh)
        return dh
    return dh_fp8(*sorted_quantized_rows(dy_TD, read_plan, top_k, gather=gather), w2tq_EID, w2ts, plan, out_dtype)


def dx_slots_fp8(dzq_NH, dzs, w13tq_EDH, w13ts, plan: Plan, out_dtype: torch.dtype,
                 dest: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``dx_slots`` on blockwise FP8 operands: dz in e4m3 with its (2I/128, N) scales, and w13's transposed copy
    (E, D, 2I) in e4m3 with its (E, D/128, 2I/128) block scales; the rows in ``out_dtype``; ``dest``: as for
    ``expert_fwd.sorted_rows_gemm``."""
    return sorted_rows_gemm_fp8(DX_FP8, dzq_NH, dzs, w13tq_EDH, w13ts, None, plan, out_dtype, dest=dest)


def slot_rows(plan: Plan) -> torch.Tensor:
    """Each slot's sorted row (the inverse of the plan's row -> slot map)."""
    num_slots = plan.row_slot_N.numel()
    slot_row = torch.empty_like(plan.row_slot_N)
    _invert_rows_kernel[(triton.cdiv(num_slots, 1024),)](row_slot_ptr=plan.row_slot_N, slot_row_ptr=slot_row,
                                                         N=num_slots, BLOCK=1024)
    return slot_row


def _scatter_rows(a_TD, b_TD, slot_row, plan: Plan, top_k: int, quantize_b: bool = False) -> list[torch.Tensor]:
    """The rows of a (and of b, unless None) copied into sorted order, (N, D) each; rows past the routed ones
    (dropped slots) are not written. ``quantize_b`` (D a multiple of 128): also b's sorted rows quantised 1x128,
    (N, D) e4m3 and their (D / 128, N) fp32 scales, as ``quant.quantize_rows`` of b's sorted copy."""
    num_slots, (num_tokens, dim) = slot_row.numel(), a_TD.shape
    outs = [torch.empty(num_slots, dim, device=a_TD.device, dtype=a_TD.dtype) for _ in range(1 if b_TD is None else 2)]
    if quantize_b:
        assert dim % 128 == 0, dim
        outs += [torch.empty(num_slots, dim, device=a_TD.device, dtype=FP8),
                 torch.empty(dim // 128, num_slots, device=a_TD.device, dtype=torch.float32)]
    # Tokens per program: 16, or 8 with the quantisation (its fp32 copy of the block: 108 registers at D = 2048
    # against 255 with 16; the plain copy takes 144).
    tb, bd = 8 if quantize_b else 16, min(512, triton.next_power_of_2(dim))
    _scatter_rows_kernel[(triton.cdiv(num_tokens, tb), triton.cdiv(dim, bd))](
        a_ptr=a_TD, b_ptr=b_TD, a_out_ptr=outs[0], b_out_ptr=outs[1] if b_TD is not None else None,
        bq_ptr=outs[2] if quantize_b else None, bs_ptr=outs[3] if quantize_b else None, slot_row_ptr=slot_row,
        offsets_ptr=plan.offsets_E1, T=num_tokens, D=dim, E=plan.offsets_E1.numel() - 1, top_k=top_k, N=num_slots,
        HAS_B=b_TD is not None, QUANT_B=quantize_b, POW2=quantize_b and fp8_pow2_scales(), TB=tb, BD=bd,
        num_warps=4,
    )
    return outs


def gather_rows(x_TD, dy_TD, plan: Plan, top_k: int, quantize_dy: bool = False):
    """x and dy rows in expert-sorted order, (N, D) each, for dh', the act kernel and the weight gradients;
    rows past the routed ones (dropped slots) are not written. ``quantize_dy`` (D a multiple of 128): also dy's
    sorted rows in blockwise FP8, (N, D) e4m3 and (D / 128, N) fp32 scales (``quant.quantize_rows``' format and
    bits), quantised once per token in the same pass: (x rows, dy rows, dy e4m3, dy scales)."""
    num_slots, dim = plan.row_slot_N.numel(), x_TD.shape[1]
    if num_slots == 0:
        empty = torch.empty(0, dim, device=x_TD.device, dtype=x_TD.dtype)
        if quantize_dy:
            return empty, empty, empty.to(FP8), torch.empty(dim // 128, 0, device=x_TD.device)
        return empty, empty
    return tuple(_scatter_rows(x_TD, dy_TD, slot_rows(plan), plan, top_k, quantize_b=quantize_dy))


def sorted_quantized_rows(a_TD, plan: Plan, top_k: int, gather: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """a's rows in expert-sorted order quantised 1x128, (N, D) e4m3 and (D / 128, N) fp32 scales
    (``quant.quantize_rows``' format and bits, as ``gather_rows(quantize_dy=True)`` makes them for dy): each token's
    row quantised once, then its bytes and scales copied to its sorted rows (a row's quantisation depends on that
    row alone). For a backward that needs no bf16 sorted copy of a (the FP8 weight gradients read the tokens' rows
    themselves: ``quant.quantize_tile_cols`` with ``top_k``). ``gather``: a plan whose sorted rows need not be
    distinct slots (an expert-parallel owner's rows through ``recv_token_row``, several on one token row): each
    sorted row r copied from row ``row_slot[r] // top_k``, the rows past the routed count from row 0."""
    q_TD, s_T = quantize_rows(a_TD)
    num_slots = plan.row_slot_N.numel()
    if num_slots == 0:
        return torch.empty(0, a_TD.shape[1], device=a_TD.device, dtype=FP8), s_T[:, :0]
    if gather:  # (the rows past the routed count hold stale indices)
        routed = torch.arange(num_slots, device=a_TD.device) < plan.offsets_E1[-1]
        rows = torch.where(routed, plan.row_slot_N.long() // top_k, 0)
        return q_TD.view(torch.int64).index_select(0, rows).view(FP8), s_T.index_select(1, rows)
    (q,) = _scatter_rows(q_TD.view(torch.uint8), None, slot_rows(plan), plan, top_k)  # the bytes, as they are
    return q.view(FP8), s_T.index_select(1, plan.row_slot_N // top_k)


def sorted_rows_and_dh(x_TD, dy_TD, w2_EDI, plan: Plan, top_k: int):
    """(x_sorted, dy_sorted, dh'): ``gather_rows`` and ``dh_sorted`` together. On sm90 with 16-bit operands only
    dy is copied ahead; x's copy runs inside the dh' kernel, beside its MMAs (``gluon_sm90._dh_ws_kernel``)."""
    if not (plan.row_slot_N.numel() and ws_supported(dy_TD)):
        x_sorted, dy_sorted = gather_rows(x_TD, dy_TD, plan, top_k)
        return x_sorted, dy_sorted, dh_sorted(dy_sorted, w2_EDI, plan)
    slot_row = slot_rows(plan)
    (dy_sorted,) = _scatter_rows(dy_TD, None, slot_row, plan, top_k)
    x_sorted = torch.empty_like(dy_sorted)
    dh = torch.empty(dy_sorted.shape[0], w2_EDI.shape[2], device=dy_TD.device, dtype=dy_TD.dtype)
    dh_ws(dy_sorted, w2_EDI, dh, plan, BLOCK_M, copy_x=(x_TD, x_sorted, slot_row, top_k))
    return x_sorted, dy_sorted, dh


def expert_wgrad(a_NP, b_NQ, plan: Plan, out_dtype: torch.dtype, *, gemm: str | None) -> torch.Tensor:
    """(E, P, Q): per expert, the sum over its sorted rows r of outer(a[r], b[r]). ``gemm``: which of the layer's
    weight gradients this is, "dw13" or "dw2" (whether the Gluon kernel's blocks are taken in turn,
    ``gluon_sm90.WGRAD_TAKEN``), or None for neither."""
    p, q = a_NP.shape[1], b_NQ.shape[1]
    num_experts = plan.offsets_E1.numel() - 1
    if a_NP.shape[0] == 0:  # no rows at all (a TMA descriptor cannot be empty)
        return torch.zeros(num_experts, p, q, device=a_NP.device, dtype=out_dtype)
    dw = torch.empty(num_experts, p, q, device=a_NP.device, dtype=out_dtype)
    if ws_supported(a_NP) and out_dtype == a_NP.dtype:
        expert_wgrad_ws(a_NP, b_NQ, plan.offsets_E1, dw, gemm=gemm)
        return dw
    WGRAD[lambda cfg: (num_experts * triton.cdiv(p, cfg["BM"]) * triton.cdiv(q, cfg["BN"]),)](
        a_desc=descriptor(a_NP), b_desc=descriptor(b_NQ), a_ptr=a_NP, b_ptr=b_NQ, dw_desc=descriptor(dw),
        offsets_ptr=plan.offsets_E1, P=p, Q=q, PREC=dot_precision(a_NP.dtype), dtype=a_NP.dtype,
    )
    return dw


def wgrad_fp8(aq_PL, as_TP, bq_QL, bs_TQ, plan: Plan, out_dtype: torch.dtype, block_n: int | None = None,
              by_size: bool | None = None, b_const: bool = False) -> torch.Tensor:
    """``expert_wgrad`` on FP8 operands in tile columns (``quant.quantize_tile_cols``: a's (P, NT*128) e4m3 and
    (NT, P) fp32 scales, b's the same with Q): (E, P, Q) in ``out_dtype``, an expert without rows exact zeros. On
    sm90 with a bf16 output through the warp-specialized Gluon kernel (``gluon_fp8_sm90_details.wgrad``, its
    block width ``block_n``: ``gluon_fp8_sm90.wgrad_block_n``; ``by_size``: its blocks' order, as
    ``gluon_fp8_sm90.fp8_wgrad_ws`` takes it), elsewhere ``WGRAD_FP8``. P and Q multiples of 128. ``b_const``: b was
    quantised with a ``col_amax`` (``quant.quantize_tile_cols``), so that its scales are the same in every tile of an
    expert: each K-step is promoted with a's alone, b's applied once to the sum (faster; other roundings than the
    outer-product promotion of the same operands)."""
    p, q = aq_PL.shape[0], bq_QL.shape[0]
    num_experts = plan.offsets_E1.numel() - 1
    dw = torch.empty(num_experts, p, q, device=aq_PL.device, dtype=out_dtype)
    if fp8_ws_supported(aq_PL, out_dtype):
        fp8_wgrad_ws(aq_PL, as_TP, bq_QL, bs_TQ, dw, plan.offsets_E1, block_n, by_size=by_size, b_const=b_const)
        return dw
    WGRAD_FP8[lambda cfg: (num_experts * triton.cdiv(p, cfg["BM"]) * triton.cdiv(q, cfg["BN"]),)](
        a_desc=descriptor(aq_PL), b_desc=descriptor(bq_QL), a_scale_ptr=as_TP, b_scale_ptr=bs_TQ, out_ptr=dw,
        offsets_ptr=plan.offsets_E1, P=p, Q=q, EB=triton.next_power_of_2(num_experts), TILE_M=BLOCK_M,
        B_CONST=b_const, dtype=FP8,
    )
    return dw


def expert_wgrad_and_combine(a_NP, b_NQ, plan: Plan, out_dtype: torch.dtype, slots_ND, topk_idx_TK,
                             combine_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``expert_wgrad(a, b)``, ``combine(slots, topk_idx)``): dW13 and dx's combine. On sm90 with 16-bit operands
    the combine runs inside the weight-gradient kernel, beside its MMAs (``gluon_sm90._wgrad_ws_kernel``), with the
    same sums."""
    if not (a_NP.shape[0] and ws_supported(a_NP) and out_dtype == a_NP.dtype):
        return expert_wgrad(a_NP, b_NQ, plan, out_dtype, gemm="dw13"), combine(slots_ND, topk_idx_TK, combine_dtype)
    dw = torch.empty(plan.offsets_E1.numel() - 1, a_NP.shape[1], b_NQ.shape[1], device=a_NP.device, dtype=out_dtype)
    out = torch.empty(topk_idx_TK.shape[0], slots_ND.shape[1], device=slots_ND.device, dtype=combine_dtype)
    expert_wgrad_ws(a_NP, b_NQ, plan.offsets_E1, dw, combine=(slots_ND, topk_idx_TK, out), gemm="dw13")
    return dw, out
