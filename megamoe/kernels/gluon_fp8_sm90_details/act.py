"""The FP8 weight gradients' act step (``gluon_fp8_sm90.fp8_act_tile_cols_ws``): the SwiGLU backward on the saved
gate and up products, writing dz quantised 1x128 (the dx GEMM's operand) and dz and h·w quantised 128x1 into tile
columns (the weight-gradient GEMMs' operands), with neither written to memory in bf16. Every quantisation is of the
values rounded to bf16, as dz and h·w would be written.

A 128x1 group spans a plan tile's 128 rows, so a program owns a whole tile (and 128 columns of I: whole 1x128
groups of dg and du). Its first pass computes the values once, in blocks of rows, and keeps them in bf16 in shared
memory (96 KB: two programs per SM) while it takes each column's amax; the second quantises them from there. (The
Triton kernel, which has no shared memory to keep them in, computed everything twice, its second pass reading the
products again: 1.7× slower than the act step and two quantiser passes, docs/PERFORMANCE.md.) The values are
rounded to bf16 before their quantisation, and their columns' amax is that of the rounded values (taken before the
rounding, then rounded: the same number), so the bytes are those of the act step writing dz and h·w in bf16 followed
by ``quant.quantize_tile_cols`` on them.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from megamoe.kernels.gluon_fp8_sm90_details.common import (
    AMAX_FLOOR,
    fp8_scales,
    quantize_by,
)
from megamoe.kernels.gluon_sm90 import row_segments


@gluon.jit
def _load_rows(preact_ptr, dh_ptr, weights_ptr, row_slot_ptr, rows, rmask, cols, I):
    """Sorted rows ``rows`` (masked: zeros) of g, u and dh' at columns ``cols`` of I, in the products' dtype, and the
    rows' slots and routing weights."""
    slots = gl.load(row_slot_ptr + rows, mask=rmask, other=0).to(gl.int64)
    offs = rows[:, None].to(gl.int64) * 2 * I + cols[None, :]
    g = gl.load(preact_ptr + offs, mask=rmask[:, None], other=0.0)
    u = gl.load(preact_ptr + offs + I, mask=rmask[:, None], other=0.0)
    d = gl.load(dh_ptr + rows[:, None].to(gl.int64) * I + cols[None, :], mask=rmask[:, None], other=0.0)
    return slots, gl.load(weights_ptr + slots, mask=rmask, other=0.0), g, u, d


@gluon.jit
def swiglu_grads(gf, uf, df, wt):
    """The SwiGLU backward of a block in fp32, as ``expert_bwd._swiglu_bwd_values`` computes it, from the gate and up
    products g and u, dh' (``df``) and the rows' routing weights ``wt``: (dg, du, h·w, dh'·h), dg and du with the
    routing weight applied."""
    sig = 1.0 / (1.0 + gl.exp(-gf))
    silu = gf * sig
    h = silu * uf
    dhw = df * wt[:, None]
    du = dhw * silu
    dg = dhw * uf * (sig + silu * (1.0 - sig))
    return dg, du, h * wt[:, None], df * h


@gluon.jit
def _store_dz_rows(v, rows, rmask, col0, group, dzq_ptr, dzs_ptr, N, I, POW2: gl.constexpr):
    """dg's or du's block (its values rounded to bf16) quantised 1x128 (one group per row) into dzq (N, 2I) at columns
    col0 .. and its scales into dzs (2I / 128, N) at ``group``."""
    scale, inv = fp8_scales(gl.maximum(gl.max(gl.abs(v), axis=1), AMAX_FLOOR), POW2)
    cols = col0 + gl.arange(0, v.type.shape[1], layout=gl.SliceLayout(0, v.type.layout))
    q = quantize_by(v, inv[:, None])
    gl.store(dzq_ptr + rows[:, None].to(gl.int64) * 2 * I + cols[None, :], q, mask=rmask[:, None])
    gl.store(dzs_ptr + group * N + rows, scale, mask=rmask)


@gluon.jit
def scales_of_rounded(amax, POW2: gl.constexpr):
    """The scales and factors (``fp8_scales``) of FP8 groups of values rounded to bf16, from the groups' amax before the
    rounding (fp32): rounded, it is the amax of the rounded values (rounding to nearest is monotone and odd)."""
    return fp8_scales(gl.maximum(amax.to(gl.bfloat16).to(gl.float32), AMAX_FLOOR), POW2)


