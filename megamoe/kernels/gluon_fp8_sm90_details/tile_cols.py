"""Rows quantised into tile columns beside a GEMM's MMAs: a side partition of the FP8 sorted-rows and weight-gradient
kernels (``tile_cols=`` of ``gluon_fp8_sm90.fp8_rows_gemm_ws`` and ``fp8_wgrad_ws``) that writes, bit for bit, what
``quant.quantize_tile_cols`` writes for sorted rows read from their tokens' rows (its GATHER form): the FP8 weight
gradients' 128x1 copies of dy and x, made under dx's and dW2's MMAs instead of in passes of their own.

The partition's programs share the (busy plan tile, CB columns) units. A unit's 128 rows come into shared memory by
16-byte ``cp.async`` copies (zeros past the expert's end), the next units' while this one is quantised; then each
column's amax over the tile's rows (a thread's 16 rows at a time, across the lanes where a warp holds fewer than 32
columns), its scale, and its 128 values quantised and stored as the contiguous run that the tile column is. The
quantiser's bytes go to HBM (mostly L2: each token's row is read by its top_k tiles at about the same time) while the
GEMM's MMAs, which they do not feed, keep the tensor cores busy.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from megamoe.kernels.gluon_fp8_sm90_details.common import (
    AMAX_FLOOR,
    fp8_scales,
    quantize_by,
)
from megamoe.kernels.gluon_sm90 import count_busy_tiles

QUANT_ROWS = gl.constexpr(16)  # rows of a column per thread per slice: one 16-byte store


@gluon.constexpr_function
def _copy_layout(cols, num_warps):
    """A unit's rows for the copies: 8 bf16 (16 bytes) per thread, a row's ``cols`` across the lanes."""
    lanes = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _column_layout(cols, num_warps):
    """A unit's columns for the quantisation: QUANT_ROWS rows of one column per thread, the warps across the
    columns (and a column's rows across the lanes where a warp has fewer than 32 columns)."""
    lanes = cols // num_warps
    return gl.BlockedLayout([QUANT_ROWS, 1], [32 // lanes, lanes], [1, num_warps], [0, 1])


@gluon.jit
def _copy_unit(a_ptr, buf, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, u, col_blocks, C, top_k,
               num_warps: gl.constexpr):
    """``cp.async`` copies of unit ``u``'s rows into ``buf`` (TILE_M, CB) bf16: its tile's sorted rows read from their
    tokens' rows of a (T, C), columns of its column block; rows past the expert's end zero-filled."""
    TILE_M: gl.constexpr = buf.type.shape[0]
    CB: gl.constexpr = buf.type.shape[1]
    layout: gl.constexpr = _copy_layout(CB, num_warps)
    ROWS: gl.constexpr = layout.threads_per_warp[0] * num_warps  # rows per issue: one copy per thread
    t = u // col_blocks
    cols = (u % col_blocks) * CB + gl.arange(0, CB, layout=gl.SliceLayout(0, layout))
    e = gl.load(tile_expert_ptr + t)
    row0 = gl.load(tile_row_ptr + t)
    end = gl.load(offsets_ptr + e + 1)
    for r0 in gl.static_range(0, TILE_M, 4 * ROWS):  # four copies per thread per issue
        rows = row0 + r0 + gl.arange(0, 4 * ROWS, layout=gl.SliceLayout(1, layout))
        rmask = rows < end
        tok = (gl.load(row_slot_ptr + rows, mask=rmask, other=0) // top_k).to(gl.int64)
        # C // 16 * 16 = C (a multiple of 128), written so that the compiler sees 16-byte rows (cp.async's width)
        ptrs = a_ptr + tok[:, None] * (C // 16 * 16) + cols[None, :]
        async_copy.async_copy_global_to_shared(buf.slice(r0, 4 * ROWS), ptrs,
                                               mask=rmask[:, None] & (cols >= 0)[None, :])


@gluon.jit
def _quantize_unit(buf, q_ptr, s_ptr, u, col_blocks, C, ld, POW2: gl.constexpr, num_warps: gl.constexpr):
    """Unit ``u``'s block in ``buf`` quantised by column, as ``quant.quantize_groups`` quantises a group: each column's
    amax (floored at AMAX_FLOOR), its scale into s (NT, C) and its values into q (C, NT * TILE_M) (``ld``: q's row
    length), QUANT_ROWS rows of a column per thread at a time."""
    TILE_M: gl.constexpr = buf.type.shape[0]
    CB: gl.constexpr = buf.type.shape[1]
    layout: gl.constexpr = _column_layout(CB, num_warps)
    ROWS: gl.constexpr = QUANT_ROWS * layout.threads_per_warp[0]  # rows per slice
    t = (u // col_blocks).to(gl.int64)
    cols = (u % col_blocks) * CB + gl.arange(0, CB, layout=gl.SliceLayout(0, layout))
    amax = gl.zeros([ROWS, CB], gl.float32, layout)  # each thread's running amax, reduced across the lanes once
    for r0 in gl.static_range(0, TILE_M, ROWS):
        amax = gl.maximum(amax, gl.abs(buf.slice(r0, ROWS).load(layout).to(gl.float32)))
    scale, inv = fp8_scales(gl.maximum(gl.max(amax, axis=0), AMAX_FLOOR), POW2)
    gl.store(s_ptr + t * C + cols, scale)
    col_ptrs = q_ptr + cols.to(gl.int64)[None, :] * ld + t * TILE_M
    for r0 in gl.static_range(0, TILE_M, ROWS):
        k = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        q = quantize_by(buf.slice(r0, ROWS).load(layout).to(gl.float32), inv[None, :])
        gl.store(col_ptrs + k[:, None], q)


@gluon.jit
def tile_cols_partition(a_ptr, q_ptr, s_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, bufs, C, E,
                        top_k, num_tiles, EB: gl.constexpr, POW2: gl.constexpr, num_warps: gl.constexpr):
    """The side partition: a (T, C) bf16 rows' tile columns for the plan (``row_slot``, ``offsets``, ``tile_expert``,
    ``tile_row``; sorted row r read from token row_slot[r] // top_k) into q (C, num_tiles * TILE_M) e4m3 and s
    (num_tiles, C) fp32, the busy tiles' only. ``bufs``: (NBUF, TILE_M, CB) bf16 in shared memory, the unit quantised
    and the next NBUF - 1 units' copies in flight; C a multiple of CB, EB a power of two >= E."""
    NBUF: gl.constexpr = bufs.type.shape[0]
    TILE_M: gl.constexpr = bufs.type.shape[1]
    CB: gl.constexpr = bufs.type.shape[2]
    col_blocks = C // CB
    units = count_busy_tiles(offsets_ptr, E, EB, TILE_M, num_warps) * col_blocks
    ld = num_tiles.to(gl.int64) * TILE_M
    step = gl.num_programs(0)
    for j in gl.static_range(NBUF - 1):  # the first units' copies, one commit group each
        if gl.program_id(0) + j * step < units:
            _copy_unit(a_ptr, bufs.index(j), row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                       gl.program_id(0) + j * step, col_blocks, C, top_k, num_warps)
        async_copy.commit_group()
    for u in range(gl.program_id(0), units, step):
        b = (u // step) % NBUF  # this program's units take the buffers in turn
        if u + (NBUF - 1) * step < units:
            _copy_unit(a_ptr, bufs.index((b + NBUF - 1) % NBUF), row_slot_ptr, offsets_ptr, tile_expert_ptr,
                       tile_row_ptr, u + (NBUF - 1) * step, col_blocks, C, top_k, num_warps)
        async_copy.commit_group()
        async_copy.wait_group(NBUF - 1)  # this unit's copies (the next ones' may still be in flight)
        gl.thread_barrier()  # every thread's copies of the unit landed before any column is read
        _quantize_unit(bufs.index(b), q_ptr, s_ptr, u, col_blocks, C, ld, POW2, num_warps)
        gl.thread_barrier()  # the unit read before its buffer takes another's copies
    async_copy.wait_group(0)
