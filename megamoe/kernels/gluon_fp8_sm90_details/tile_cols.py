"""The tile-column quantiser on sm90 (``gluon_fp8_sm90.fp8_tile_cols_ws``): 16-bit rows, sorted or read from their
tokens, quantised 128x1 per plan tile and column into ``quant.quantize_tile_cols``'s format, bit for bit.

The Triton kernel (``quant._quantize_tile_cols_kernel``) loads a tile's block with each thread's values along a
row, so its column amax crosses warps and its stores (each column's 128 rows, contiguous e4m3 bytes) need the block
turned around through shared memory: with the amax given instead (an experiment, docs/PERFORMANCE.md) it ran 30%
faster. Here a warp holds whole columns: each thread 16 consecutive rows of 8 consecutive columns, 8 lanes down the
128 rows and 4 across 32 columns, the 4 warps across the block's 128 columns. A column's amax is the thread's 16 rows
and three shuffles (no shared memory), and the same registers are written as 8 columns of 16 rows: a warp's store
instruction writes 4 columns' whole 128-byte lines. Measured on an H100: 6-7% faster than the Triton kernel from the
tokens' rows, 2% from sorted rows; its loads read 64 bytes of 8 rows per warp instruction, where the Triton kernel's
read whole rows. (An earlier arrangement, 16 lanes across the columns and the warps down the rows, wrote 32 bytes into
each of 16 columns per instruction and ran 20% slower than the Triton kernel; a persistent variant copying its rows
ahead through a ring of shared memory ran up to 84% slower, held by each item's chain of index loads:
docs/PERFORMANCE.md.)
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from megamoe.kernels.gluon_fp8_sm90_details.common import (
    AMAX_FLOOR,
    fp8_scales,
    quantize_by,
)

# A (128 rows, 128 columns) block over 4 warps. Bases are (row, column) steps: a thread's 8 columns x 16 rows in
# registers, 4 lanes across 32 columns and 8 down the rows, the warps across the columns. The two layouts map every
# value to the same thread and differ only in the order of a thread's registers.
_LANES = [[0, 8], [0, 16], [16, 0], [32, 0], [64, 0]]
_WARPS = [[0, 32], [0, 64]]
_LOAD_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(  # columns first: a row's 8 values, one 16-byte load
    [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [8, 0]], _LANES, _WARPS, [], [128, 128]))
_STORE_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(  # rows first: a column's 16 values, one 16-byte store
    [[1, 0], [2, 0], [4, 0], [8, 0], [0, 1], [0, 2], [0, 4]], _LANES, _WARPS, [], [128, 128]))
TILE_COLS_WARPS = 4


@gluon.jit
def tile_cols_kernel(a_ptr, q_ptr, s_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, row_slot_ptr, C, E,
                     TOP_K: gl.constexpr, POW2: gl.constexpr, num_warps: gl.constexpr):
    """One program per (plan tile, 128 columns): a (N, C) 16-bit sorted rows (TOP_K 0), or (T, C) the tokens' rows
    (sorted row r read from row ``row_slot[r] // TOP_K``); out: q (C, NT * 128) e4m3, column c of tile t's rows at
    [c, 128 t : 128 t + 128], and s (NT, C) fp32. Rows past the tile's expert read as zeros (in no amax, quantised to
    zeros); idle tiles are not written."""
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
        # C // 8 * 8 = C (a multiple of 128), written so that the compiler sees 16-byte rows where Triton has not
        # specialised C as 16-divisible
        a = gl.load(a_ptr + rows.to(gl.int64)[:, None] * (C // 8 * 8) + cols[None, :], mask=rmask[:, None], other=0.0)
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
