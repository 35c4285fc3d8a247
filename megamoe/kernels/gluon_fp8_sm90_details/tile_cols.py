"""The tile-column quantiser on sm90 (``gluon_fp8_sm90.fp8_tile_cols_ws``): rows in 16-bit, sorted or read from
their tokens, quantised 128x1 per plan tile and column into ``quant.quantize_tile_cols``'s format, bit for bit.

The Triton kernel (``quant._quantize_tile_cols_kernel``) loads a tile's block with each thread's values along the
columns (16-byte loads of a row) and stores each column's 128 rows as contiguous e4m3 bytes, so its compiler turns
the block around through shared memory between the two (16 KB, two-byte stores: ~7 instructions per value, three
programs an SM by its 168 registers; docs/PERFORMANCE.md). Here each thread holds 16 consecutive rows of 8
consecutive columns, so that the same registers serve both ends: read as 16 rows of 16 bytes, written as 8 columns
of 16 bytes. The two layouts below map every value to the same thread and differ only in the order of a thread's
registers (columns first for the loads, rows first for the stores): the conversion between them moves no data
between threads.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from megamoe.kernels.gluon_fp8_sm90_details.common import (
    AMAX_FLOOR,
    fp8_scales,
    quantize_by,
)

# A (128 rows, 128 columns) block over 4 warps: a thread's 8 columns x 16 rows in registers, 16 lanes across the
# columns and 2 down the rows, the 4 warps down the rows. Bases are (row, column) steps; the two layouts differ only
# in their registers' order.
_LANES = [[0, 8], [0, 16], [0, 32], [0, 64], [16, 0]]
_WARPS = [[32, 0], [64, 0]]
_LOAD_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(  # columns first: a row's 8 values, one 16-byte load
    [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [8, 0]], _LANES, _WARPS, [], [128, 128]))
_STORE_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(  # rows first: a column's 16 values, one 16-byte store
    [[1, 0], [2, 0], [4, 0], [8, 0], [0, 1], [0, 2], [0, 4]], _LANES, _WARPS, [], [128, 128]))
TILE_COLS_WARPS = 4


@gluon.jit
def tile_cols_kernel(a_ptr, q_ptr, s_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, row_slot_ptr, C, E,
                     TOP_K: gl.constexpr, POW2: gl.constexpr, num_warps: gl.constexpr):
    """One program per (plan tile, 128 columns): a (N, C) 16-bit sorted rows (TOP_K 0), or (T, C) the tokens' rows
    (sorted row r read from row ``row_slot[r] // TOP_K``, a constant divisor: a multiply and a shift); out: q (C, NT * 128) e4m3, column c of tile t's rows
    at [c, 128 t : 128 t + 128], and s (NT, C) fp32. Rows past the tile's expert read as zeros (in no amax,
    quantised to zeros); idle tiles are not written."""
    t = gl.program_id(0)
    e = gl.load(tile_expert_ptr + t)
    if e < E:  # an idle tile: never read
        load_layout: gl.constexpr = _LOAD_LAYOUT
        store_layout: gl.constexpr = _STORE_LAYOUT
        rows = gl.load(tile_row_ptr + t) + gl.arange(0, 128, layout=gl.SliceLayout(1, load_layout))
        rmask = rows < gl.load(offsets_ptr + e + 1)
        if TOP_K:
            rows = gl.load(row_slot_ptr + rows, mask=rmask, other=0) // TOP_K
        col0 = gl.program_id(1) * 128
        cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, load_layout))
        a = gl.load(a_ptr + rows.to(gl.int64)[:, None] * C + cols[None, :], mask=rmask[:, None], other=0.0)
        # the amax in a's dtype (exact), so that a's values stay 16-bit in registers until each is scaled
        amax = gl.max(gl.abs(a), axis=0).to(gl.float32)
        scale, inv = fp8_scales(gl.maximum(amax, AMAX_FLOOR), POW2)
        q = gl.convert_layout(quantize_by(a.to(gl.float32), inv[None, :]), store_layout)
        ld = gl.num_programs(0).to(gl.int64) * 128  # q's row: 128 columns per plan tile
        k = t.to(gl.int64) * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, store_layout))
        q_cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, store_layout))
        gl.store(q_ptr + q_cols.to(gl.int64)[None, :] * ld + k[:, None], q)
        s_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])  # one column a thread
        gl.store(s_ptr + t.to(gl.int64) * C + col0 + gl.arange(0, 128, layout=s_layout),
                 gl.convert_layout(scale, s_layout))
