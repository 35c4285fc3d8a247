"""Blockwise FP8 (e4m3) quantisation, the DeepSeek-V3 recipe: activations scaled per row per 128 columns of
the GEMM's inner dimension (1x128), weights per 128x128 block, fp32 scales.

Formats (every FP8 kernel of the package reads and writes these; ``reference.quantize_rows`` and
``reference.quantize_weight`` compute them in plain PyTorch, bit for bit the same):

* rows: ``q`` (M, K) ``float8_e4m3fn`` and ``s`` (K/128, M) fp32, k-block-major — the value of (m, k) is
  ``q[m, k] * s[k // 128, m]``. Column-major in the row index, so one K-step's scales of a row tile are one
  contiguous load, and an epilogue writing a tile's scales writes them contiguously.
* weights: ``q`` (E, R, C) and ``s`` (E, R/128, C/128) — the value of (e, r, c) is ``q[e, r, c] * s[e, r//128,
  c//128]``; with the transposed copy ``qt`` (E, C, R), ``st`` (E, C/128, R/128) made in the same pass (a 128x128
  block transposes exactly: data and scale grid). Hopper's FP8 MMA takes both operands K-major, so the
  backward's dgrad GEMMs (which reduce over the weight's rows) read the transposed copy.
* tile columns (128x1, the FP8 weight gradients' operands): sorted rows ``a`` (N, C) quantised along the token
  axis in the routing plan's tiles — tile t of expert e covers sorted rows [tile_row[t], min(tile_row[t] + 128,
  offsets[e + 1])), so no group straddles two experts — into ``q`` (C, NT * 128) and ``s`` (NT, C) fp32 (NT: the
  plan's tile count): the value of sorted row tile_row[t] + i, column c is ``q[c, 128 t + i] * s[t, c]``; the
  columns of a tile past its expert's end hold zeros, those of idle tiles are not written. Transposed, so that
  the token axis (the weight-gradient GEMM's K) is contiguous: Hopper's FP8 MMA takes both operands K-major.
  Padded to 128 columns per tile, so that a K-step of 128 is one tile of one expert: its operand blocks come
  whole through TMA with zeros past the expert (no masked step, no shared-memory zeroing), and its scales are
  one row ``s[t]`` per operand. The busy tiles of expert e are t0(e) .. t0(e) + ceil(rows_e / 128) - 1 with
  t0(e) = sum over e' < e of ceil(rows_e' / 128) (``common.busy_tiles`` of e).

One group of 128 values v becomes: ``amax = max(max|v|, AMAX_FLOOR)``, ``inv = 448 / amax`` and ``s = amax /
448`` (both IEEE-rounded divisions), ``q = e4m3(clamp(v * inv, -448, 448))`` rounded to nearest even (a NaN stays
NaN). With power-of-two scales (``env.set_fp8_scales("pow2")``, ``MEGAMOE_FP8_SCALES=pow2``) ``s`` is ``amax / 448``
rounded up to a power of two and ``inv = 1 / s``, both exact (``scale_and_inverse``). D and I must be multiples of 128
(``GROUP``), so no group is partial.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import triton
import triton.language as tl
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from megamoe.env import (
    FP8_WEIGHT_CACHES,
    fp8_pow2_scales,
    fp8_weight_cache_requested,
    interpreting,
)
from megamoe.kernels.gluon_fp8_sm90 import fp8_tile_cols_ws, fp8_ws_supported
from megamoe.kernels.plan import BLOCK_M, Plan

GROUP = 128  # values per scale along a GEMM's inner dimension (and the weights' block edge)
E4M3_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-12)  # an all-zero group gets this amax: its values quantise to exact zeros
FP8 = torch.float8_e4m3fn


# Whether ``to_e4m3`` rounds on the fp32 bits before converting: under Triton's interpreter, which converts
# wrongly where the rounding carries into the exponent (Triton 3.6: 125.3 became 64, not 128). The GPU's own
# conversion (cvt.rn.satfinite.e4m3x2.f32, one instruction per two values) rounds to nearest even, as torch does.
# Fixed at import, as Triton fixes the interpreter when a kernel is defined. The weight quantiser also rounds on the
# bits for fp32 weights: with the GPU's conversion alone its transposed copy of them came out wrong on the H200
# (rows of zeros; docs/FACTS.md), its straight copy and both copies of 16-bit weights right.
BITWISE_E4M3 = tl.constexpr(interpreting())


@triton.jit
def to_e4m3(v, BITWISE: tl.constexpr = BITWISE_E4M3):
    """fp32 ``v`` to e4m3, round to nearest even, values past +-448 saturated to +-448 and NaN kept NaN, exactly as
    torch's conversion of ``v`` clamped to +-448: the GPU's conversion (cvt.rn.satfinite.e4m3x2.f32, which
    saturates), or with BITWISE (``BITWISE_E4M3``) ``v`` clamped (NaN through) and rounded on its fp32 bits first, so
    that the conversion only ever meets e4m3 values and is exact. Both match torch bit for bit (tests/test_fp8.py, on
    the H200 and in the interpreter). (A clamp before the GPU's conversion would change nothing but NaN, which
    ``max.f32`` turns into -448.)"""
    if BITWISE:
        v = tl.clamp(v, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        # Normal e4m3 values keep 3 of fp32's 23 mantissa bits: round the bit pattern to nearest even (a carry moves
        # into the exponent); below 2^-6 (e4m3's subnormals) the grid is 2^-9: round with the 1.5 * 2^23 trick,
        # keeping the zero's sign.
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        sub = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        sub = tl.where(sub == 0.0, v * 0.0, sub)
        v = tl.where(tl.abs(v) < 0.015625, sub, normal)
        # (the interpreter converts NaN to 384: NaN's bits, 0x7F, put in its place)
        nan = tl.full(v.shape, 0x7F, tl.int8).to(tl.float8e4nv, bitcast=True)
        return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, nan, v.to(tl.float8e4nv))
    return v.to(tl.float8e4nv)


@triton.jit
def scale_and_inverse(amax, POW2: tl.constexpr):
    """A group's scale s and the factor inv its values are multiplied by, from its amax (fp32, any shape): s =
    amax / 448 and inv = 448 / amax (IEEE divisions); with POW2, s = amax / 448 rounded up to a power of two (its
    exponent, plus one unless the mantissa is zero) and inv = 1 / s, both exact."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32))
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        return (exponent << 23).to(tl.float32, bitcast=True), ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    return s, tl.math.div_rn(tl.full(amax.shape, E4M3_MAX, tl.float32), amax)


