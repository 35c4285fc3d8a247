"""The FP8 weight gradients: dW[e] = sum over expert e's plan tiles t of deq(A)[tile t]ᵀ deq(B)[tile t], both
operands quantised 128x1 along the tokens; launched by ``gluon_fp8_sm90.fp8_wgrad_ws``.

Each K-step's partial is promoted with the outer product of its tile's scales, A's of the rows times B's of the
columns: B's are read from shared memory by every thread (32 a (64, 128) half) and multiplied in per element, ~25% of
the kernel at the 235B layer (docs/FACTS.md). With B_CONST (B quantised with one scale per column over more rows than a
tile's: ``quant.quantize_tile_cols``' ``col_amax``, the same in every tile of an expert) a K-step is promoted by A's
row scales alone, one multiply-add per element, and the block's sum is multiplied by B's column scales once, read
from its last stage."""

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
    issue_chain,
    promote,
    ring,
    stage_ready,
)
from megamoe.kernels.gluon_sm90 import (
    block_index,
    count_busy_tiles,
    next_slot,
    stamp,
    stamp_first,
    store_block,
    wgmma_acc_layout,
    wgrad_block,
)

# Each accumulator's columns: a block's at 128 columns, each half's at 256.
ACC_COLS = gl.constexpr(128)


@gluon.jit
def _wgrad_loader(a_desc, b_desc, a_s_ptr, b_s_ptr, offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs, as_bufs,
                  bs_bufs, P, Q, num_p, num_q, tiles, trace_ptr, EB: gl.constexpr, BY_SIZE: gl.constexpr,
                  TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Loader partition (one warp) of ``wgrad_ws_kernel``: per K-step (one plan tile t of the block's
    expert), the blocks of A (128, 128) at [p0, 128 t] and of B (BN, 128) at [q0, 128 t] through TMA (zeros past the
    expert's rows are in the tensors), and the tile's scales of the block's 128 P-columns (two warpgroup halves) and
    BN Q-columns through ``cp.async``, each thread's copies arriving on the stage's ready barrier. TRACE: its stamps
    (partition 2 of ``gluon_sm90.TRACE_BLOCKS``)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    HALF: gl.constexpr = as_bufs.type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    lanes_a = gl.arange(0, HALF, layout=gl.BlockedLayout([HALF // (32 * num_warps)], [32], [num_warps], [0]))
    lanes_b = gl.arange(0, BN, layout=gl.BlockedLayout([BN // (32 * num_warps)], [32], [num_warps], [0]))
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        stamp(trace_ptr, 2, block_index(tile), 0, TRACE, num_warps)
        e, p0, q0, start, end = wgrad_block(tile, tiles, offsets_ptr, by_size_ptr, num_p, num_q, BM, BN, BY_SIZE)
        first = count_busy_tiles(offsets_ptr, e, EB, BK, num_warps)  # the tiles of the experts before e
        for t in range(first, first + (end - start + BK - 1) // BK):
            s = next_slot(empty, ready, step, nbytes)
            tma.async_copy_global_to_shared(a_desc, [p0, t * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [q0, t * BK], ready.index(s), b_bufs.index(s))
            async_copy.async_copy_global_to_shared(as_bufs.index(2 * s), a_s_ptr + t * P + p0 + lanes_a)
            async_copy.async_copy_global_to_shared(as_bufs.index(2 * s + 1), a_s_ptr + t * P + p0 + HALF + lanes_a)
            async_copy.async_copy_global_to_shared(bs_bufs.index(s), b_s_ptr + t * Q + q0 + lanes_b)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            step += 1
            stamp_first(trace_ptr, 2, block_index(tile), 1, t == first, TRACE, num_warps)
        stamp(trace_ptr, 2, block_index(tile), 2, TRACE, num_warps)


@gluon.jit
def _b_cols(bs_bufs, s, c0: gl.constexpr, like):
    """Stage ``s``'s B scales of the columns ``c0`` .. of ``like`` (a chain or an accumulator), in its column layout."""
    return bs_bufs.index(s).slice(c0, like.type.shape[1]).load(gl.SliceLayout(0, like.type.layout))


@gluon.jit
def _wgrad_scale(as_bufs, bs_bufs, s, c0: gl.constexpr, WG: gl.constexpr, tmp, B_CONST: gl.constexpr):
    """The outer product of stage ``s``'s scales for the chain ``tmp`` of columns ``c0`` ..: A's of this warpgroup's
    rows times B's of the columns, read from the stage, in ``tmp``'s layout; with B_CONST A's alone (B's are applied to
    the block's sum)."""
    scale = as_bufs.index(2 * s + WG).load(gl.SliceLayout(1, tmp.type.layout))[:, None]
    if not B_CONST:
        scale = scale * _b_cols(bs_bufs, s, c0, tmp)[None, :]
    return scale


@gluon.jit
def _wgrad_promote(acc, tmp, as_bufs, bs_bufs, empty, s, WG: gl.constexpr, B_CONST: gl.constexpr,
                   LAST: gl.constexpr):
    """``acc`` + the finished chain ``tmp`` of stage ``s`` times the outer product of the stage's scales
    (``_wgrad_scale``), which is then freed; with B_CONST and LAST (the block's last K-step) the sum times B's column
    scales."""
    scale = _wgrad_scale(as_bufs, bs_bufs, s, 0, WG, tmp, B_CONST)
    if B_CONST and LAST:
        acc = promote(acc, tmp, scale) * _b_cols(bs_bufs, s, 0, tmp)[None, :]
        mbarrier.arrive(empty.index(s), count=1)
    else:
        mbarrier.arrive(empty.index(s), count=1)
        acc = promote(acc, tmp, scale)
    return acc


@gluon.jit
def _wgrad_main_ahead(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, steps, trace_ptr, block, WG: gl.constexpr,
                      B_CONST: gl.constexpr, TRACE: gl.constexpr, acc_layout: gl.constexpr, num_warps: gl.constexpr):
    """A block's ``steps`` (>= 1) K-steps for one warpgroup with the next chain issued before a finished one is
    promoted (the pattern of ``rows._rows_main_narrow``, whose comments say why each wait is
    to zero chains in flight). The scales are read at the promotion, under the next chain: held from the stage's
    ready wait, as the sorted-rows kernel holds its row scales, B's 32 per thread would not fit beside two
    temporaries and the accumulator. TRACE: the block's point 1 (its first stage ready). Returns (the accumulator, the
    next ring step)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HALF: gl.constexpr = as_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    acc = gl.zeros([HALF, BN], gl.float32, acc_layout)
    tmp1 = gl.zeros([HALF, BN], gl.float32, acc_layout)
    s0 = stage_ready(ready, step, STAGES)
    stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
    tmp0 = issue_chain(a_bufs, b_bufs, s0, 0, gl.zeros([HALF, BN], gl.float32, acc_layout), WG)
    for _ in range((steps - 1) // 2):  # [step `step` in flight in tmp0]
        s1 = stage_ready(ready, step + 1, STAGES)
        tmp0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        tmp1 = issue_chain(a_bufs, b_bufs, s1, 0, tmp1, WG)
        acc = _wgrad_promote(acc, tmp0, as_bufs, bs_bufs, empty, s0, WG, B_CONST, False)
        s0 = stage_ready(ready, step + 2, STAGES)
        tmp1 = warpgroup_mma_wait(0, deps=(tmp1, ))
        tmp0 = issue_chain(a_bufs, b_bufs, s0, 0, tmp0, WG)
        acc = _wgrad_promote(acc, tmp1, as_bufs, bs_bufs, empty, s1, WG, B_CONST, False)
        step += 2
    if steps % 2 == 0:  # two steps left: `step` in flight, and the next
        s1 = stage_ready(ready, step + 1, STAGES)
        done0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        tmp1 = issue_chain(a_bufs, b_bufs, s1, 0, tmp1, WG)
        acc = _wgrad_promote(acc, done0, as_bufs, bs_bufs, empty, s0, WG, B_CONST, False)
        tmp1 = warpgroup_mma_wait(0, deps=(tmp1, ))
        acc = _wgrad_promote(acc, tmp1, as_bufs, bs_bufs, empty, s1, WG, B_CONST, True)
        step += 2
    else:  # one step left, in flight
        done0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        acc = _wgrad_promote(acc, done0, as_bufs, bs_bufs, empty, s0, WG, B_CONST, True)
        step += 1
    return acc, step


@gluon.jit
def _wgrad_wide_step(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, acc0, acc1, tmp, c_smem, out_desc, e, p0,
                     q0, trace_ptr, block, WG: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr,
                     B_CONST: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """One K-step of a 256-column block for one warpgroup (``_wgrad_main_wide``): the left chain, its promotion into
    ``acc0``, the right chain, its promotion into ``acc1``, the stage freed. With LAST (the block's last K-step) the
    left half is stored at [e, p0, q0] under the right chain (B_CONST: both halves times B's column scales). TRACE: with
    FIRST (its first), the block's point 1 (its first stage ready). Returns (acc0, acc1, tmp)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HB: gl.constexpr = tmp.type.shape[1]
    s = stage_ready(ready, step, STAGES)
    if FIRST:
        stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
    tmp = issue_chain(a_bufs, b_bufs, s, 0, tmp, WG)
    tmp = warpgroup_mma_wait(0, deps=(tmp, ))
    acc0 = promote(acc0, tmp, _wgrad_scale(as_bufs, bs_bufs, s, 0, WG, tmp, B_CONST))
    tmp = issue_chain(a_bufs, b_bufs, s, HB, tmp, WG)
    if LAST:
        if B_CONST:
            acc0 = acc0 * _b_cols(bs_bufs, s, 0, acc0)[None, :]
        store_block(acc0.to(out_desc.dtype), c_smem, out_desc, e, p0, q0)
    tmp = warpgroup_mma_wait(0, deps=(tmp, ))
    scale = _wgrad_scale(as_bufs, bs_bufs, s, HB, WG, tmp, B_CONST)
    if B_CONST and LAST:
        acc1 = promote(acc1, tmp, scale) * _b_cols(bs_bufs, s, HB, tmp)[None, :]
        mbarrier.arrive(empty.index(s), count=1)
    else:
        mbarrier.arrive(empty.index(s), count=1)
        acc1 = promote(acc1, tmp, scale)
    return acc0, acc1, tmp


@gluon.jit
def _wgrad_main_wide(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, steps, c_smem, out_desc, e, p0, q0,
                     trace_ptr, block, WG: gl.constexpr, B_CONST: gl.constexpr, TRACE: gl.constexpr,
                     acc_layout: gl.constexpr, num_warps: gl.constexpr):
    """A 256-column block's ``steps`` (>= 1) K-steps for one warpgroup, as two column halves of 128 with an
    accumulator each and one temporary (3 x 64 registers per thread: no second temporary fits for issue-ahead, so
    each promotion runs under the other warpgroup's MMAs); the left half stored at [e, p0, q0] under the last K-step's
    right chain; TRACE as ``_wgrad_wide_step``. Returns (the right half's accumulator, to be stored at [e, p0, q0 +
    128]; the next ring step)."""
    HALF: gl.constexpr = as_bufs.type.shape[1]
    acc0 = gl.zeros([HALF, ACC_COLS], gl.float32, acc_layout)
    acc1 = gl.zeros([HALF, ACC_COLS], gl.float32, acc_layout)
    tmp = gl.zeros([HALF, ACC_COLS], gl.float32, acc_layout)  # every chain's destination registers
    if steps == 1:
        acc0, acc1, tmp = _wgrad_wide_step(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, acc0, acc1, tmp,
                                           c_smem, out_desc, e, p0, q0, trace_ptr, block, WG, True, True, B_CONST,
                                           TRACE, num_warps)
    else:
        acc0, acc1, tmp = _wgrad_wide_step(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, acc0, acc1, tmp,
                                           c_smem, out_desc, e, p0, q0, trace_ptr, block, WG, True, False, B_CONST,
                                           TRACE, num_warps)
        for k in range(1, steps - 1):
            acc0, acc1, tmp = _wgrad_wide_step(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step + k, acc0, acc1,
                                               tmp, c_smem, out_desc, e, p0, q0, trace_ptr, block, WG, False, False,
                                               B_CONST, TRACE, num_warps)
        acc0, acc1, tmp = _wgrad_wide_step(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step + steps - 1, acc0,
                                           acc1, tmp, c_smem, out_desc, e, p0, q0, trace_ptr, block, WG, False, True,
                                           B_CONST, TRACE, num_warps)
    return acc1, step + steps


@gluon.jit
def _wgrad_mma_partition(out_desc, c_smem, offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs, as_bufs, bs_bufs,
                         num_p, num_q, tiles, trace_ptr, WG: gl.constexpr, BY_SIZE: gl.constexpr,
                         B_CONST: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """MMA partition ``WG`` (P-rows WG*64 .. WG*64+63 of each block) of ``wgrad_ws_kernel``: per K-step the block's MMA
    into a temporary and its promotion with the outer product of the tile's scales (A's of the 64 rows, B's of the
    block's columns; B_CONST: A's alone, the block's sum times B's); then the bf16 block, 128 columns at a time, through
    the warpgroup's buffer ``c_smem`` and a TMA store that runs on under the MMAs that follow. A block of 128 columns
    promotes under its next K-step's MMA (``_wgrad_main_ahead``); one of 256 runs as two column halves
    (``_wgrad_main_wide``), its right half stored at its end. An expert without rows gets zeros. TRACE: the warpgroup's
    stamps (partition WG of ``gluon_sm90.TRACE_BLOCKS``; a block's end once its stores are issued)."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    HB: gl.constexpr = ACC_COLS
    HALF: gl.constexpr = as_bufs.type.shape[1]
    acc_layout: gl.constexpr = wgmma_acc_layout(HB, num_warps, 32)
    step = 0
    if BN == 2 * HB:
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            stamp(trace_ptr, WG, block_index(tile), 0, TRACE, num_warps)
            e, p0, q0, first, last = wgrad_block(tile, tiles, offsets_ptr, by_size_ptr, num_p, num_q, BM, BN, BY_SIZE)
            steps = (last - first + BK - 1) // BK
            p0 = p0 + WG * HALF
            if steps > 0:
                acc1, step = _wgrad_main_wide(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, steps, c_smem,
                                              out_desc, e, p0, q0, trace_ptr, block_index(tile), WG, B_CONST, TRACE,
                                              acc_layout, num_warps)
                stamp(trace_ptr, WG, block_index(tile), 2, TRACE, num_warps)
                store_block(acc1.to(out_desc.dtype), c_smem, out_desc, e, p0, q0 + HB)
            else:
                zeros = gl.zeros([HALF, HB], gl.float32, acc_layout).to(out_desc.dtype)
                store_block(zeros, c_smem, out_desc, e, p0, q0)
                store_block(zeros, c_smem, out_desc, e, p0, q0 + HB)
            stamp(trace_ptr, WG, block_index(tile), 3, TRACE, num_warps)
    else:
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            stamp(trace_ptr, WG, block_index(tile), 0, TRACE, num_warps)
            e, p0, q0, first, last = wgrad_block(tile, tiles, offsets_ptr, by_size_ptr, num_p, num_q, BM, BN, BY_SIZE)
            steps = (last - first + BK - 1) // BK
            acc = gl.zeros([HALF, HB], gl.float32, acc_layout)
            if steps > 0:
                acc, step = _wgrad_main_ahead(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, steps, trace_ptr,
                                              block_index(tile), WG, B_CONST, TRACE, acc_layout, num_warps)
                stamp(trace_ptr, WG, block_index(tile), 2, TRACE, num_warps)
            store_block(acc.to(out_desc.dtype), c_smem, out_desc, e, p0 + WG * HALF, q0)
            stamp(trace_ptr, WG, block_index(tile), 3, TRACE, num_warps)
    tma.store_wait(0)


@gluon.jit
def wgrad_ws_kernel(a_desc, b_desc, a_s_ptr, b_s_ptr, out_desc, offsets_ptr, P, Q, tiles, trace_ptr, by_size_ptr,
                    EB: gl.constexpr, STAGES: gl.constexpr, BY_SIZE: gl.constexpr, B_CONST: gl.constexpr,
                    TRACE: gl.constexpr, LOADER_WARPS: gl.constexpr, MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                    num_warps: gl.constexpr):
    """a_desc: A (P, NT * 128) fp8 in tile columns (``quant.quantize_tile_cols``), block (BM, BK = 128); b_desc: B (Q,
    NT * 128) fp8, block (BN, BK), BN 128 or 256; a_s (NT, P) and b_s (NT, Q) fp32; out_desc: out (E, P, Q) bf16,
    block (1, BM / 2, 128) (one warpgroup's rows, the columns of one store). Blocks: ``tiles``
    = E * P/BM * Q/BN output blocks, expert-major (the programs at work share one expert's operands in L2), one
    program per SM walking them (BY_SIZE: dealt in order of their experts' rows, ``gluon_sm90.wgrad_block``, by_size_ptr
    ``plan.experts_by_size``'s table). P a multiple of 128, Q of BN; EB a power of two >= E. B_CONST: B's scales
    the same in every tile of an expert (the module's docstring). TRACE: stamps into trace_ptr (int64,
    ``gluon_sm90.TRACE_BLOCKS``)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    # B's scales of the block's Q-columns per stage
    a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty = ring(a_desc, b_desc, 1, BN, STAGES, LOADER_WARPS)
    c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    num_p = P // BM
    num_q = Q // BN
    gl.warp_specialize([
        (_wgrad_mma_partition, (out_desc, c_bufs.index(0), offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs,
                                as_bufs, bs_bufs, num_p, num_q, tiles, trace_ptr, 0, BY_SIZE, B_CONST, TRACE,
                                num_warps)),
        (_wgrad_mma_partition, (out_desc, c_bufs.index(1), offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs,
                                as_bufs, bs_bufs, num_p, num_q, tiles, trace_ptr, 1, BY_SIZE, B_CONST, TRACE,
                                num_warps)),
        (_wgrad_loader, (a_desc, b_desc, a_s_ptr, b_s_ptr, offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs,
                         as_bufs, bs_bufs, P, Q, num_p, num_q, tiles, trace_ptr, EB, BY_SIZE, TRACE, LOADER_WARPS)),
    ], [num_warps, LOADER_WARPS], [MMA_REGS, LOADER_REGS])

