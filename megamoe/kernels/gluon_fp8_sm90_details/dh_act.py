"""dh' with the FP8 weight gradients' act step in its epilogue (``gluon_fp8_sm90.fp8_dh_act_ws``): the outputs of
``act.act_tile_cols_kernel`` straight from dh''s accumulators, dh' itself never written or read.

dh' = dy W2[e] runs on the up kernel's main loop (``up.up_main``, as ``expert_bwd.dh_fp8_from_rows`` runs it): w2's
transposed copy (E, I, D) stands for w13, so that a block's "gate" and "up" accumulators are dh''s columns n0 .. n0
+ 127 and I/2 + n0 .. of the tile's 128 rows, two whole 128-column groups of I, each MMA warpgroup holding 64 rows of
them. For each group the warpgroup loads the rows' g and u, runs the SwiGLU backward in fp32 (``act.swiglu_grads``)
on dh' rounded to bf16 (as the act kernel reads it), and writes what the act kernel writes, with the same bits: the
d(routing weight) partials, dg and du quantised 1x128 (through its staging buffer, as the up kernel stores h), and
dg, du and h·w quantised 128x1 into tile columns. A 128x1 group spans both warpgroups' rows: each takes its 64 rows'
column amax, writes it to shared memory and arrives on the group's barrier; once both have, each reads the other's,
and both quantise their own rows by the tile's scales. A warpgroup whose rows all lie past its expert's end still
takes part, with zeros (its rows of the tile columns are the zeros the format asks for). The d(routing weight)
partials are the act kernel's sums in another order (equal to fp32 rounding, not bit for bit).

Registers. The warpgroup's partition has 216 a thread, and a (64, 128) fp32 block in the accumulator's layout takes
64 of them: dh''s two accumulators, g, u and the three results would need ~450. So dh' and the results are held as
bf16 pairs (one int32 per two neighbouring columns, rounded as the act kernel rounds them: what it quantises), 32
registers a block, unpacked where used; the column amaxes and the tile columns' quantisation run on each parity's
columns transposed once through the staging buffer and kept so across the warpgroups' meeting (a thread then holds
32 rows of one column as 16 row pairs: its amax within the thread and one neighbour, its e4m3 bytes stored as the
tile columns hold them), not across the accumulator layout's lanes and warps.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from megamoe.kernels.gluon_fp8_sm90_details.act import scales_of_rounded, swiglu_grads
from megamoe.kernels.gluon_fp8_sm90_details.common import (
    blocks_ahead,
    blocks_ahead_of,
    pass_stages,
)
from megamoe.kernels.gluon_fp8_sm90_details.up import up_loader, up_main, up_ring
from megamoe.kernels.gluon_sm90 import (
    barriers,
    block_index,
    count_busy_tiles,
    stamp,
    store_staged,
    wgmma_acc_layout,
)

KINDS = gl.constexpr(3)  # the tile columns a group writes: dg, du, h·w


@gluon.jit
def _pack_bf16(even, odd):
    """Two fp32 blocks rounded to bf16 (to nearest even) and packed into one int32 per element: ``even`` in the low
    half, ``odd`` in the high one (a row's pair of neighbouring bf16 columns, as memory holds it)."""
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [even, odd], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _unpacked(pairs, parity: gl.constexpr):
    """``_pack_bf16``'s ``parity`` half (0: even) back as fp32, exactly. Each call unpacks anew (side-effecting asm,
    which the compiler neither merges with another call's nor moves ahead of its use): merged, the fp32 halves of a
    block would stay live from its first use to its last, which is what packing it avoids."""
    if parity == 0:
        return gl.inline_asm_elementwise("shl.b32 $0, $1, 16;", "=f,r", [pairs], dtype=gl.float32, is_pure=False,
                                         pack=1)
    return gl.inline_asm_elementwise("and.b32 $0, $1, 0xffff0000;", "=f,r", [pairs], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def _half_of(pairs, parity: gl.constexpr):
    """``_pack_bf16``'s ``parity`` half (0: even) as bf16 (its bits moved, nothing rounded; side-effecting asm, as in
    ``_unpacked``)."""
    if parity == 0:
        return gl.inline_asm_elementwise("{ .reg .b16 hi; mov.b32 {$0, hi}, $1; }", "=h,r", [pairs],
                                         dtype=gl.bfloat16, is_pure=False, pack=1)
    return gl.inline_asm_elementwise("{ .reg .b16 lo; mov.b32 {lo, $0}, $1; }", "=h,r", [pairs], dtype=gl.bfloat16,
                                     is_pure=False, pack=1)


@gluon.jit
def _abs_max_pairs(a, b):
    """The larger magnitudes of two bf16 pairs, half by half (``max.bf16x2`` on the magnitudes: as ``gl.maximum`` on
    the values' fp32 magnitudes, a NaN losing to a number), packed as they were."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 x, y; and.b32 x, $1, 0x7fff7fff; and.b32 y, $2, 0x7fff7fff; max.bf16x2 $0, x, y; }", "=r,r,r",
        [a, b], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _pack_e4m3(even, odd):
    """Two fp32 blocks converted to e4m3 as ``quantize_by`` converts (cvt.rn.satfinite) and packed into one int16 per
    element, ``even`` in the low byte."""
    return gl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", [even, odd],
                                     dtype=gl.int16, is_pure=True, pack=1)


@gluon.jit
def _pairs_of(acc):
    """An accumulator block (rows, cols) fp32 rounded to bf16 as (rows, cols / 2) int32 pairs (``_pack_bf16``), in the
    accumulator's registers (a thread holds neighbouring columns)."""
    even, odd = gl.split(gl.reshape(acc, [acc.type.shape[0], acc.type.shape[1] // 2, 2]))
    return _pack_bf16(even, odd)


@gluon.jit
def _dz_rows(v, amax, stage, dzq_ptr, dzs_ptr, first, end, rows, rmask, c0, N, I, POW2: gl.constexpr,
             num_warps: gl.constexpr):
    """dg's or du's bf16 pairs ``v`` (this warpgroup's 64 rows, 128 columns) quantised 1x128 by their rows' ``amax``
    (before the rounding to bf16) into dzq (N, 2I) at columns c0 .. (``dzq_ptr`` as int16 pairs; through the staging
    buffer ``stage``) and the rows' scales into dzs (2I / 128, N)."""
    scale, inv = scales_of_rounded(amax, POW2)
    gl.store(dzs_ptr + (c0 // (2 * v.type.shape[1])) * N + rows, scale, mask=rmask)
    q = _pack_e4m3(_unpacked(v, 0) * inv[:, None], _unpacked(v, 1) * inv[:, None])
    store_staged(q, stage, dzq_ptr, first, end, c0 // 2, I, I, num_warps)


@gluon.constexpr_function
def _columns_layout(num_warps):
    """A (64 columns, 32 row pairs) int32 block of one warpgroup, each thread holding 16 neighbouring row pairs (32
    rows) of one column, the two halves of a column in neighbouring lanes: as the tile columns hold a column's rows."""
    return gl.BlockedLayout([1, 16], [16, 2], [num_warps, 1], [1, 0])


@gluon.jit
def _columns_of(v, parity: gl.constexpr, stage, num_warps: gl.constexpr):
    """The ``parity`` columns (0: even) of the bf16 pairs ``v`` (64 rows, 64 pairs) transposed through the staging
    buffer ``stage``: (64 columns, 32 row pairs) int32 in ``_columns_layout``, rows 2j and 2j + 1 of a column packed
    as ``_pack_bf16`` packs (the even row in the low half)."""
    PAIRS: gl.constexpr = v.type.shape[1]
    ROWS: gl.constexpr = v.type.shape[0]
    # 16-byte runs of a column's rows kept whole (the reads' width), each column's runs swizzled across the banks; the
    # int32 view below maps the same bytes (16-byte runs, the same swizzle)
    buf = stage._reinterpret(gl.bfloat16, [PAIRS, ROWS], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    buf.permute((1, 0)).store(_half_of(v, parity))
    gl.thread_barrier()  # the partition's writes before its reads
    rows = stage._reinterpret(gl.int32, [PAIRS, ROWS // 2], gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
    columns = rows.load(_columns_layout(num_warps))
    gl.thread_barrier()  # and its reads before the next writes
    return columns


@gluon.jit
def _transposed(v, amax_bufs, row, stage, num_warps: gl.constexpr):
    """The bf16 pairs ``v`` (this warpgroup's 64 rows, 128 columns) by column (``_columns_of``: (its even columns, its
    odd ones)), their columns' amax over the warpgroup's rows written to ``amax_bufs`` rows ``row`` (even columns) and
    ``row + 1`` (odd)."""
    parts = (_columns_of(v, 0, stage, num_warps), _columns_of(v, 1, stage, num_warps))
    for parity in gl.static_range(2):
        # a column's two amaxes, of its even and its odd rows (each pair goes through the combine, which takes the
        # magnitudes, at least once: the reduced axis holds 32)
        pairs = gl.reduce(parts[parity], 1, _abs_max_pairs)
        amax_bufs.index(row + parity).store(gl.maximum(_unpacked(pairs, 0), _unpacked(pairs, 1)))
    return parts


@gluon.jit
def _tile_cols(parts, amax_bufs, row, other, scales_ptr, q_ptr, c0, k0, ld, WG: gl.constexpr, POW2: gl.constexpr):
    """A block's bf16 values by column (``_transposed``'s parts: this warpgroup's 64 rows of 128 columns) quantised by
    column into tile columns q at rows c0 .. c0 + 127 (q's rows are the values' columns) and columns k0 .. k0 + 63
    (``q_ptr`` as int16 pairs, ``ld``: q's row length in bytes), by the tile's column amaxes (``amax_bufs`` rows ``row``
    and ``other``: this warpgroup's and the other's, each an even and an odd row); their scales into ``scales_ptr``
    at c0 .. by the first warpgroup. A thread stores 32 bytes of a column's rows."""
    layout: gl.constexpr = parts[0].type.layout
    col_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols = gl.arange(0, parts[0].type.shape[0], layout=col_layout)
    local = gl.arange(0, parts[0].type.shape[1], layout=gl.SliceLayout(0, layout))
    for parity in gl.static_range(2):
        amax = gl.maximum(amax_bufs.index(row + parity).load(col_layout),
                          amax_bufs.index(other + parity).load(col_layout))
        scale, inv = scales_of_rounded(amax, POW2)
        if WG == 0:
            gl.store(scales_ptr + c0 + 2 * cols + parity, scale)
        q = _pack_e4m3(_unpacked(parts[parity], 0) * inv[:, None], _unpacked(parts[parity], 1) * inv[:, None])
        gl.store(q_ptr + (c0 + 2 * cols + parity).to(gl.int64)[:, None] * (ld // 2) + k0 // 2 + local[None, :], q)


@gluon.jit
def _act_group(d, c0, X: gl.constexpr, phase, t, first, end, rows, rmask, slots, wt, preact_ptr, dweight_part_ptr,
               dzq_ptr, dzs_ptr, dzt_ptr, dzts_ptr, hwt_ptr, hwts_ptr, stage, amax_bufs, swap, N, I, ld,
               WG: gl.constexpr, PART_COLS: gl.constexpr, POW2: gl.constexpr, num_warps: gl.constexpr):
    """The act step on dh''s columns c0 .. c0 + 127 (``d``: this warpgroup's 64 rows of tile ``t`` in bf16 pairs,
    ``_pairs_of``): the outputs of ``act.act_tile_cols_kernel`` for those rows and columns, the tile columns' scales
    written by the first warpgroup. ``preact_ptr``, ``dzq_ptr``: the products and dz's 1x128 rows as int32 and int16
    pairs; ``X``: the group's meeting (0 or 1), ``phase`` its barrier's; ``ld``: the tile columns' row length (the
    plan's tiles times 128). The values are computed once, in fp32, kept as bf16 pairs (what the tile columns and dz's
    rows quantise), with the rows' amaxes and the d(routing weight) partials taken on the way."""
    HALF: gl.constexpr = d.type.shape[0]
    PAIRS: gl.constexpr = d.type.shape[1]
    layout: gl.constexpr = d.type.layout
    pairs = gl.arange(0, PAIRS, layout=gl.SliceLayout(0, layout))
    offs = rows[:, None].to(gl.int64) * I + (c0 // 2 + pairs)[None, :]
    g = gl.load(preact_ptr + offs, mask=rmask[:, None], other=0)
    u = gl.load(preact_ptr + offs + I // 2, mask=rmask[:, None], other=0)
    dg0, du0, hw0, dwh0 = swiglu_grads(_unpacked(g, 0), _unpacked(u, 0), _unpacked(d, 0), wt)
    dg1, du1, hw1, dwh1 = swiglu_grads(_unpacked(g, 1), _unpacked(u, 1), _unpacked(d, 1), wt)
    dwh = dwh0 + dwh1
    for j in gl.static_range(2 * PAIRS // PART_COLS):  # as act.act_tile_cols_kernel's partials, summed in another order
        gl.store(dweight_part_ptr + (c0 // PART_COLS + j).to(gl.int64) * N + slots,
                 gl.sum(gl.where((pairs // (PART_COLS // 2) == j)[None, :], dwh, 0.0), axis=1), mask=rmask)
    amax_dg = gl.maximum(gl.max(gl.abs(dg0), axis=1), gl.max(gl.abs(dg1), axis=1))
    amax_du = gl.maximum(gl.max(gl.abs(du0), axis=1), gl.max(gl.abs(du1), axis=1))
    dg = _pack_bf16(dg0, dg1)
    du = _pack_bf16(du0, du1)
    hw = _pack_bf16(hw0, hw1)
    _dz_rows(dg, amax_dg, stage, dzq_ptr, dzs_ptr, first, end, rows, rmask, c0, N, I, POW2, num_warps)
    _dz_rows(du, amax_du, stage, dzq_ptr, dzs_ptr, first, end, rows, rmask, I + c0, N, I, POW2, num_warps)
    # the columns' amaxes over this warpgroup's rows, met with the other's: rows ((X * KINDS + kind) * 2 + WG) * 2 ..
    mine = (X * KINDS * 2 + WG) * 2
    other = (X * KINDS * 2 + 1 - WG) * 2
    dg_t = _transposed(dg, amax_bufs, mine, stage, num_warps)
    du_t = _transposed(du, amax_bufs, mine + 4, stage, num_warps)
    hw_t = _transposed(hw, amax_bufs, mine + 8, stage, num_warps)
    gl.thread_barrier()  # every warp's writes before the warpgroup's arrival
    mbarrier.arrive(swap.index(X), count=1)
    mbarrier.wait(swap.index(X), phase)
    k0 = t.to(gl.int64) * 2 * HALF + WG * HALF
    _tile_cols(dg_t, amax_bufs, mine, other, dzts_ptr + t.to(gl.int64) * 2 * I, dzt_ptr, c0, k0, ld, WG, POW2)
    _tile_cols(du_t, amax_bufs, mine + 4, other + 4, dzts_ptr + t.to(gl.int64) * 2 * I, dzt_ptr, I + c0, k0, ld, WG,
               POW2)
    _tile_cols(hw_t, amax_bufs, mine + 8, other + 8, hwts_ptr + t.to(gl.int64) * I, hwt_ptr, c0, k0, ld, WG, POW2)


@gluon.jit
def _dh_act_partition(preact_ptr, weights_ptr, slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, dweight_part_ptr,
                      dzq_ptr, dzs_ptr, dzt_ptr, dzts_ptr, hwt_ptr, hwts_ptr, ready, empty, x_bufs, g_bufs, u_bufs,
                      as_bufs, bs_bufs, staging, amax_bufs, swap, trace_ptr, N, D, I, ld, num_n, work,
                      WG: gl.constexpr, PART_COLS: gl.constexpr, POW2: gl.constexpr, TRACE: gl.constexpr,
                      num_warps: gl.constexpr):
    """MMA partition ``WG`` (rows WG*64 .. WG*64+63 of each tile) of ``dh_act_ws_kernel``: a block's dh' columns by
    ``up.up_main`` (none where its rows all lie past the expert: zeros), rounded to bf16 pairs, then the act step on
    each of its two 128-column groups (``_act_group``). TRACE: the up kernel's stamps (``gluon_sm90.TRACE_BLOCKS``;
    the act step lies between points 2 and 3)."""
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[3]  # [STAGES, 1, 1, BN, BK]
    HALF: gl.constexpr = bs_bufs.type.shape[1]
    acc_layout: gl.constexpr = wgmma_acc_layout(BN, num_warps, 32)
    step = 0
    row0, end, e_next, row0_next = blocks_ahead(tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, work)
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = block_index(w)
        stamp(trace_ptr, WG, block, 0, TRACE, num_warps)
        end_next, e_after, row0_after = blocks_ahead_of(w, e_next, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n,
                                                         work)
        n0 = (w % num_n) * BN
        first = row0 + WG * HALF
        if first < end:
            acc_g, acc_u, step = up_main(ready, empty, x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, step, trace_ptr,
                                         block, D, WG, TRACE, num_warps)
        else:  # all 64 rows past the expert: the stages handed back untouched, the act step on zeros
            step = pass_stages(ready, empty, step, D, BK)
            acc_g = gl.zeros([HALF, BN], gl.float32, acc_layout)
            acc_u = gl.zeros([HALF, BN], gl.float32, acc_layout)
        stamp(trace_ptr, WG, block, 2, TRACE, num_warps)
        d_g = _pairs_of(acc_g)
        d_u = _pairs_of(acc_u)
        rows = first + gl.arange(0, HALF, layout=gl.SliceLayout(1, d_g.type.layout))
        rmask = rows < end
        slots = gl.load(slot_ptr + rows, mask=rmask, other=0).to(gl.int64)
        wt = gl.load(weights_ptr + slots, mask=rmask, other=0.0)
        phase = block_index(w) & 1
        t = w // num_n
        _act_group(d_g, n0, 0, phase, t, first, end, rows, rmask, slots, wt, preact_ptr, dweight_part_ptr, dzq_ptr,
                   dzs_ptr, dzt_ptr, dzts_ptr, hwt_ptr, hwts_ptr, staging.index(WG), amax_bufs, swap, N, I, ld, WG,
                   PART_COLS, POW2, num_warps)
        _act_group(d_u, I // 2 + n0, 1, phase, t, first, end, rows, rmask, slots, wt, preact_ptr, dweight_part_ptr,
                   dzq_ptr, dzs_ptr, dzt_ptr, dzts_ptr, hwt_ptr, hwts_ptr, staging.index(WG), amax_bufs, swap, N, I, ld,
                   WG, PART_COLS, POW2, num_warps)
        stamp(trace_ptr, WG, block, 3, TRACE, num_warps)
        row0, end, e_next, row0_next = row0_next, end_next, e_after, row0_after


@gluon.jit
def dh_act_ws_kernel(x_ptr, x_s_ptr, w2t_desc, w2t_s_ptr, preact_ptr, weights_ptr, row_slot_ptr, slot_ptr, offsets_ptr,
                     tile_expert_ptr, tile_row_ptr, dweight_part_ptr, dzq_ptr, dzs_ptr, dzt_ptr, dzts_ptr, hwt_ptr,
                     hwts_ptr, trace_ptr, T, N, D, I, E, LD, top_k, EB: gl.constexpr, TILE_M: gl.constexpr,
                     PART_COLS: gl.constexpr, POW2: gl.constexpr, TRACE: gl.constexpr, STAGES: gl.constexpr,
                     LOADER_WARPS: gl.constexpr, MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                     num_warps: gl.constexpr):
    """dy's rows x (T, D) fp8 gathered by ``row_slot[r] // top_k`` with x_s (D // 128, T) fp32; w2t_desc: w2's
    transposed copy (E, 2, I / 2, D) fp8 (dh''s first and second halves of I), block (1, 1, BN, BK); w2t_s (E, I //
    128, D // 128) fp32; preact (N, I) int32: the (N, 2I) bf16 [g | u] of the sorted rows in pairs; weights (N,) fp32
    by slot, each row's slot ``slot[r]``; out as ``act.act_tile_cols_kernel``'s, dzq as (N, I) int16 pairs (LD: the
    tile columns' row length, the plan's tiles times 128). Blocks: the busy tiles (EB: a power of two >= E) times the
    128-column blocks of I / 2. TRACE: stamps into trace_ptr (int64, see ``gluon_sm90.TRACE_BLOCKS``)."""
    BN: gl.constexpr = w2t_desc.block_type.shape[2]
    num_n = I // 2 // BN
    work = count_busy_tiles(offsets_ptr, E, EB, TILE_M, num_warps) * num_n
    x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, staging, ready, empty = up_ring(w2t_desc, TILE_M, STAGES, LOADER_WARPS)
    # The two meetings of a block: each warpgroup's partial column amaxes of the three kinds (even and odd columns),
    # and their barriers
    amax_bufs = gl.allocate_shared_memory(gl.float32, [2 * KINDS * 2 * 2, BN // 2],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
    swap = barriers(2, 2)
    gl.warp_specialize([
        (_dh_act_partition, (preact_ptr, weights_ptr, slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                             dweight_part_ptr, dzq_ptr, dzs_ptr, dzt_ptr, dzts_ptr, hwt_ptr, hwts_ptr, ready, empty,
                             x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, staging, amax_bufs, swap, trace_ptr, N, D, I,
                             LD, num_n, work, 0, PART_COLS, POW2, TRACE, num_warps)),
        (_dh_act_partition, (preact_ptr, weights_ptr, slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                             dweight_part_ptr, dzq_ptr, dzs_ptr, dzt_ptr, dzts_ptr, hwt_ptr, hwts_ptr, ready, empty,
                             x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, staging, amax_bufs, swap, trace_ptr, N, D, I,
                             LD, num_n, work, 1, PART_COLS, POW2, TRACE, num_warps)),
        (up_loader, (x_ptr, x_s_ptr, w2t_desc, w2t_s_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                     ready, empty, x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, trace_ptr, T, D, I // 2, top_k, num_n,
                     work, TRACE, LOADER_WARPS)),
    ], [num_warps, LOADER_WARPS], [MMA_REGS, LOADER_REGS])