@triton.jit
def quantize_groups(v, POW2: tl.constexpr):
    """(R, 128) fp32 -> e4m3 (R, 128) and the (R,) fp32 scales, one group per row (POW2: ``scale_and_inverse``)."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), AMAX_FLOOR)
    s, inv = scale_and_inverse(amax, POW2)
    return to_e4m3(v * inv[:, None]), s


@triton.jit
def _quantize_rows_kernel(
    a_ptr,  # (M, K) any float dtype
    q_ptr,  # (M, K) e4m3 out
    s_ptr,  # (K / 128, M) fp32 out
    M, K,
    BM: tl.constexpr, POW2: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1)
    cols = kb * 128 + tl.arange(0, 128)
    rmask = rows < M
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]  # int64: M*K overflows int32 at real sizes
    q, s = quantize_groups(tl.load(a_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32), POW2)
    tl.store(q_ptr + offs, q, mask=rmask[:, None])
    tl.store(s_ptr + kb.to(tl.int64) * M + rows, s, mask=rmask)


@triton.jit
def _quantize_weight_kernel(
    w_ptr,  # (E, R, C) any float dtype
    q_ptr,  # (E, R, C) e4m3 out
    s_ptr,  # (E, R / 128, C / 128) fp32 out
    qt_ptr,  # (E, C, R) e4m3 out: the transposed copy
    st_ptr,  # (E, C / 128, R / 128) fp32 out
    R, C,
    SLICE: tl.constexpr, POW2: tl.constexpr, STRAIGHT: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    """One 128x128 block per program, read in slices of SLICE rows twice (its amax, then its values): a whole
    block in registers spilled. Writes the straight copy (q, s) if STRAIGHT, the transposed one (qt, st) if
    TRANSPOSED."""
    e = tl.program_id(0).to(tl.int64)
    rb = tl.program_id(1)
    cb = tl.program_id(2)
    nrb = R // 128
    ncb = C // 128
    c = cb * 128 + tl.arange(0, 128)
    block = w_ptr + e * R * C + rb * 128 * C + tl.arange(0, SLICE)[:, None] * C + c[None, :]
    amax = 0.0
    for i in tl.static_range(128 // SLICE):
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(tl.load(block + i * SLICE * C).to(tl.float32)), axis=1), axis=0))
    s, inv = scale_and_inverse(tl.maximum(amax, AMAX_FLOOR), POW2)
    for i in tl.static_range(128 // SLICE):
        q = to_e4m3(tl.load(block + i * SLICE * C).to(tl.float32) * inv,
                    BITWISE_E4M3 or w_ptr.dtype.element_ty == tl.float32)
        r = rb * 128 + i * SLICE + tl.arange(0, SLICE)
        if STRAIGHT:
            tl.store(q_ptr + e * R * C + r[:, None] * C + c[None, :], q)
        if TRANSPOSED:
            tl.store(qt_ptr + e * R * C + c[None, :] * R + r[:, None], q)
    if STRAIGHT:
        tl.store(s_ptr + (e * nrb + rb) * ncb + cb, s)
    if TRANSPOSED:
        tl.store(st_ptr + (e * ncb + cb) * nrb + rb, s)


@triton.jit
def _tile_block(a_ptr, t, e, offsets_ptr, tile_row_ptr, row_slot_ptr, C, top_k, GATHER: tl.constexpr,
                TILE_M: tl.constexpr, BC: tl.constexpr):
    """Plan tile ``t``'s rows (of expert ``e``) at the program's BC columns, as a (BC, TILE_M) block (rows past the
    expert's end zeros), and those columns; GATHER: sorted row r read from token row_slot[r] // top_k."""
    rows = tl.load(tile_row_ptr + t) + tl.arange(0, TILE_M)
    rmask = rows < tl.load(offsets_ptr + e + 1)
    if GATHER:
        rows = tl.load(row_slot_ptr + rows, mask=rmask, other=0) // top_k
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    # int64: N * C and C * NT * 128 overflow int32 at real sizes
    return tl.load(a_ptr + rows.to(tl.int64)[None, :] * C + cols[:, None], mask=rmask[None, :], other=0.0), cols


@triton.jit
def _expert_amax_kernel(
    a_ptr,  # (N, C) sorted rows, or with GATHER (T, C) the tokens' rows; any float dtype
    amax_bits_ptr,  # (E, C) int32, zeros in: the bits of each expert's largest magnitude (fp32) of each column
    offsets_ptr, tile_expert_ptr, tile_row_ptr, row_slot_ptr, C, E, top_k,
    GATHER: tl.constexpr, TILE_M: tl.constexpr, BC: tl.constexpr,
):
    """One (plan tile, BC columns) per program, read as ``_quantize_tile_cols_kernel`` reads them: the tile's column
    amax, taken into its expert's by an atomic max (max is exact and commutative: the same result in any order; a
    NaN stays NaN)."""
    t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + t)
    if e >= E:  # an idle tile: never read
        return
    a, cols = _tile_block(a_ptr, t, e, offsets_ptr, tile_row_ptr, row_slot_ptr, C, top_k, GATHER, TILE_M, BC)
    mag = tl.abs(a.to(tl.float32))
    # tl.max may drop a NaN; the sum of a column's NaNs (their bits above +inf's; 0 without one) puts it back and adds
    # nothing else (a custom NaN-keeping reduce ran ~150x slower in the interpreter)
    nans = tl.where(mag.to(tl.int32, bitcast=True) > 0x7F800000, mag, 0.0)
    amax = tl.abs(tl.max(mag, 1) + tl.sum(nans, 1))  # >= 0, or a NaN with its sign bit clear
    # on the bits as int32: non-negative floats (a NaN's above +inf) order as their bits do, the same on the GPU and in
    # the interpreter (a float atomic max need not keep a NaN)
    tl.atomic_max(amax_bits_ptr + e.to(tl.int64) * C + cols, amax.to(tl.int32, bitcast=True))


