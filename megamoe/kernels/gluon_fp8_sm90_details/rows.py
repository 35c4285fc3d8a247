"""The FP8 sorted-rows GEMM (down projection, dh', dx): out[r] = [weight[slot(r)] *] sum_k A[r, k] W[e(r)][n, k],
rows to slots or kept sorted; launched by ``gluon_fp8_sm90.fp8_rows_gemm_ws``."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma_wait,
)

from megamoe.kernels.gluon_fp8_sm90_details.common import (
    block_scales,
    blocks_ahead,
    blocks_ahead_of,
    issue_chain,
    pass_stages,
    promote,
    ring,
    stage_ready,
)
from megamoe.kernels.gluon_sm90 import (
    block_index,
    count_busy_tiles,
    next_slot,
    row_segments,
    stamp,
    stamp_first,
    tile_block,
    wgmma_acc_layout,
)


@gluon.jit
def _rows_loader(a_desc, w_desc, a_s_ptr, w_s_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, a_bufs, w_bufs,
                 as_bufs, bs_bufs, trace_ptr, M, N_OUT, K, num_n, work, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Loader partition (one warp) of ``rows_ws_kernel``: per K-step, A's rows (block (128, 128)) and the
    expert's weight block (1, BN, 128) through TMA; A's 128 row scales and the weight block's BN / 128 scales (each
    into 64 entries) through 4-byte ``cp.async``, each thread's copies arriving on the stage's ready barrier."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[1]
    HALF: gl.constexpr = bs_bufs.type.shape[1]
    NB: gl.constexpr = bs_bufs.type.shape[0] // a_bufs.type.shape[0]  # weight scale blocks per stage
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    layout: gl.constexpr = gl.BlockedLayout([HALF // (32 * num_warps)], [32], [num_warps], [0])
    lanes = gl.arange(0, HALF, layout=layout)
    same = gl.zeros([HALF], gl.int32, layout)  # every entry: the one weight scale
    kbs = K // BK
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = block_index(w)
        stamp(trace_ptr, 2, block, 0, TRACE, num_warps)
        e, row0, n0 = tile_block(w, tile_expert_ptr, tile_row_ptr, num_n, BN)
        rows0 = row0 + lanes  # the first warpgroup's rows; rows0 + HALF the second's
        rows1 = rows0 + HALF
        w_scale = w_s_ptr + (e * (N_OUT // (BN // NB)) + n0 // (BN // NB)) * kbs + same
        for kb in range(kbs):
            s = next_slot(empty, ready, step, nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, kb * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [e, n0, kb * BK], ready.index(s), w_bufs.index(s))
            # rows past M (the last tile): zero scales, as TMA zero-fills their A rows
            async_copy.async_copy_global_to_shared(as_bufs.index(2 * s), a_s_ptr + kb * M + rows0, mask=rows0 < M)
            async_copy.async_copy_global_to_shared(as_bufs.index(2 * s + 1), a_s_ptr + kb * M + rows1, mask=rows1 < M)
            for j in gl.static_range(NB):
                async_copy.async_copy_global_to_shared(bs_bufs.index(NB * s + j), w_scale + j * kbs + kb)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            step += 1
            stamp_first(trace_ptr, 2, block, 1, kb == 0, TRACE, num_warps)
        stamp(trace_ptr, 2, block, 2, TRACE, num_warps)


@gluon.jit
def _rows_stage(as_bufs, bs_bufs, ready, step, STAGES: gl.constexpr, WG: gl.constexpr, row_layout: gl.constexpr):
    """Wait for ring step ``step``'s stage and read this warpgroup's scales of it: (the stage, the scales)."""
    s = stage_ready(ready, step, STAGES)
    return s, block_scales(as_bufs, bs_bufs, s, 0, WG, row_layout)


@gluon.jit
def _rows_store(out, out_rows, first, end, n0, out_ptr, row_dest_ptr, N_OUT, num_warps: gl.constexpr):
    """The epilogue's stores of one warpgroup's bf16 block ``out`` (in the accumulator's layout): converted to 16-byte
    row segments and stored through masked pointer stores (rows [first, end): a tile's rows past its expert belong to
    the next tile) into rows ``out_rows`` (int32, in the row segments' row layout), columns n0 ..; with an int64
    ``row_dest_ptr`` (``rows_ws_kernel``'s ROW_DEST; of another type it is not read) ``out_rows`` are sorted rows
    whose destinations it gives."""
    BN: gl.constexpr = out.type.shape[1]
    out_layout: gl.constexpr = row_segments(BN, 2, num_warps)
    local = first + gl.arange(0, out.type.shape[0], layout=gl.SliceLayout(1, out_layout))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
    if row_dest_ptr.dtype.element_ty == gl.int64:  # ROW_DEST: loaded now, so that no int64 rows are held
        unit: gl.constexpr = 128 // out_ptr.dtype.element_ty.primitive_bitwidth  # (16 bytes: the compiler knows the
        row_start = gl.load(row_dest_ptr + out_rows, mask=local < end, other=0) * unit  # rows fit 16-byte stores)
    else:
        row_start = out_rows.to(gl.int64) * N_OUT
    gl.store(out_ptr + row_start[:, None] + cols[None, :], gl.convert_layout(out, out_layout),
             mask=(local < end)[:, None] & (cols < N_OUT)[None, :])


@gluon.jit
def _rows_store_pending(pend, out, out_rows, first, end, n0, out_ptr, row_dest_ptr, N_OUT, num_warps: gl.constexpr):
    """``_rows_store`` of the block a deferring warpgroup holds, if it holds one (``pend`` nonzero)."""
    if pend != 0:
        _rows_store(out, out_rows, first, end, n0, out_ptr, row_dest_ptr, N_OUT, num_warps)


@gluon.jit
def _rows_main_narrow(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, kbs, block, trace_ptr, out_ptr,
                      row_dest_ptr, N_OUT, pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, WG: gl.constexpr,
                      TRACE: gl.constexpr, acc_layout: gl.constexpr, num_warps: gl.constexpr):
    """The main loop of a 128-column block for one warpgroup: per K-step the block's MMA chain into a temporary, then
    its promotion into the accumulator under the next K-step's chain, into a second temporary; the previous block's
    stores (``pend_*``) under the first chain. Returns (the accumulator, the next ring step)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HALF: gl.constexpr = as_bufs.type.shape[1]
    BN: gl.constexpr = w_bufs.type.shape[2]  # [STAGES, 1, BN, BK]
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    s0, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
    stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
    # the MMAs' destination registers, reused
    tmp0 = issue_chain(a_bufs, w_bufs, s0, 0, gl.zeros([HALF, BN], gl.float32, acc_layout), WG)
    # the previous block's stores, under this block's first MMA
    _rows_store_pending(pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, out_ptr, row_dest_ptr, N_OUT,
                        num_warps)
    acc = gl.zeros([HALF, BN], gl.float32, acc_layout)
    # Two temporaries: once block k's chain is done, block k+1's is issued before k's promotion,
    # which then runs under it, so that each warpgroup keeps the tensor cores busy through its own
    # promotions. Done means waited to zero chains in flight: a chain carried in flight across the
    # loop's back edge, retired by a wait(1) and then read, makes ptxas serialise every wgmma of the
    # kernel (C7514), so the next chain goes in just after the wait (the scales and its stage's
    # ready wait come first, under the running chain). The body is two blocks long (tmp0 and
    # tmp1 swap roles: registers cannot be indexed); the last one or two blocks run after it. A stage
    # is freed once the chain reading it is done; a warpgroup holds two at most. (A chain in flight
    # cannot be carried into a branch that waits on it under the same name: the waited results are
    # named apart.)
    tmp1 = gl.zeros([HALF, BN], gl.float32, acc_layout)
    for _ in range((kbs - 1) // 2):  # [block `step` in flight in tmp0]
        s1, scale1 = _rows_stage(as_bufs, bs_bufs, ready, step + 1, STAGES, WG, row_layout)
        tmp0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        tmp1 = issue_chain(a_bufs, w_bufs, s1, 0, tmp1, WG)
        mbarrier.arrive(empty.index(s0), count=1)
        acc = promote(acc, tmp0, scale0[:, None])
        s0, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step + 2, STAGES, WG, row_layout)
        tmp1 = warpgroup_mma_wait(0, deps=(tmp1, ))
        tmp0 = issue_chain(a_bufs, w_bufs, s0, 0, tmp0, WG)
        mbarrier.arrive(empty.index(s1), count=1)
        acc = promote(acc, tmp1, scale1[:, None])
        step += 2
    if kbs % 2 == 0:  # two blocks left: `step` in flight, and the next
        s1, scale1 = _rows_stage(as_bufs, bs_bufs, ready, step + 1, STAGES, WG, row_layout)
        done0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        tmp1 = issue_chain(a_bufs, w_bufs, s1, 0, tmp1, WG)
        mbarrier.arrive(empty.index(s0), count=1)
        acc = promote(acc, done0, scale0[:, None])
        tmp1 = warpgroup_mma_wait(0, deps=(tmp1, ))
        mbarrier.arrive(empty.index(s1), count=1)
        acc = promote(acc, tmp1, scale1[:, None])
        step += 2
    else:  # one block left, in flight
        done0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        mbarrier.arrive(empty.index(s0), count=1)
        acc = promote(acc, done0, scale0[:, None])
        step += 1
    return acc, step


@gluon.jit
def _rows_left_out(acc0, wt, out_ptr, WEIGHTED: gl.constexpr):
    """A 256-column block's left half as stored: weighted (WEIGHTED), in the output's type."""
    if WEIGHTED:
        acc0 = acc0 * wt[:, None]
    return acc0.to(out_ptr.dtype.element_ty)


@gluon.jit
def _rows_wide_step(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, acc0, acc1, tmp, wt, out_rows, first, end,
                    n0, out_ptr, row_dest_ptr, N_OUT, WG: gl.constexpr, STORE_LEFT: gl.constexpr,
                    WEIGHTED: gl.constexpr, num_warps: gl.constexpr):
    """One K-step of a 256-column block for one warpgroup (``_rows_main_wide``): the left chain, its promotion into
    ``acc0``, the right chain, its promotion into ``acc1``, the stage freed; with STORE_LEFT (the block's last
    K-step) the left half converted before the right chain is issued and stored under it. Returns (acc0, acc1,
    tmp)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HB: gl.constexpr = tmp.type.shape[1]
    row_layout: gl.constexpr = gl.SliceLayout(1, tmp.type.layout)
    s, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
    scale1 = block_scales(as_bufs, bs_bufs, s, 1, WG, row_layout)
    tmp = warpgroup_mma_wait(0, deps=(issue_chain(a_bufs, w_bufs, s, 0, tmp, WG), ))
    acc0 = acc0 + tmp * scale0[:, None]
    if STORE_LEFT:
        out0 = _rows_left_out(acc0, wt, out_ptr, WEIGHTED)
        tmp = issue_chain(a_bufs, w_bufs, s, HB, tmp, WG)
        _rows_store(out0, out_rows, first, end, n0, out_ptr, row_dest_ptr, N_OUT, num_warps)
    else:
        tmp = issue_chain(a_bufs, w_bufs, s, HB, tmp, WG)
    tmp = warpgroup_mma_wait(0, deps=(tmp, ))
    mbarrier.arrive(empty.index(s), count=1)
    acc1 = acc1 + tmp * scale1[:, None]
    return acc0, acc1, tmp


@gluon.jit
def _rows_main_wide(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, kbs, block, trace_ptr, wt, out_rows, first,
                    end, n0, out_ptr, row_dest_ptr, N_OUT, pend, pend_out, pend_rows, pend_first, pend_end, pend_n0,
                    WG: gl.constexpr, WEIGHTED: gl.constexpr, TRACE: gl.constexpr, acc_layout: gl.constexpr,
                    num_warps: gl.constexpr):
    """The main loop of a 256-column block for one warpgroup: per K-step the MMA chain of the weight block's left
    128 columns into the temporary, wait, its promotion into the left accumulator; the right half's likewise; the
    stage freed (``_rows_wide_step``). Two accumulators and one temporary (3 x 64 registers per thread): no second
    temporary fits for a chain to be issued ahead of a promotion, so the promotions run under the other warpgroup's
    MMAs. The stores run under this warpgroup's chains: the previous block's right half (``pend_*``) under the first
    K-step's left chain, this block's left half under the last K-step's right chain (the first and last K-steps
    peeled off the loop, so that neither store's registers are held through it). Returns the right half's
    accumulator."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HALF: gl.constexpr = as_bufs.type.shape[1]
    HB: gl.constexpr = w_bufs.type.shape[2] // 2
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    tmp = gl.zeros([HALF, HB], gl.float32, acc_layout)  # both chains' destination registers
    s, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
    stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
    scale1 = block_scales(as_bufs, bs_bufs, s, 1, WG, row_layout)
    tmp = issue_chain(a_bufs, w_bufs, s, 0, tmp, WG)
    _rows_store_pending(pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, out_ptr, row_dest_ptr, N_OUT,
                        num_warps)
    tmp = warpgroup_mma_wait(0, deps=(tmp, ))
    acc0 = tmp * scale0[:, None]
    out0 = _rows_left_out(acc0, wt, out_ptr, WEIGHTED)  # (stored here only if this is the last K-step)
    tmp = issue_chain(a_bufs, w_bufs, s, HB, tmp, WG)
    if kbs == 1:
        _rows_store(out0, out_rows, first, end, n0, out_ptr, row_dest_ptr, N_OUT, num_warps)
    tmp = warpgroup_mma_wait(0, deps=(tmp, ))
    mbarrier.arrive(empty.index(s), count=1)
    acc1 = tmp * scale1[:, None]
    for kb in range(1, kbs - 1):
        acc0, acc1, tmp = _rows_wide_step(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step + kb, acc0, acc1,
                                          tmp, wt, out_rows, first, end, n0, out_ptr, row_dest_ptr, N_OUT, WG, False,
                                          WEIGHTED, num_warps)
    if kbs > 1:
        acc0, acc1, tmp = _rows_wide_step(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step + kbs - 1, acc0,
                                          acc1, tmp, wt, out_rows, first, end, n0, out_ptr, row_dest_ptr, N_OUT, WG,
                                          True, WEIGHTED, num_warps)
    return acc1


@gluon.jit
def _rows_mma_partition(out_ptr, weights_ptr, row_slot_ptr, row_dest_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                        ready, empty, a_bufs, w_bufs, as_bufs, bs_bufs, trace_ptr, N_OUT, K, num_n, work,
                        WG: gl.constexpr, WEIGHTED: gl.constexpr, TO_SLOTS: gl.constexpr, TRACE: gl.constexpr,
                        num_warps: gl.constexpr):
    """MMA partition ``WG`` (rows WG*64 .. WG*64+63 of each tile) of ``rows_ws_kernel``: per K-step the
    block's MMA into a temporary, then the promotion into the fp32 accumulator under the next block's MMA into a
    second temporary (issue-ahead, ``_rows_main_narrow``); then the weighted bf16 block's stores (``_rows_store``) to
    sorted rows or to slots, deferred until the warpgroup's next block has issued its first MMA, and run under it
    (the last block's after the loop). A block of 256 columns (``ROWS_BLOCK_N``) runs as two column halves of 128,
    each with its own accumulator, without issue-ahead (``_rows_main_wide``): its left half stored under its last
    chain, its right half under the next block's first. ``row_dest_ptr``: as for ``rows_ws_kernel``."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    ROW_DEST: gl.constexpr = row_dest_ptr.dtype.element_ty == gl.int64
    NH: gl.constexpr = bs_bufs.type.shape[0] // STAGES  # column halves of the block: its weight scale blocks
    BN: gl.constexpr = w_bufs.type.shape[2] // NH  # [STAGES, 1, NH * BN, BK]: BN columns per accumulator
    HALF: gl.constexpr = bs_bufs.type.shape[1]
    acc_layout: gl.constexpr = wgmma_acc_layout(BN, num_warps, 32)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    seg_rows: gl.constexpr = gl.SliceLayout(1, row_segments(BN, 2, num_warps))
    kbs = K // BK
    step = 0
    # The stores a block has left to do: its bf16 block, output rows, row range and first column
    pend = 0
    pend_out = gl.zeros([HALF, BN], out_ptr.dtype.element_ty, acc_layout)
    pend_rows = gl.zeros([HALF], gl.int32, seg_rows)
    pend_first = 0
    pend_end = 0
    pend_n0 = 0
    row0, end, e_next, row0_next = blocks_ahead(tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, work)
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = block_index(w)
        stamp(trace_ptr, WG, block, 0, TRACE, num_warps)
        end_next, e_after, row0_after = blocks_ahead_of(w, e_next, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n,
                                                         work)
        n0 = (w % num_n) * (NH * BN)
        first = row0 + WG * HALF
        if first < end:
            # The epilogue's row data, loaded now so that its latency hides under the main loop.
            out_rows = first + gl.arange(0, HALF, layout=seg_rows)
            if TO_SLOTS and not ROW_DEST:  # (ROW_DEST: the stores read the destinations)
                out_rows = gl.load(row_slot_ptr + out_rows, mask=out_rows < end, other=0)
            if WEIGHTED:
                acc_rows = first + gl.arange(0, HALF, layout=row_layout)
                acc_slots = gl.load(row_slot_ptr + acc_rows, mask=acc_rows < end, other=0)
                wt = gl.load(weights_ptr + acc_slots, mask=acc_rows < end, other=0.0)
            else:
                wt = 0.0  # (unused)
            if NH == 2:
                acc1 = _rows_main_wide(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, kbs, block, trace_ptr,
                                       wt, out_rows, first, end, n0, out_ptr, row_dest_ptr, N_OUT, pend, pend_out,
                                       pend_rows, pend_first, pend_end, pend_n0, WG, WEIGHTED, TRACE, acc_layout,
                                       num_warps)
                step += kbs
                stamp(trace_ptr, WG, block, 2, TRACE, num_warps)
                if WEIGHTED:
                    acc1 = acc1 * wt[:, None]
                # the left half is stored; the right one under the next block's first chain
                pend = 1
                pend_out = acc1.to(out_ptr.dtype.element_ty)
                pend_rows = out_rows
                pend_first = first
                pend_end = end
                pend_n0 = n0 + BN
            else:
                acc, step = _rows_main_narrow(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, kbs, block,
                                              trace_ptr, out_ptr, row_dest_ptr, N_OUT, pend, pend_out, pend_rows,
                                              pend_first, pend_end, pend_n0, WG, TRACE, acc_layout, num_warps)
                stamp(trace_ptr, WG, block, 2, TRACE, num_warps)
                if WEIGHTED:
                    acc = acc * wt[:, None]
                pend = 1
                pend_out = acc.to(out_ptr.dtype.element_ty)
                pend_rows = out_rows
                pend_first = first
                pend_end = end
                pend_n0 = n0
        else:  # all 64 rows past the expert: hand the stages back untouched
            _rows_store_pending(pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, out_ptr, row_dest_ptr,
                                N_OUT, num_warps)
            pend = 0
            step = pass_stages(ready, empty, step, K, BK)
        stamp(trace_ptr, WG, block, 3, TRACE, num_warps)
        row0, end, e_next, row0_next = row0_next, end_next, e_after, row0_after
    _rows_store_pending(pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, out_ptr, row_dest_ptr, N_OUT,
                        num_warps)


@gluon.jit
def rows_ws_kernel(a_desc, w_desc, a_s_ptr, w_s_ptr, out_ptr, weights_ptr, row_slot_ptr, row_dest_ptr, offsets_ptr,
                        tile_expert_ptr, tile_row_ptr, trace_ptr, M, N_OUT, K, E, EB: gl.constexpr,
                        TILE_M: gl.constexpr, WEIGHTED: gl.constexpr, TO_SLOTS: gl.constexpr, TRACE: gl.constexpr,
                        STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, MMA_REGS: gl.constexpr,
                        LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """a_desc: A (M, K) fp8 in sorted rows, block (TILE_M, BK); w_desc: W (E, N_OUT, K) fp8, block (1, BN, BK);
    a_s (K // 128, M) and w_s (E, N_OUT // 128, K // 128) fp32; out (M, N_OUT) bf16: row r of the product
    into row ``row_slot[r]`` (TO_SLOTS) or r, times ``weights[row_slot[r]]`` (WEIGHTED, fp32 by slot); or, with
    ``row_dest_ptr`` int64 (ROW_DEST, TO_SLOTS), at ``out_ptr`` plus ``row_dest[r]`` 16-byte units, anywhere in the
    address space (an expert-parallel owner's rows into their sources' slots; 16-byte units, so that the compiler
    knows the rows aligned for 16-byte stores); ``row_dest_ptr`` of another type is not read.
    Blocks: the plan's busy tiles (EB: a power of two >= E) times the N-blocks, one program per SM walking
    them. num_warps: one warpgroup (the first MMA partition); the kernel adds the second and the loader.
    TRACE: stamps into trace_ptr (int64, see ``gluon_sm90.TRACE_BLOCKS``)."""
    BN: gl.constexpr = w_desc.block_type.shape[1]
    num_n = N_OUT // BN
    work = count_busy_tiles(offsets_ptr, E, EB, TILE_M, num_warps) * num_n
    # The weight block's scales per stage (one per 128 of its columns), each repeated across 64
    a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty = ring(a_desc, w_desc, BN // 128, a_desc.block_type.shape[0] // 2,
                                                           STAGES, LOADER_WARPS)
    gl.warp_specialize([
        (_rows_mma_partition, (out_ptr, weights_ptr, row_slot_ptr, row_dest_ptr, offsets_ptr, tile_expert_ptr,
                               tile_row_ptr, ready, empty, a_bufs, w_bufs, as_bufs, bs_bufs, trace_ptr, N_OUT, K,
                               num_n, work, 0, WEIGHTED, TO_SLOTS, TRACE, num_warps)),
        (_rows_mma_partition, (out_ptr, weights_ptr, row_slot_ptr, row_dest_ptr, offsets_ptr, tile_expert_ptr,
                               tile_row_ptr, ready, empty, a_bufs, w_bufs, as_bufs, bs_bufs, trace_ptr, N_OUT, K,
                               num_n, work, 1, WEIGHTED, TO_SLOTS, TRACE, num_warps)),
        (_rows_loader, (a_desc, w_desc, a_s_ptr, w_s_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, a_bufs, w_bufs,
                        as_bufs, bs_bufs, trace_ptr, M, N_OUT, K, num_n, work, TRACE, LOADER_WARPS)),
    ], [num_warps, LOADER_WARPS], [MMA_REGS, LOADER_REGS])