@gluon.jit
def _store_tile_cols(buf, inv, q_ptr, ld, col0, k0, blocks, t_layout: gl.constexpr):
    """The first ``blocks`` blocks of ``buf`` ([blocks, rows, 128] bf16 in shared memory) quantised by column
    (``inv``: each column's factor) into the tile columns q at rows col0 .. and columns k0 .. (``ld``: q's row
    length), each block read straight in ``t_layout`` (a column's rows contiguous per thread, as q holds them: 3%
    faster than reading rows and converting the e4m3 block, docs/PERFORMANCE.md); then zeros up to column k0 + 127
    of q (the tile's rows past its expert's end)."""
    BMB: gl.constexpr = buf.type.shape[1]
    TILE_M: gl.constexpr = buf.type.shape[0] * BMB
    cols = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, t_layout)).to(gl.int64)
    inv = gl.convert_layout(inv, gl.SliceLayout(0, t_layout))
    for b in range(blocks):
        v = buf.index(b).load(t_layout).to(gl.float32)
        q = quantize_by(v, inv[None, :])
        k = k0 + b * BMB + gl.arange(0, BMB, layout=gl.SliceLayout(1, t_layout))
        gl.store(q_ptr + cols[None, :] * ld + k[:, None], q)
    zeros = gl.zeros([BMB, 128], gl.float8e4nv, t_layout)
    for r0 in range(blocks * BMB, TILE_M, BMB):
        k = k0 + r0 + gl.arange(0, BMB, layout=gl.SliceLayout(1, t_layout))
        gl.store(q_ptr + cols[None, :] * ld + k[:, None], zeros)