@triton.jit
def _quantize_tile_cols_kernel(
    a_ptr,  # (N, C) sorted rows, or with GATHER (T, C) the tokens' rows; any float dtype
    q_ptr,  # (C, NT * 128) e4m3 out: column c of tile t's rows at [c, 128 t : 128 t + 128]
    s_ptr,  # (NT, C) fp32 out
    offsets_ptr, tile_expert_ptr, tile_row_ptr,
    row_slot_ptr,  # (N,) with GATHER: each sorted row's slot (token * top_k + k)
    amax_ptr,  # with GIVEN_AMAX: (E, C) fp32, each expert's amax of each column (row stride amax_stride, 0: one row)
    C, E, top_k, amax_stride,
    GATHER: tl.constexpr, GIVEN_AMAX: tl.constexpr, TILE_M: tl.constexpr, BC: tl.constexpr, POW2: tl.constexpr,
):
    """One (plan tile, BC columns) per program: the tile's rows read as a (BC, TILE_M) block (rows past its
    expert's end as zeros: they count in no amax and quantise to zeros), so that each column's group is a row of
    the block (``quantize_groups``) and the block is stored as it lies in the transposed ``q``. GATHER: sorted row r
    read from token row_slot[r] // top_k. GIVEN_AMAX: each column's scale from the tile's expert's amax of it, not
    from the tile's rows."""
    t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + t)
    if e >= E:  # an idle tile: never read
        return
    a, cols = _tile_block(a_ptr, t, e, offsets_ptr, tile_row_ptr, row_slot_ptr, C, top_k, GATHER, TILE_M, BC)
    if GIVEN_AMAX:
        s, inv = scale_and_inverse(tl.maximum(tl.load(amax_ptr + e * amax_stride + cols), AMAX_FLOOR), POW2)
        q = to_e4m3(a.to(tl.float32) * inv[:, None])
    else:
        q, s = quantize_groups(a.to(tl.float32), POW2)
    ld = tl.num_programs(0).to(tl.int64) * TILE_M  # q's row: TILE_M columns per plan tile, one program row each
    tl.store(q_ptr + cols.to(tl.int64)[:, None] * ld + t * TILE_M + tl.arange(0, TILE_M)[None, :], q)
    tl.store(s_ptr + t.to(tl.int64) * C + cols, s)


# Rows of a weight block in registers at once (the whole 128 x 128 block spilled), and the row quantiser's rows per
# program (its launcher's block; both also for the ahead-of-time compile check, ``tools.resources``).
WEIGHT_SLICE, ROWS_BM = 32, 32
# Columns per program of the tile-column quantiser: a (128, 128) fp32 block, 128 registers per thread at 4 warps (151
# in all, no spills). Measured on the H200 against 64 columns (docs/PERFORMANCE.md): the gathered (N, D) copies (x's
# and dy's) 10% faster, the others level; 8 warps were 25-35% slower at either width.
TILE_COLS_BC = 128
# The tile-column quantiser of bf16 rows on sm90 in Gluon (``gluon_fp8_sm90.fp8_tile_cols_ws``: a warp holds whole
# columns, so neither the amax nor the stores go through shared memory; the same bits). Measured on an H100 against
# the Triton kernel (``python -m tools.fp8``, its rows "(Triton)", docs/PERFORMANCE.md): from the tokens' rows (x's and
# dy's copies) 6-7% faster at both layers, sorted rows 2%.
TILE_COLS_GLUON = True
KERNELS = (_quantize_rows_kernel, _quantize_weight_kernel, _quantize_tile_cols_kernel, _expert_amax_kernel)


def check_fp8_dims(dim: int, inter: int) -> None:
    """``ValueError`` unless D and I are multiples of 128, which every FP8 group and block needs."""
    if dim % GROUP or inter % GROUP:
        raise ValueError(f"precision='fp8' needs D and I to be multiples of {GROUP} (1x128 / 128x128 scale blocks); "
                         f"got D={dim}, I={inter}. Use precision='bf16' for this layer")