@gluon.jit
def act_tile_cols_kernel(preact_ptr, dh_ptr, weights_ptr, dweight_part_ptr, row_slot_ptr, offsets_ptr,
                         tile_expert_ptr, tile_row_ptr, dzq_ptr, dzs_ptr, dzt_ptr, dzts_ptr, hwt_ptr, hwts_ptr, N, I, E,
                         TILE_M: gl.constexpr, BM: gl.constexpr, PART_COLS: gl.constexpr, POW2: gl.constexpr,
                         num_warps: gl.constexpr):
    """One program per (plan tile, 128 columns of I). preact (N, 2I) bf16 [g | u] and dh' (N, I) bf16 in sorted
    rows, weights (N,) fp32 by slot; out: the d(routing weight) partials (I / PART_COLS, N) fp32 by slot, dz 1x128
    into dzq (N, 2I) e4m3 and dzs (2I / 128, N) fp32, and dz's and h·w's tile columns into dzt (2I, NT * TILE_M) /
    dzts (NT, 2I) and hwt (I, NT * TILE_M) / hwts (NT, I) (``quant``'s 128x1 format; idle tiles not written). The
    first pass runs the tile's rows in blocks of BM, each block's loads issued before the previous one's values are
    computed, none past the tile's last block; the second reads them back in blocks of RB rows, each thread BM rows
    of two columns, two lanes down a column (at BM = 16 a column's rows one 16-byte run per thread, the runs of a
    column's two lanes one 32-byte piece of q)."""
    t = gl.program_id(0)
    pid_n = gl.program_id(1)
    e = gl.load(tile_expert_ptr + t)
    if e < E:  # an idle tile: never read
        layout: gl.constexpr = row_segments(128, 2, num_warps)  # a block of BM rows: 8 bf16 per thread and row
        # the second pass's blocks: BM rows of two columns per thread, two lanes down a column, four warps across the
        # 128 columns. A column's 32-byte piece of q is written by one instruction; with one lane to a column (16-byte
        # pieces) the kernel was 15-20% slower, `ldmatrix` reads or not, and TMA stores of whole lines were level
        # (docs/PERFORMANCE.md).
        t_layout: gl.constexpr = gl.BlockedLayout([BM, 2], [2, 16], [num_warps // 4, 4], [0, 1])
        RB: gl.constexpr = 2 * BM * (num_warps // 4)  # rows of a second-pass block
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, layout)
        buf_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # unswizzled rows (2-D order: per block)
        NB: gl.constexpr = TILE_M // BM
        dg_buf = gl.allocate_shared_memory(gl.bfloat16, [NB, BM, 128], buf_layout)
        du_buf = gl.allocate_shared_memory(gl.bfloat16, [NB, BM, 128], buf_layout)
        hw_buf = gl.allocate_shared_memory(gl.bfloat16, [NB, BM, 128], buf_layout)
        row0 = gl.load(tile_row_ptr + t)
        row_end = gl.load(offsets_ptr + e + 1)
        blocks = gl.cdiv(gl.minimum(row_end - row0, TILE_M), RB)  # the second pass's; the first runs RB / BM as many
        col0 = pid_n * 128
        cols = col0 + gl.arange(0, 128, layout=col_layout)
        amax_g = gl.zeros([BM, 128], gl.float32, layout)
        amax_u = gl.zeros([BM, 128], gl.float32, layout)
        amax_hw = gl.zeros([BM, 128], gl.float32, layout)
        # the rows of this tile that the first pass runs (of its expert, in whole blocks): loads past them are masked
        row_stop = gl.minimum(row_end, row0 + RB * blocks)
        rows = row0 + gl.arange(0, BM, layout=row_layout)
        slots, wt, g, u, d = _load_rows(preact_ptr, dh_ptr, weights_ptr, row_slot_ptr, rows, rows < row_stop, cols, I)
        for b in range(RB // BM * blocks):
            rmask = rows < row_stop
            next_rows = rows + BM
            next_slots, next_wt, next_g, next_u, next_d = _load_rows(preact_ptr, dh_ptr, weights_ptr, row_slot_ptr,
                                                                     next_rows, next_rows < row_stop, cols, I)
            dg, du, hw, dwh = swiglu_grads(g.to(gl.float32), u.to(gl.float32), d.to(gl.float32), wt)
            # as expert_bwd._store_dweight_parts: each PART_COLS columns' sums, one reduction for them all
            parts = gl.sum(gl.reshape(dwh, [BM, 128 // PART_COLS, PART_COLS]), axis=2)
            part_layout: gl.constexpr = parts.type.layout
            part_rows = pid_n * (128 // PART_COLS) + gl.arange(0, 128 // PART_COLS,
                                                                layout=gl.SliceLayout(0, part_layout))
            part_slots = gl.convert_layout(slots, gl.SliceLayout(1, part_layout))
            part_mask = gl.convert_layout(rmask, gl.SliceLayout(1, part_layout))
            gl.store(dweight_part_ptr + part_rows[None, :].to(gl.int64) * N + part_slots[:, None], parts,
                     mask=part_mask[:, None])
            dg_b = dg.to(gl.bfloat16)
            du_b = du.to(gl.bfloat16)
            _store_dz_rows(dg_b.to(gl.float32), rows, rmask, col0, pid_n, dzq_ptr, dzs_ptr, N, I, POW2)
            _store_dz_rows(du_b.to(gl.float32), rows, rmask, I + col0, I // 128 + pid_n, dzq_ptr, dzs_ptr, N, I, POW2)
            hw_b = hw.to(gl.bfloat16)
            dg_buf.index(b).store(dg_b)
            du_buf.index(b).store(du_b)
            hw_buf.index(b).store(hw_b)
            # the amax of the values before their rounding to bf16: rounded, it is theirs after it (rounding to
            # nearest is monotone and odd), with no conversion back per value
            amax_g = gl.maximum(amax_g, gl.abs(dg))
            amax_u = gl.maximum(amax_u, gl.abs(du))
            amax_hw = gl.maximum(amax_hw, gl.abs(hw))
            rows, slots, wt, g, u, d = next_rows, next_slots, next_wt, next_g, next_u, next_d
        s_g, inv_g = scales_of_rounded(gl.max(amax_g, axis=0), POW2)
        s_u, inv_u = scales_of_rounded(gl.max(amax_u, axis=0), POW2)
        s_hw, inv_hw = scales_of_rounded(gl.max(amax_hw, axis=0), POW2)
        t64 = t.to(gl.int64)
        gl.store(dzts_ptr + t64 * 2 * I + cols, s_g)
        gl.store(dzts_ptr + t64 * 2 * I + I + cols, s_u)
        gl.store(hwts_ptr + t64 * I + cols, s_hw)
        gl.thread_barrier()  # every block's values in shared memory before any is read back
        ld = gl.num_programs(0).to(gl.int64) * TILE_M
        k0 = t64 * TILE_M
        rb_blocks: gl.constexpr = [TILE_M // RB, RB, 128]  # the same bytes as blocks of RB rows
        _store_tile_cols(dg_buf._reinterpret(gl.bfloat16, rb_blocks, buf_layout), inv_g, dzt_ptr, ld, col0, k0, blocks,
                         t_layout)
        _store_tile_cols(du_buf._reinterpret(gl.bfloat16, rb_blocks, buf_layout), inv_u, dzt_ptr, ld, I + col0, k0,
                         blocks, t_layout)
        _store_tile_cols(hw_buf._reinterpret(gl.bfloat16, rb_blocks, buf_layout), inv_hw, hwt_ptr, ld, col0, k0, blocks,
                         t_layout)