def quantize_rows(a_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (M, K) e4m3, s (K/128, M) fp32): ``a``'s rows in 1x128 groups; K a multiple of 128, ``a`` contiguous."""
    num_rows, k = a_MK.shape
    q = torch.empty(num_rows, k, device=a_MK.device, dtype=FP8)
    s = torch.empty(k // GROUP, num_rows, device=a_MK.device, dtype=torch.float32)
    if num_rows:
        _quantize_rows_kernel[(triton.cdiv(num_rows, ROWS_BM), k // GROUP)](
            a_ptr=a_MK, q_ptr=q, s_ptr=s, M=num_rows, K=k, BM=ROWS_BM, POW2=fp8_pow2_scales(), num_warps=4)
    return q, s


def tile_cols_outputs(cols: int, plan: Plan, device, over: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """Empty tile-column operands of ``cols`` columns for ``plan``: q (cols, NT * 128) e4m3 and s (NT, cols) fp32.
    ``over``: a contiguous tensor whose memory they take where it is large enough (the caller reads it no more),
    else new memory."""
    num_tiles = plan.tile_expert_NT.numel()
    q_bytes, s_bytes = cols * num_tiles * BLOCK_M, num_tiles * cols * 4  # q_bytes: a multiple of 128
    if over is not None and over.is_contiguous() and over.numel() * over.element_size() >= q_bytes + s_bytes:
        raw = over.view(-1).view(torch.uint8)
        return (raw[:q_bytes].view(FP8).view(cols, num_tiles * BLOCK_M),
                raw[q_bytes:q_bytes + s_bytes].view(torch.float32).view(num_tiles, cols))
    return (torch.empty(cols, num_tiles * BLOCK_M, device=device, dtype=FP8),
            torch.empty(num_tiles, cols, device=device, dtype=torch.float32))


def quantize_tile_cols(a_NC: torch.Tensor, plan: Plan, top_k: int | None = None,
                       over: torch.Tensor | None = None, gluon: bool | None = None,
                       col_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (C, NT * 128) e4m3, s (NT, C) fp32): ``a``'s sorted rows in 128x1 groups, one per plan tile and column
    (the tile-column format above; NT = the plan's tile count, a static bound, so no host sync). C a multiple of
    ``TILE_COLS_BC``, ``a`` contiguous; rows past the routed count are not read. ``top_k``: ``a`` holds the tokens'
    rows (T, C) instead, and each sorted row is read from its token (``row_slot[r] // top_k``), so that no sorted
    copy of them is needed. ``over``: memory to write them into where it is large enough (``tile_cols_outputs``).
    ``gluon`` (None: ``TILE_COLS_GLUON``): on sm90 with bf16 rows the Gluon kernel, the same bits (not with
    ``col_amax``: the Triton kernel takes it). ``col_amax``: each column's amax over more rows than a tile's, (C,) over
    all of them (``channel_amax``) or (E, C) per expert, fp32 and contiguous: every tile's scales are then its
    expert's (the same in all its tiles), ``amax / 448`` as the recipe's groups take theirs, and the rows must lie
    within it (larger values saturate)."""
    num_tiles = plan.tile_expert_NT.numel()
    num_experts = plan.offsets_E1.numel() - 1
    cols = a_NC.shape[1]
    if cols % TILE_COLS_BC:
        raise ValueError(f"quantize_tile_cols needs a multiple of {TILE_COLS_BC} columns, got {cols}")
    if col_amax is not None:
        assert col_amax.dtype == torch.float32 and col_amax.is_contiguous()
        assert col_amax.shape in ((cols,), (num_experts, cols)), col_amax.shape
    q, s = tile_cols_outputs(cols, plan, a_NC.device, over)
    if col_amax is None and (TILE_COLS_GLUON if gluon is None else gluon) and fp8_ws_supported(a_NC, a_NC.dtype):
        fp8_tile_cols_ws(a_NC, plan, top_k, q, s)
        return q, s
    _quantize_tile_cols_kernel[(num_tiles, cols // TILE_COLS_BC)](
        a_ptr=a_NC, q_ptr=q, s_ptr=s, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, row_slot_ptr=plan.row_slot_N,
        amax_ptr=s if col_amax is None else col_amax, C=cols, E=num_experts, top_k=top_k or 1,
        amax_stride=0 if col_amax is None or col_amax.dim() == 1 else cols, GATHER=top_k is not None,
        GIVEN_AMAX=col_amax is not None, TILE_M=BLOCK_M, BC=TILE_COLS_BC, POW2=fp8_pow2_scales(), num_warps=4)
    return q, s


def expert_channel_amax(a_NC: torch.Tensor, plan: Plan, top_k: int | None = None) -> torch.Tensor:
    """(E, C) fp32: each expert's largest magnitude of each column over its sorted rows of ``a`` (zeros for an expert
    without rows; a NaN stays NaN), read as ``quantize_tile_cols`` reads them (``top_k``: ``a`` holds the tokens' rows):
    the ``col_amax`` that gives each expert one scale per column. One pass over the rows (no host sync)."""
    num_experts = plan.offsets_E1.numel() - 1
    cols = a_NC.shape[1]
    if cols % TILE_COLS_BC:
        raise ValueError(f"expert_channel_amax needs a multiple of {TILE_COLS_BC} columns, got {cols}")
    amax = torch.zeros(num_experts, cols, device=a_NC.device, dtype=torch.int32)  # fp32 bits: 0.0
    _expert_amax_kernel[(plan.tile_expert_NT.numel(), cols // TILE_COLS_BC)](
        a_ptr=a_NC, amax_bits_ptr=amax, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, row_slot_ptr=plan.row_slot_N, C=cols, E=num_experts, top_k=top_k or 1,
        GATHER=top_k is not None, TILE_M=BLOCK_M, BC=TILE_COLS_BC, num_warps=4)
    return amax.view(torch.float32)


def x_scales_amax(x_scales: str, a_NC: torch.Tensor, plan: Plan, top_k: int | None = None) -> torch.Tensor | None:
    """The ``col_amax`` that ``quantize_tile_cols`` takes for x's scales ``x_scales`` (``autograd.FP8_WGRAD_X_SCALES``):
    None for "tile" (the recipe's, from each tile's rows), ``channel_amax`` for "layer", ``expert_channel_amax`` for
    "expert" (``a`` and ``top_k`` as ``quantize_tile_cols`` takes them)."""
    if x_scales == "layer":
        return channel_amax(a_NC)
    if x_scales == "expert":
        return expert_channel_amax(a_NC, plan, top_k)
    return None


def channel_amax(a_TC: torch.Tensor) -> torch.Tensor:
    """(C,) fp32: each column's largest magnitude over all of ``a``'s rows (zeros without rows; a NaN stays NaN), the
    ``col_amax`` of ``quantize_tile_cols`` that gives every expert one scale per column from the layer's rows."""
    if a_TC.shape[0] == 0:
        return a_TC.new_zeros(a_TC.shape[1], dtype=torch.float32)
    # one reduction pass over ``a`` (``a.abs().amax(0)`` writes and reads back the magnitudes first: 3x the bytes)
    return torch.linalg.vector_norm(a_TC, ord=float("inf"), dim=0).float()


WeightCopies = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def quantize_weight(w_ERC: torch.Tensor, straight: bool = True, transposed: bool = True, *,
                    stream: torch.cuda.Stream | None = None) -> WeightCopies:
    """(q (E, R, C), s (E, R/128, C/128), qt (E, C, R), st (E, C/128, R/128)): ``w`` in 128x128 blocks and its
    transpose, from one read of ``w``; R and C multiples of 128, ``w`` contiguous. ``straight`` / ``transposed``
    False: that copy is not made (None in its places). ``stream``: the CUDA stream the quantisation runs on (the
    current one by default); the copies are allocated on the current stream either way, from its pool, and a caller
    that passes another stream orders the two."""
    if not (straight or transposed):
        raise ValueError("quantize_weight: ask for the straight copy, the transposed one or both")
    num_experts, r, c = w_ERC.shape

    def copy(rows: int, cols: int, made: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not made:
            return None, None
        return (torch.empty(num_experts, rows, cols, device=w_ERC.device, dtype=FP8),
                torch.empty(num_experts, rows // GROUP, cols // GROUP, device=w_ERC.device, dtype=torch.float32))

    q, s = copy(r, c, straight)
    qt, st = copy(c, r, transposed)
    # a copy not made gets the other's pointers, never written (the kernel's flags)
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        _quantize_weight_kernel[(num_experts, r // GROUP, c // GROUP)](
            w_ptr=w_ERC, q_ptr=q if straight else qt, s_ptr=s if straight else st, qt_ptr=qt if transposed else q,
            st_ptr=st if transposed else s, R=r, C=c, SLICE=WEIGHT_SLICE, POW2=fp8_pow2_scales(), STRAIGHT=straight,
            TRANSPOSED=transposed, num_warps=8)
    return q, s, qt, st


# The FP8 copies of the expert weights, per weight (under the "step" and "ahead" policies): made once and reused for
# as long as the weights do not change — every micro-batch's forward and backward of one optimizer step. Keyed on the
# weight's storage and geometry, not on the tensor object: the backward may meet an alias of the parameter (a
# checkpointed region's saved tensors unpack as new tensor objects on the same storage and version counter), which
# must hit the forward's copies. An entry: (a weak reference to the weight, its state when quantised, the copies, and
# under "ahead" the CUDA event that marks them made on the side stream, else None).
_weight_cache: dict[tuple, tuple[weakref.ref, tuple[int, bool], tuple[torch.Tensor, ...], object]] = {}
_weight_cache_policy = fp8_weight_cache_requested()
# Under "ahead": the keys of the weights whose copies were asked for since their last ones were made ahead, which an
# optimizer step's post-hook quantises again (those the optimizer holds); and the side stream per device that does it.
_quantised: set[tuple] = set()
_ahead_streams: dict[torch.device, torch.cuda.Stream] = {}


def set_fp8_weight_cache(policy: str) -> None:
    """How long the expert weights' FP8 copies live, from now on (:func:`fp8_weight`): ``"step"`` (the default) keeps
    each weight's copies until the weight changes (an in-place update, or any ``torch.optim`` optimizer's step): one
    quantisation per weight and optimizer step, however many micro-batches and recomputes meet it, but every layer's
    copies alive at once, from the layer's first forward of a step until the next optimizer step (2 bytes per expert
    weight element, the two orientations, plus scales; under FSDP2, of the gathered weights, which FSDP's reshard does
    not free). ``"ahead"``: as ``"step"``, but right after an optimizer step the copies of each weight used since its
    last copies were made are made again, on a CUDA stream of their own, so that the quantisation can run beside the
    next forward's first layers instead of in front of each layer's experts; only for weights that the optimizer
    itself updated (a parameter it holds, or an alias: not FSDP2's gathered weights, whose copies are made at first
    use, as under ``"step"``); every layer's copies are then held from the step on. (Every optimizer's step drops
    every copy before it runs, so with several optimizers only the copies made after the last one's step survive, and
    the next forward makes the rest.) ``"call"`` keeps none: each forward makes the straight copies it reads and each
    backward the transposed ones (and, without saved products, w13's straight copy again), freed when the call ends.
    Also set at import by ``MEGAMOE_FP8_WEIGHT_CACHE``. Setting ``"call"`` drops every cached copy."""
    global _weight_cache_policy
    if policy not in FP8_WEIGHT_CACHES:
        raise ValueError(f"the FP8 weight cache policy must be one of {FP8_WEIGHT_CACHES}, got {policy!r}")
    _weight_cache_policy = policy
    if policy != "ahead":
        _quantised.clear()
    if policy == "call":
        clear_weight_cache()


def fp8_weight_cache() -> str:
    """The policy of the expert weights' FP8 copies (:func:`set_fp8_weight_cache`)."""
    return _weight_cache_policy


def _drop_stale_copies(*_) -> None:
    clear_weight_cache()


def _make_copies_ahead(optimizer, *_) -> None:
    make_weight_copies_ahead(p for group in optimizer.param_groups for p in group["params"])


# An optimizer's step makes every cached copy stale: the version counter alone misses weights whose storage is written
# behind it (FSDP2 all-gathers into the unsharded parameters and preserves their version counters). Dropped before the
# step runs, so that the stale copies' memory is free for the optimizer's own; under "ahead" made again after it.
register_optimizer_step_pre_hook(_drop_stale_copies)
register_optimizer_step_post_hook(_make_copies_ahead)


def _cache_key(w: torch.Tensor) -> tuple:
    return (w.untyped_storage()._cdata, w.storage_offset(), tuple(w.shape), w.stride(), w.dtype, w.device)


def _cache(key: tuple, w: torch.Tensor, copies: WeightCopies, made=None) -> None:
    """Holds ``copies`` of ``w`` under ``key`` (``made``: the event after which they may be read, or None)."""

    def drop(ref):  # when ``w`` dies, its entry goes (unless a later tensor's entry has taken the key)
        if key in _weight_cache and _weight_cache[key][0] is ref:
            del _weight_cache[key]

    _weight_cache[key] = (weakref.ref(w, drop), (w._version, fp8_pow2_scales()), copies, made)


def make_weight_copies_ahead(params) -> None:
    """Under the ``"ahead"`` policy, what an optimizer step's post-hook does: for each of ``params`` whose copies
    were asked for since its last ones were made here (through it or an alias of it: the same storage and geometry),
    makes them on a side CUDA stream after the work queued so far (on CPU, at once), cached as :func:`fp8_weight`
    would cache them; each :func:`fp8_weight` that hits them waits for them on its own stream. Parameters that are
    tensor subclasses (FSDP2's DTensor shards) are never what the layers read: skipped."""
    if _weight_cache_policy != "ahead" or not _quantised:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # a captured step caches nothing (fp8_weight): its copies are made at first use
    for p in params:
        key = _cache_key(p) if type(p.detach()) is torch.Tensor else None
        if key not in _quantised:
            continue
        _quantised.discard(key)  # (the others stay for another optimizer's step)
        if p.is_cuda:
            main = torch.cuda.current_stream(p.device)
            side = _ahead_streams.setdefault(p.device, torch.cuda.Stream(p.device))
            side.wait_stream(main)  # after the optimizer's update of p
            # Allocated on the main stream, where they are read and freed: from the side stream's own pool, each
            # step's copies would need fresh device memory while the last step's, freed on the main stream, wait
            # in the main pool (cudaMalloc in every step, and frees that synchronise the device once memory runs
            # short). Written on the side stream: recorded there, so their memory is not reused before that ends.
            copies = quantize_weight(p, stream=side)
            for t in copies:
                t.record_stream(side)
            made = torch.cuda.Event()
            made.record(side)
            _cache(key, p, copies, made)
        else:
            _cache(key, p, quantize_weight(p))


def fp8_weight(w: torch.Tensor, *, straight: bool = True, transposed: bool = True) -> WeightCopies:
    """``quantize_weight(w)``, cached under the ``"step"`` and ``"ahead"`` policies (:func:`set_fp8_weight_cache`): a
    hit needs the tensor the copies were made from, or an alias of it (the same storage, offset, shape and strides), at
    the same version (an in-place update bumps it; aliases share the counter), with no optimizer step in between
    (every copy is dropped at a step; under ``"ahead"`` the step makes them again) and the same kind of scales
    (``env.set_fp8_scales``). The entry lives as long as the tensor it was made from; a storage address is trusted only
    while that tensor still holds the storage (so a new storage at a freed one's address never hits). A cached entry
    holds both copies, whatever the call asks for. Under the ``"call"`` policy, and inside a CUDA-graph capture (a
    replay after the weights changed would read stale copies: the quantisation is captured with the step), nothing
    is cached and only the copies asked for are made (``straight``, ``transposed``: ``quantize_weight``'s). Weights
    written behind autograd's back (through ``.data``), or by an optimizer that is not a ``torch.optim`` one (FSDP2
    gathers updated weights into the same storage at the same version), need :func:`clear_weight_cache`."""
    if _weight_cache_policy == "call" or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return quantize_weight(w, straight, transposed)
    key = _cache_key(w)
    if _weight_cache_policy == "ahead":
        _quantised.add(key)
    hit = _weight_cache.get(key)
    if hit is not None and hit[1] == (w._version, fp8_pow2_scales()):
        owner = hit[0]()
        if owner is not None and owner.untyped_storage()._cdata == key[0]:
            if hit[3] is not None:  # made ahead on the side stream
                torch.cuda.current_stream(w.device).wait_event(hit[3])
            return hit[2]
    copies = quantize_weight(w)
    _cache(key, w, copies)
    return copies


def weight_copies_bytes(w: torch.Tensor) -> int:
    """The bytes of ``w``'s FP8 copies as :func:`quantize_weight` makes both (one byte per element each, and an fp32
    scale per 128x128 block each): what the ``"step"`` policy holds per weight through a step. ``w`` (E, R, C), or
    an FSDP2 parameter: its gathered size."""
    return 2 * w.numel() + 2 * 4 * w.numel() // GROUP**2


def clear_weight_cache() -> None:
    """Drop every cached FP8 weight copy (they are remade at the next use)."""
    for _, _, copies, made in _weight_cache.values():
        if made is not None:  # copies being made ahead: their stream's work done before anything reuses their memory
            torch.cuda.current_stream(copies[0].device).wait_event(made)
    _weight_cache.clear()
