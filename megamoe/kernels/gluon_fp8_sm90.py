"""Persistent, warp-specialized Gluon FP8 GEMM kernels for Hopper (sm90) with blockwise scales: the FP8 path's
sorted-rows GEMM (down projection, dh', dx), its gate/up GEMM + SwiGLU + FP8 quantisation of h, and the optional
FP8 weight gradients (a k-grouped GEMM on operands quantised 128x1 along the tokens: ``fp8_wgrad_ws``).

Formats (shared with the rest of the FP8 path):

- activations (A): ``a_q`` (M, K) ``float8_e4m3fn`` row-major, ``a_s`` (K // 128, M) fp32, k-block-major:
  element (m, k) is ``a_q[m, k] * a_s[k // 128, m]``;
- weights (B): ``w_q`` (E, N, K) ``float8_e4m3fn`` (K-major: Hopper's FP8 ``wgmma`` takes both operands
  K-major only), ``w_s`` (E, N // 128, K // 128) fp32: ``w_q[e, n, k] * w_s[e, n // 128, k // 128]``;
- K and N are multiples of 128; one K-step is one 128-wide scale block, and its product is promoted once:
  ``acc += mma(a_blk, b_blkᵀ) * a_s[kb, rows][:, None] * w_s[e, nb, kb]``. The MMA of a block accumulates
  at the tensor cores' reduced FP8 precision; each promotion brings it into the fp32 accumulator.

Why this shape of kernel. A blockwise-scaled FP8 GEMM must leave the tensor cores after every K-step (the
promotion is 64 FMAs per thread per 128x128 block). Plain Triton runs MMA and promotion back to back and
reached only bf16 speed. Here, as in DeepGEMM's sm90 kernel, the two warpgroups of a 128-row tile are two
partitions of their own (64 rows each), each with its own arrival on the ring's ``empty`` barrier: in one
8-warp partition every barrier arrival brings a partition-wide ``bar.sync`` (Gluon's lowering), which would
hold both warpgroups in phase, both promoting while the tensor cores idle. Split, each warpgroup runs
MMA -> wait -> promote at its own pace; while one promotes, the other's MMA has the tensor cores, so the
two settle out of phase and the promotion hides under the other warpgroup's MMA.

Partitions of each kernel:

- a loader (one warp for the sorted-rows kernel: TMA of both operands; one warpgroup for the up kernel,
  which gathers x's rows by token through 16-byte ``cp.async`` copies beside the weights' TMA) that also
  copies each K-step's scales into shared memory through 4-byte ``cp.async`` copies: the row scales of A
  and the weight block's scale, the latter repeated across 64 entries so that the MMA warps read it with
  the same per-row load as A's. The scales ride in the ring stage with their operands, so they arrive
  ``STAGES`` steps ahead and the MMA warps read them from shared memory, not from global memory, on the
  critical path. Each ready barrier counts the TMA bytes and one ``cp.async`` arrival per loader thread.
- two MMA partitions (4 warps each, rows 0-63 and 64-127 of the tile), with the same code: per K-step
  one asynchronous ``wgmma`` m64n128k32 chain (four of them over BK = 128) into a temporary, wait, free the
  stage, promote. A warpgroup whose 64 rows all lie past its expert's end (the last tile of an expert)
  skips its MMAs and epilogue.

The weight-gradient kernel has the sorted-rows kernel's partitions, with both operands K-major along the tokens
(``quant.quantize_tile_cols``): a K-step is one plan tile of the block's expert, and its promotion multiplies by the
outer product of A's scales of the block's rows and B's of its columns (both copied into the stage). Its warpgroups
issue each K-step's chain before the previous one's promotion, and store their blocks through shared memory by TMA.

See ``fp8_rows_gemm_ws``, ``fp8_up_swiglu_ws`` and ``fp8_wgrad_ws`` for the three launchers.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.env import device_capability, fp8_pow2_scales, sm_count
from megamoe.kernels.gluon_sm90 import (
    barriers,
    block_rows,
    count_busy_tiles,
    expert_end,
    next_slot,
    row_segments,
    staged_layout,
    store_block,
    store_staged,
    tile_block,
    wgrad_block,
)
from megamoe.kernels.plan import BLOCK_M

# Tile: one plan tile of 128 rows (two warpgroups of 64) x 128 output columns, K-steps of one 128-wide scale
# block. 128 columns, not 256: a warpgroup holds its fp32 accumulator and the MMA's temporary, 2 x 64
# registers per thread at 128 columns (the up kernel three, for gate and up); 256 would need 256.
FP8_BM, FP8_BN, FP8_BK = BLOCK_M, 128, 128
SCALE_BLOCK = 128  # elements per scale, along K and along N of the weights and per h group
MATH_WARPS = 4  # per MMA partition: one warpgroup
# Ring stages (ptxas / Triton's figures, of the 227 KB): sorted-rows kernel, 16 KB of A + 16 KB of B +
# 0.75 KB of scales per stage and the epilogue's conversion scratch: 6 stages, 213 KB. Up kernel, 16 KB of x
# + 2 x 16 KB of weights + 1 KB of scales per stage and each MMA warpgroup's 8 KB staging buffer, through which
# its epilogue stores h and the bf16 pre-activations (``gluon_sm90.store_staged``): 4 stages, 212 KB.
ROWS_STAGES = 6
UP_STAGES = 4
UP_STAGES_PREACT = 4
ROWS_LOADER_WARPS = 1
UP_LOADER_WARPS = 4  # one gathering thread per tile row: 128
# Registers per thread (setmaxnreg) of the partitions. A kernel has three warpgroups (the loader's warp sits
# in a warpgroup of its own), 64 K registers: 2 x 128 x 232 + 128 x 40 <= 65 536, the kernel-wide cap at
# launch 65 536 / 384 = 170 -> 168 (Triton gives the first MMA partition what the workers leave). The MMA
# warps of the up kernel hold 3 x 64 accumulator registers; its gathering loader spills below 72.
FP8_MAXNREG = 168
MATH_REGS = 232
ROWS_LOADER_REGS = 40
UP_MATH_REGS = 216
UP_LOADER_REGS = 72  # 8 gathered 16-byte chunks per thread and step: pointers and masks
FP8_MAX = gl.constexpr(448.0)  # largest finite float8_e4m3fn
# The MMA warpgroups' issue pattern, per kernel. False: per K-block MMA, wait, free the stage, promote; a
# warpgroup's promotion overlaps only the other warpgroup's MMA. True: the next block's MMA is issued before this
# block's is waited on (two temporaries in flight per warpgroup; the up kernel, without the registers for two
# 64 x 128 temporaries, runs its MMAs as 64-column chains instead), so each warpgroup keeps the tensor cores busy
# through its own promotions. Measured on the H200 (``python -m tools.fp8``, docs/PERFORMANCE.md): issue-ahead makes
# the sorted-rows GEMMs 3-5% faster and the up kernel 2-5% slower (its 64-column chains read x's rows twice as often).
ROWS_ISSUE_AHEAD = True
UP_ISSUE_AHEAD = False
# Whether the sorted-rows kernel's warpgroups defer a block's stores until their next block's first MMA is issued
# (``_rows_mma_partition``). Measured on the H200 with issue-ahead (``python -m tools.fp8``, docs/PERFORMANCE.md):
# dx 3%, dh' 1% faster, down level.
ROWS_DEFER_EPILOGUE = True
# The sorted-rows kernel's block width where N is a multiple of it (else 128): 256 runs a block as two column
# halves of 128 (``_rows_main_wide``: a temporary beside the two accumulators, so no issue-ahead; its stores deferred
# under its own chains or not, ROWS_DEFER_EPILOGUE) in ROWS_WIDE_STAGES ring stages of 48 KB (A 16 KB, the weight
# block 32 KB): each byte that crosses from L2 feeds 171 FLOPs, against 128 at 128 columns. Measured on the H200
# (``python -m tools.fp8_trace --wide``, docs/PERFORMANCE.md): 2-5% faster than 128 columns at 30B, stores deferred.
ROWS_BLOCK_N = 256
ROWS_WIDE_STAGES = 4
# The FP8 weight-gradient kernel's ring: 33 KB per stage (A, B and their scales) beside each MMA warpgroup's 16 KB
# store buffer: 5 x 33 + 32 = 197 KB. Its block width where Q is a multiple of it (else 128): 256 runs a block as two
# column halves of 128 (``_wgrad_main_wide``, no issue-ahead) in WGRAD_WIDE_STAGES stages of 49.5 KB (B's block 32 KB,
# B's scales 1 KB): 3 x 49.5 + 32 = 181 KB (a fourth stage would need 230). A block's K-steps are its expert's plan
# tiles, ~8 at 16 384 tokens and top-8 of 128 experts: its fixed cost (the start, the last promotion, the stores) is
# paid once per twice the MMAs.
WGRAD_STAGES = 5
WGRAD_BLOCK_N = 256
WGRAD_WIDE_STAGES = 3
# The block trace of the sorted-rows and up kernels (``trace=`` of their launchers, read by ``tools.fp8_trace``): per
# program, per partition (the two MMA warpgroups, then the loader) and per block of its first TRACE_BLOCKS,
# TRACE_POINTS stamps of the SM's cycle counter, then the same points on the global timer (ns). An MMA warpgroup's
# points: the block's start, its first stage ready, its main loop done, its end; the loader's: the block's start, its
# first K-step's copies issued, all of them issued (the fourth unused). Compiled out unless traced (constexpr TRACE).
TRACE_BLOCKS = gl.constexpr(512)
TRACE_POINTS = gl.constexpr(4)
TRACE_PARTS = gl.constexpr(3)


@gluon.constexpr_function
def _acc_layout(rows, cols, num_warps):
    """A warpgroup's ``wgmma`` accumulator layout: ``num_warps`` (4) warps down ``rows`` (64), m16 x ``cols``
    x k32 FP8 instructions."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 32])


@gluon.jit
def _scales(as_bufs, bs_bufs, s, j: gl.constexpr, WG: gl.constexpr, layout: gl.constexpr):
    """This warpgroup's combined scales of stage ``s`` for weight block ``j``: a_s of its 64 rows times the
    weight block's scale (stored repeated), (64,) fp32 in ``layout`` (the accumulator's rows). as_bufs:
    (STAGES * 2, 64), a stage's two row halves; bs_bufs: (STAGES * NB, 64), a stage's NB weight blocks."""
    NB: gl.constexpr = bs_bufs.type.shape[0] // (as_bufs.type.shape[0] // 2)
    return as_bufs.index(s * 2 + WG).load(layout) * bs_bufs.index(s * NB + j).load(layout)


@gluon.jit
def _promote(acc, tmp, scale):
    """``acc + tmp * scale`` (``scale`` broadcast to the block: a row's as ``[:, None]``, one FMA per element),
    pinned by an empty side-effecting asm per register (CUTLASS's ``warpgroup_fence_operand``) before the wgmma
    issued next. Left free, LLVM sinks a promotion past the next chain into the temporary it reads, copies that
    temporary aside and then copies a chain's registers while in flight, for which ptxas serialises every wgmma of
    the kernel (C7514)."""
    return gl.inline_asm_elementwise("", "=r,0", [acc + tmp * scale], dtype=gl.float32, is_pure=False, pack=1)


# ---------------------------------------------------------------------------------------------------------------
# Sorted-rows GEMM: out[r] = [weight[slot(r)] *] sum_k A[r, k] W[e(r)][n, k], rows to slots or kept sorted.
# ---------------------------------------------------------------------------------------------------------------


@gluon.jit
def _blocks_ahead(tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, work):
    """An MMA partition's view of its first two blocks, before its loop: the first one's first row and expert end,
    the second one's expert and first row. The loop then reads each block's expert and first row two blocks ahead
    and its expert's end one block ahead (``block_rows``, ``expert_end``), so that no load's latency stands between
    a block's last MMA and the next one's first. (Read at the block's start, the two dependent loads held both
    warpgroups there: the half-tile test ``first < end`` needs the end before the first MMA is issued.)"""
    e, row0 = block_rows(gl.program_id(0), work, tile_expert_ptr, tile_row_ptr, num_n)
    e_next, row0_next = block_rows(gl.program_id(0) + gl.num_programs(0), work, tile_expert_ptr, tile_row_ptr, num_n)
    return row0, expert_end(offsets_ptr, e, work), e_next, row0_next


@gluon.jit
def _blocks_ahead_of(w, e_next, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, work):
    """At block ``w``'s start, the reads ``_blocks_ahead`` describes: the next block's expert end (its expert
    ``e_next`` read a block ago; the end is used a block later) and the expert and first row of the block after it."""
    end_next = expert_end(offsets_ptr, e_next, work)
    e_after, row0_after = block_rows(w + 2 * gl.num_programs(0), work, tile_expert_ptr, tile_row_ptr, num_n)
    return end_next, e_after, row0_after


@gluon.jit
def _clock(asm: gl.constexpr, like):
    """A clock register read by ``asm`` (the cycle counter or the global timer), one per element of ``like``."""
    return gl.inline_asm_elementwise(asm, "=l,r", [like], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _block_index(w):
    """Block ``w``'s place among this program's blocks (counted from 0): its index in the block trace."""
    return (w - gl.program_id(0)) // gl.num_programs(0)


@gluon.jit
def _stamp(trace_ptr, part: gl.constexpr, block, point: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """With TRACE, point ``point`` of partition ``part``'s block ``block`` (counted from 0 in this program) into the
    block trace (``TRACE_BLOCKS``): the cycle counter and the global timer, stored by one lane."""
    if TRACE:
        one = gl.arange(0, 1, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        at = ((gl.program_id(0) * TRACE_PARTS + part) * TRACE_BLOCKS + block) * (2 * TRACE_POINTS) + point + one
        keep = (block < TRACE_BLOCKS) & (one == 0)
        gl.store(trace_ptr + at, _clock("mov.u64 $0, %clock64;", one), mask=keep)
        gl.store(trace_ptr + at + TRACE_POINTS, _clock("mov.u64 $0, %globaltimer;", one), mask=keep)


@gluon.jit
def _rows_loader(a_desc, w_desc, a_s_ptr, w_s_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, a_bufs, w_bufs,
                 as_bufs, bs_bufs, trace_ptr, M, N_OUT, K, num_n, work, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Loader partition (one warp) of ``_fp8_rows_ws_kernel``: per K-step, A's rows (block (128, 128)) and the
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
        block = _block_index(w)
        _stamp(trace_ptr, 2, block, 0, TRACE, num_warps)
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
            if TRACE:  # noqa: SIM102 (compiled out unless traced; a Triton condition does not short-circuit)
                if kb == 0:
                    _stamp(trace_ptr, 2, block, 1, TRACE, num_warps)
        _stamp(trace_ptr, 2, block, 2, TRACE, num_warps)


@gluon.jit
def _stage_ready(ready, step, STAGES: gl.constexpr):
    """Wait for ring step ``step``'s stage; returns it."""
    s = step % STAGES
    mbarrier.wait(ready.index(s), (step // STAGES) & 1)
    return s


@gluon.jit
def _rows_stage(as_bufs, bs_bufs, ready, step, STAGES: gl.constexpr, WG: gl.constexpr, row_layout: gl.constexpr):
    """Wait for ring step ``step``'s stage and read this warpgroup's scales of it: (the stage, the scales)."""
    s = _stage_ready(ready, step, STAGES)
    return s, _scales(as_bufs, bs_bufs, s, 0, WG, row_layout)


@gluon.jit
def _rows_mma(a_bufs, w_bufs, s, c0: gl.constexpr, tmp, WG: gl.constexpr):
    """Issue stage ``s``'s MMA chain for this warpgroup's 64 rows and the weight block's columns ``c0`` .. ``c0`` +
    128 (asynchronous: four wgmma m64n128k32 over BK = 128) into ``tmp``; returns its pending result."""
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = w_bufs.type.shape[2]  # [STAGES, 1, BN, BK]
    HALF: gl.constexpr = a_bufs.type.shape[1] // 2
    w = w_bufs.index(s).reshape([BN, BK]).slice(c0, tmp.type.shape[1])
    return warpgroup_mma(a_bufs.index(s).slice(WG * HALF, HALF), w.permute((1, 0)), tmp, use_acc=False,
                         is_async=True)


@gluon.jit
def _rows_store(out, out_rows, first, end, n0, out_ptr, N_OUT, num_warps: gl.constexpr):
    """The epilogue's stores of one warpgroup's bf16 block ``out`` (in the accumulator's layout): converted to 16-byte
    row segments and stored through masked pointer stores (rows [first, end): a tile's rows past its expert belong to
    the next tile) into rows ``out_rows`` (int32, in the row segments' row layout), columns n0 .."""
    BN: gl.constexpr = out.type.shape[1]
    out_layout: gl.constexpr = row_segments(BN, 2, num_warps)
    local = first + gl.arange(0, out.type.shape[0], layout=gl.SliceLayout(1, out_layout))
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
    gl.store(out_ptr + out_rows.to(gl.int64)[:, None] * N_OUT + cols[None, :], gl.convert_layout(out, out_layout),
             mask=(local < end)[:, None] & (cols < N_OUT)[None, :])


@gluon.jit
def _rows_store_pending(pend, out, out_rows, first, end, n0, out_ptr, N_OUT, num_warps: gl.constexpr):
    """``_rows_store`` of the block a deferring warpgroup holds, if it holds one (``pend`` nonzero)."""
    if pend != 0:
        _rows_store(out, out_rows, first, end, n0, out_ptr, N_OUT, num_warps)


@gluon.jit
def _rows_main_narrow(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, K, kbs, block, trace_ptr, out_ptr, N_OUT,
                      pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, WG: gl.constexpr,
                      ISSUE_AHEAD: gl.constexpr, DEFER_EPILOGUE: gl.constexpr, TRACE: gl.constexpr,
                      acc_layout: gl.constexpr, num_warps: gl.constexpr):
    """The main loop of a 128-column block for one warpgroup: per K-step the block's MMA chain into a temporary, then
    its promotion into the accumulator (with ISSUE_AHEAD under the next K-step's chain, into a second temporary);
    with DEFER_EPILOGUE the previous block's stores (``pend_*``) under the first chain. Returns (the accumulator,
    the next ring step)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    HALF: gl.constexpr = as_bufs.type.shape[1]
    BN: gl.constexpr = w_bufs.type.shape[2]  # [STAGES, 1, BN, BK]
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    s0, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
    _stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
    # the MMAs' destination registers, reused
    tmp0 = _rows_mma(a_bufs, w_bufs, s0, 0, gl.zeros([HALF, BN], gl.float32, acc_layout), WG)
    if DEFER_EPILOGUE:  # the previous block's stores, under this block's first MMA
        _rows_store_pending(pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, out_ptr, N_OUT,
                            num_warps)
    acc = gl.zeros([HALF, BN], gl.float32, acc_layout)
    if not ISSUE_AHEAD:
        tmp0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        mbarrier.arrive(empty.index(s0), count=1)
        acc = acc + tmp0 * scale0[:, None]  # one FMA per element
        step += 1
        for k in range(BK, K, BK):
            s0, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
            tmp0 = warpgroup_mma_wait(0, deps=(_rows_mma(a_bufs, w_bufs, s0, 0, tmp0, WG), ))
            mbarrier.arrive(empty.index(s0), count=1)
            acc = acc + tmp0 * scale0[:, None]
            step += 1
    else:
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
            tmp1 = _rows_mma(a_bufs, w_bufs, s1, 0, tmp1, WG)
            mbarrier.arrive(empty.index(s0), count=1)
            acc = _promote(acc, tmp0, scale0[:, None])
            s0, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step + 2, STAGES, WG, row_layout)
            tmp1 = warpgroup_mma_wait(0, deps=(tmp1, ))
            tmp0 = _rows_mma(a_bufs, w_bufs, s0, 0, tmp0, WG)
            mbarrier.arrive(empty.index(s1), count=1)
            acc = _promote(acc, tmp1, scale1[:, None])
            step += 2
        if kbs % 2 == 0:  # two blocks left: `step` in flight, and the next
            s1, scale1 = _rows_stage(as_bufs, bs_bufs, ready, step + 1, STAGES, WG, row_layout)
            done0 = warpgroup_mma_wait(0, deps=(tmp0, ))
            tmp1 = _rows_mma(a_bufs, w_bufs, s1, 0, tmp1, WG)
            mbarrier.arrive(empty.index(s0), count=1)
            acc = _promote(acc, done0, scale0[:, None])
            tmp1 = warpgroup_mma_wait(0, deps=(tmp1, ))
            mbarrier.arrive(empty.index(s1), count=1)
            acc = _promote(acc, tmp1, scale1[:, None])
            step += 2
        else:  # one block left, in flight
            done0 = warpgroup_mma_wait(0, deps=(tmp0, ))
            mbarrier.arrive(empty.index(s0), count=1)
            acc = _promote(acc, done0, scale0[:, None])
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
                    n0, out_ptr, N_OUT, WG: gl.constexpr, STORE_LEFT: gl.constexpr, WEIGHTED: gl.constexpr,
                    num_warps: gl.constexpr):
    """One K-step of a 256-column block for one warpgroup (``_rows_main_wide``): the left chain, its promotion into
    ``acc0``, the right chain, its promotion into ``acc1``, the stage freed; with STORE_LEFT (the block's last
    K-step) the left half converted before the right chain is issued and stored under it. Returns (acc0, acc1,
    tmp)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HB: gl.constexpr = tmp.type.shape[1]
    row_layout: gl.constexpr = gl.SliceLayout(1, tmp.type.layout)
    s, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
    scale1 = _scales(as_bufs, bs_bufs, s, 1, WG, row_layout)
    tmp = warpgroup_mma_wait(0, deps=(_rows_mma(a_bufs, w_bufs, s, 0, tmp, WG), ))
    acc0 = acc0 + tmp * scale0[:, None]
    if STORE_LEFT:
        out0 = _rows_left_out(acc0, wt, out_ptr, WEIGHTED)
        tmp = _rows_mma(a_bufs, w_bufs, s, HB, tmp, WG)
        _rows_store(out0, out_rows, first, end, n0, out_ptr, N_OUT, num_warps)
    else:
        tmp = _rows_mma(a_bufs, w_bufs, s, HB, tmp, WG)
    tmp = warpgroup_mma_wait(0, deps=(tmp, ))
    mbarrier.arrive(empty.index(s), count=1)
    acc1 = acc1 + tmp * scale1[:, None]
    return acc0, acc1, tmp


@gluon.jit
def _rows_main_wide(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, kbs, block, trace_ptr, wt, out_rows, first,
                    end, n0, out_ptr, N_OUT, pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, WG: gl.constexpr,
                    DEFER: gl.constexpr, WEIGHTED: gl.constexpr, TRACE: gl.constexpr, acc_layout: gl.constexpr,
                    num_warps: gl.constexpr):
    """The main loop of a 256-column block for one warpgroup: per K-step the MMA chain of the weight block's left
    128 columns into the temporary, wait, its promotion into the left accumulator; the right half's likewise; the
    stage freed (``_rows_wide_step``). Two accumulators and one temporary (3 x 64 registers per thread): no second
    temporary fits for a chain to be issued ahead of a promotion, so the promotions run under the other warpgroup's
    MMAs. With DEFER the stores run under this warpgroup's chains: the previous block's right half (``pend_*``)
    under the first K-step's left chain, this block's left half under the last K-step's right chain (the first and
    last K-steps peeled off the loop, so that neither store's registers are held through it). Returns (left,
    right)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HALF: gl.constexpr = as_bufs.type.shape[1]
    HB: gl.constexpr = w_bufs.type.shape[2] // 2
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    acc0 = gl.zeros([HALF, HB], gl.float32, acc_layout)
    acc1 = gl.zeros([HALF, HB], gl.float32, acc_layout)
    tmp = gl.zeros([HALF, HB], gl.float32, acc_layout)  # both chains' destination registers
    if DEFER:
        s, scale0 = _rows_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
        _stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
        scale1 = _scales(as_bufs, bs_bufs, s, 1, WG, row_layout)
        tmp = _rows_mma(a_bufs, w_bufs, s, 0, tmp, WG)
        _rows_store_pending(pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, out_ptr, N_OUT, num_warps)
        tmp = warpgroup_mma_wait(0, deps=(tmp, ))
        acc0 = tmp * scale0[:, None]
        out0 = _rows_left_out(acc0, wt, out_ptr, WEIGHTED)  # (stored here only if this is the last K-step)
        tmp = _rows_mma(a_bufs, w_bufs, s, HB, tmp, WG)
        if kbs == 1:
            _rows_store(out0, out_rows, first, end, n0, out_ptr, N_OUT, num_warps)
        tmp = warpgroup_mma_wait(0, deps=(tmp, ))
        mbarrier.arrive(empty.index(s), count=1)
        acc1 = tmp * scale1[:, None]
        for kb in range(1, kbs - 1):
            acc0, acc1, tmp = _rows_wide_step(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step + kb, acc0, acc1,
                                              tmp, wt, out_rows, first, end, n0, out_ptr, N_OUT, WG, False, WEIGHTED,
                                              num_warps)
        if kbs > 1:
            acc0, acc1, tmp = _rows_wide_step(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step + kbs - 1, acc0,
                                              acc1, tmp, wt, out_rows, first, end, n0, out_ptr, N_OUT, WG, True,
                                              WEIGHTED, num_warps)
    else:
        for kb in range(kbs):
            if TRACE:  # noqa: SIM102 (compiled out unless traced)
                if kb == 0:  # (before the stage's wait, where the deferred pattern stamps after it)
                    _stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
            acc0, acc1, tmp = _rows_wide_step(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step + kb, acc0, acc1,
                                              tmp, wt, out_rows, first, end, n0, out_ptr, N_OUT, WG, False, WEIGHTED,
                                              num_warps)
    return acc0, acc1


@gluon.jit
def _rows_mma_partition(out_ptr, weights_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty,
                        a_bufs, w_bufs, as_bufs, bs_bufs, trace_ptr, N_OUT, K, num_n, work, WG: gl.constexpr,
                        WEIGHTED: gl.constexpr, TO_SLOTS: gl.constexpr, ISSUE_AHEAD: gl.constexpr,
                        DEFER_EPILOGUE: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """MMA partition ``WG`` (rows WG*64 .. WG*64+63 of each tile) of ``_fp8_rows_ws_kernel``: per K-step the
    block's MMA into a temporary, then the promotion into the fp32 accumulator (with ISSUE_AHEAD, under the
    next block's MMA into a second temporary); then the weighted bf16 block's stores (``_rows_store``) to sorted
    rows or to slots. DEFER_EPILOGUE: a block's stores wait until the warpgroup's next block has issued its first
    MMA, and run under it (the last block's after the loop); else they run at once, with the tensor cores idle
    unless the other warpgroup's MMAs have them. A block of 256 columns (``ROWS_BLOCK_N``) runs as two column
    halves of 128, each with its own accumulator, without issue-ahead (``_rows_main_wide``); DEFER_EPILOGUE: its
    left half stored under its last chain, its right half under the next block's first."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    NH: gl.constexpr = bs_bufs.type.shape[0] // STAGES  # column halves of the block: its weight scale blocks
    BN: gl.constexpr = w_bufs.type.shape[2] // NH  # [STAGES, 1, NH * BN, BK]: BN columns per accumulator
    HALF: gl.constexpr = bs_bufs.type.shape[1]
    acc_layout: gl.constexpr = _acc_layout(HALF, BN, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    seg_rows: gl.constexpr = gl.SliceLayout(1, row_segments(BN, 2, num_warps))
    kbs = K // BK
    step = 0
    # The stores a block has left to do (DEFER_EPILOGUE): its bf16 block, output rows, row range and first column
    pend = 0
    pend_out = gl.zeros([HALF, BN], out_ptr.dtype.element_ty, acc_layout)
    pend_rows = gl.zeros([HALF], gl.int32, seg_rows)
    pend_first = 0
    pend_end = 0
    pend_n0 = 0
    row0, end, e_next, row0_next = _blocks_ahead(tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, work)
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = _block_index(w)
        _stamp(trace_ptr, WG, block, 0, TRACE, num_warps)
        end_next, e_after, row0_after = _blocks_ahead_of(w, e_next, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n,
                                                         work)
        n0 = (w % num_n) * (NH * BN)
        first = row0 + WG * HALF
        if first < end:
            # The epilogue's row data, loaded now so that its latency hides under the main loop.
            out_rows = first + gl.arange(0, HALF, layout=seg_rows)
            if TO_SLOTS:
                out_rows = gl.load(row_slot_ptr + out_rows, mask=out_rows < end, other=0)
            if WEIGHTED:
                acc_rows = first + gl.arange(0, HALF, layout=row_layout)
                acc_slots = gl.load(row_slot_ptr + acc_rows, mask=acc_rows < end, other=0)
                wt = gl.load(weights_ptr + acc_slots, mask=acc_rows < end, other=0.0)
            else:
                wt = 0.0  # (unused)
            if NH == 2:
                acc, acc1 = _rows_main_wide(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, kbs, block,
                                            trace_ptr, wt, out_rows, first, end, n0, out_ptr, N_OUT, pend, pend_out,
                                            pend_rows, pend_first, pend_end, pend_n0, WG, DEFER_EPILOGUE, WEIGHTED,
                                            TRACE, acc_layout, num_warps)
                step += kbs
                _stamp(trace_ptr, WG, block, 2, TRACE, num_warps)
                if WEIGHTED:
                    acc1 = acc1 * wt[:, None]
                if DEFER_EPILOGUE:  # the left half is stored; the right one under the next block's first chain
                    pend = 1
                    pend_out = acc1.to(out_ptr.dtype.element_ty)
                    pend_rows = out_rows
                    pend_first = first
                    pend_end = end
                    pend_n0 = n0 + BN
                else:
                    if WEIGHTED:
                        acc = acc * wt[:, None]
                    _rows_store(acc.to(out_ptr.dtype.element_ty), out_rows, first, end, n0, out_ptr, N_OUT, num_warps)
                    _rows_store(acc1.to(out_ptr.dtype.element_ty), out_rows, first, end, n0 + BN, out_ptr, N_OUT,
                                num_warps)
            else:
                acc, step = _rows_main_narrow(a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty, step, K, kbs, block,
                                              trace_ptr, out_ptr, N_OUT, pend, pend_out, pend_rows, pend_first,
                                              pend_end, pend_n0, WG, ISSUE_AHEAD, DEFER_EPILOGUE, TRACE, acc_layout,
                                              num_warps)
                _stamp(trace_ptr, WG, block, 2, TRACE, num_warps)
                if WEIGHTED:
                    acc = acc * wt[:, None]
                out = acc.to(out_ptr.dtype.element_ty)
                if DEFER_EPILOGUE:
                    pend = 1
                    pend_out = out
                    pend_rows = out_rows
                    pend_first = first
                    pend_end = end
                    pend_n0 = n0
                else:
                    _rows_store(out, out_rows, first, end, n0, out_ptr, N_OUT, num_warps)
        else:  # all 64 rows past the expert: hand the stages back untouched
            if DEFER_EPILOGUE:
                _rows_store_pending(pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, out_ptr, N_OUT, num_warps)
                pend = 0
            step = _pass_stages(ready, empty, step, K, BK)
        _stamp(trace_ptr, WG, block, 3, TRACE, num_warps)
        row0, end, e_next, row0_next = row0_next, end_next, e_after, row0_after
    if DEFER_EPILOGUE:
        _rows_store_pending(pend, pend_out, pend_rows, pend_first, pend_end, pend_n0, out_ptr, N_OUT, num_warps)


@gluon.jit
def _ring(a_desc, b_desc, B_SCALE_ROWS: gl.constexpr, B_SCALES: gl.constexpr, STAGES: gl.constexpr,
          LOADER_WARPS: gl.constexpr):
    """The shared memory and barriers of an FP8 GEMM's ring of ``STAGES`` K-steps, for two MMA warpgroups and a
    loader of ``LOADER_WARPS``: the A and B blocks, A's row scales per stage (the two warpgroups' halves,
    [STAGES * 2, BM / 2]), ``B_SCALE_ROWS`` rows of ``B_SCALES`` fp32 of B's scales per stage ([STAGES *
    B_SCALE_ROWS, B_SCALES]), and the ready (the TMA bytes' arrival and each loader thread's ``cp.async``) and empty
    (one arrival per MMA warpgroup) barriers."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    scale_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # of one indexed row
    as_bufs = gl.allocate_shared_memory(gl.float32, [STAGES * 2, a_desc.block_type.shape[0] // 2], scale_layout)
    bs_bufs = gl.allocate_shared_memory(gl.float32, [STAGES * B_SCALE_ROWS, B_SCALES], scale_layout)
    return a_bufs, b_bufs, as_bufs, bs_bufs, barriers(STAGES, 1 + 32 * LOADER_WARPS), barriers(STAGES, 2)


@gluon.jit
def _fp8_rows_ws_kernel(a_desc, w_desc, a_s_ptr, w_s_ptr, out_ptr, weights_ptr, row_slot_ptr, offsets_ptr,
                        tile_expert_ptr, tile_row_ptr, trace_ptr, M, N_OUT, K, E, EB: gl.constexpr,
                        TILE_M: gl.constexpr, WEIGHTED: gl.constexpr, TO_SLOTS: gl.constexpr, ISSUE_AHEAD: gl.constexpr,
                        DEFER_EPILOGUE: gl.constexpr, TRACE: gl.constexpr, STAGES: gl.constexpr,
                        LOADER_WARPS: gl.constexpr,
                        MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """a_desc: A (M, K) fp8 in sorted rows, block (TILE_M, BK); w_desc: W (E, N_OUT, K) fp8, block (1, BN, BK);
    a_s (K // 128, M) and w_s (E, N_OUT // 128, K // 128) fp32; out (M, N_OUT) bf16: row r of the product
    into row ``row_slot[r]`` (TO_SLOTS) or r, times ``weights[row_slot[r]]`` (WEIGHTED, fp32 by slot).
    Blocks: the plan's busy tiles (EB: a power of two >= E) times the N-blocks, one program per SM walking
    them. num_warps: one warpgroup (the first MMA partition); the kernel adds the second and the loader.
    ISSUE_AHEAD, DEFER_EPILOGUE: the MMA warpgroups' issue pattern and when their stores run
    (``_rows_mma_partition``); TRACE: stamps into trace_ptr (int64, see ``TRACE_BLOCKS``)."""
    BN: gl.constexpr = w_desc.block_type.shape[1]
    num_n = N_OUT // BN
    work = count_busy_tiles(offsets_ptr, E, EB, TILE_M, num_warps) * num_n
    # The weight block's scales per stage (one per 128 of its columns), each repeated across 64
    a_bufs, w_bufs, as_bufs, bs_bufs, ready, empty = _ring(a_desc, w_desc, BN // 128, a_desc.block_type.shape[0] // 2,
                                                           STAGES, LOADER_WARPS)
    gl.warp_specialize([
        (_rows_mma_partition, (out_ptr, weights_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready,
                               empty, a_bufs, w_bufs, as_bufs, bs_bufs, trace_ptr, N_OUT, K, num_n, work, 0, WEIGHTED,
                               TO_SLOTS, ISSUE_AHEAD, DEFER_EPILOGUE, TRACE, num_warps)),
        (_rows_mma_partition, (out_ptr, weights_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready,
                               empty, a_bufs, w_bufs, as_bufs, bs_bufs, trace_ptr, N_OUT, K, num_n, work, 1, WEIGHTED,
                               TO_SLOTS, ISSUE_AHEAD, DEFER_EPILOGUE, TRACE, num_warps)),
        (_rows_loader, (a_desc, w_desc, a_s_ptr, w_s_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, a_bufs, w_bufs,
                        as_bufs, bs_bufs, trace_ptr, M, N_OUT, K, num_n, work, TRACE, LOADER_WARPS)),
    ], [num_warps, LOADER_WARPS], [MMA_REGS, LOADER_REGS])


# ---------------------------------------------------------------------------------------------------------------
# Up projection: h = silu(x W1gᵀ) * (x W1uᵀ) over gathered x rows, quantised to FP8 per row and 128 columns.
# ---------------------------------------------------------------------------------------------------------------


@gluon.jit
def _up_loader(x_ptr, x_s_ptr, w13_desc, w13_s_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready,
               empty, x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, trace_ptr, T, D, I, top_k, num_n, work,
               TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Loader partition (one warpgroup) of ``_fp8_up_ws_kernel``: per K-step, the gate and up weight blocks
    through TMA; the tile's x rows gathered from their tokens (``row_slot[r] // top_k``) through 16-byte
    ``cp.async`` copies and their scales ``x_s[kb, token]`` through 4-byte ones (rows past the expert
    zero-filled); the gate and up blocks' scales, each repeated into 64 entries. TRACE: the sorted-rows loader's
    stamps (``TRACE_BLOCKS``)."""
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = w13_desc.block_type.shape[2]
    HALF: gl.constexpr = bs_bufs.type.shape[1]
    x_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])  # 16 fp8 = 16 bytes
    # 64 entries over the warpgroup: each thread copies one of x's row scales or one weight scale (some twice)
    s_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    nbytes: gl.constexpr = 2 * w13_desc.block_type.nbytes
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
    lanes = gl.arange(0, HALF, layout=s_layout)
    same = gl.zeros([HALF], gl.int32, s_layout)
    kbs = D // BK
    nbs = I // BN
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = _block_index(w)
        _stamp(trace_ptr, 2, block, 0, TRACE, num_warps)
        e, row0, n0 = tile_block(w, tile_expert_ptr, tile_row_ptr, num_n, BN)
        end = gl.load(offsets_ptr + e + 1)
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, x_layout))
        rmask = rows < end
        tok = (gl.load(row_slot_ptr + rows, mask=rmask, other=0) // top_k).to(gl.int64)
        # D // 16 * 16 = D (a multiple of 128), written so that the compiler sees 16-byte rows even where Triton
        # has not specialised D as 16-divisible: cp.async has no 1-byte form
        x_ptrs = x_ptr + tok[:, None] * (D // 16 * 16) + cols[None, :]
        x_mask = rmask[:, None] & (cols < BK)[None, :]
        rows0 = row0 + lanes  # the first warpgroup's rows; rows0 + HALF the second's
        rows1 = rows0 + HALF
        tok0 = gl.load(row_slot_ptr + rows0, mask=rows0 < end, other=0) // top_k
        tok1 = gl.load(row_slot_ptr + rows1, mask=rows1 < end, other=0) // top_k
        # w13_s (E, 2I // 128, D // 128): gate block n0 // 128, up block I // 128 + n0 // 128
        g_scale = w13_s_ptr + (e * 2 * nbs + n0 // BN) * kbs + same
        u_scale = g_scale + nbs * kbs
        for kb in range(kbs):
            s = next_slot(empty, ready, step, nbytes)
            tma.async_copy_global_to_shared(w13_desc, [e, 0, n0, kb * BK], ready.index(s), g_bufs.index(s))
            tma.async_copy_global_to_shared(w13_desc, [e, 1, n0, kb * BK], ready.index(s), u_bufs.index(s))
            async_copy.async_copy_global_to_shared(x_bufs.index(s), x_ptrs + kb * BK, mask=x_mask)
            async_copy.async_copy_global_to_shared(as_bufs.index(2 * s), x_s_ptr + kb * T + tok0, mask=rows0 < end)
            async_copy.async_copy_global_to_shared(as_bufs.index(2 * s + 1), x_s_ptr + kb * T + tok1,
                                                   mask=rows1 < end)
            async_copy.async_copy_global_to_shared(bs_bufs.index(2 * s), g_scale + kb)
            async_copy.async_copy_global_to_shared(bs_bufs.index(2 * s + 1), u_scale + kb)
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            step += 1
            if TRACE:  # noqa: SIM102 (compiled out unless traced)
                if kb == 0:
                    _stamp(trace_ptr, 2, block, 1, TRACE, num_warps)
        _stamp(trace_ptr, 2, block, 2, TRACE, num_warps)


@gluon.jit
def _up_stage(as_bufs, bs_bufs, ready, step, STAGES: gl.constexpr, WG: gl.constexpr, row_layout: gl.constexpr):
    """Wait for ring step ``step``'s stage and read this warpgroup's scales of it: (the stage, the gate block's
    scales, the up block's)."""
    s = _stage_ready(ready, step, STAGES)
    fence_async_shared()  # x arrived through cp.async (generic proxy); the MMAs read it (async proxy)
    return s, _scales(as_bufs, bs_bufs, s, 0, WG, row_layout), _scales(as_bufs, bs_bufs, s, 1, WG, row_layout)


@gluon.jit
def _up_mma(x_bufs, w_bufs, s, c0: gl.constexpr, tmp, WG: gl.constexpr):
    """Issue stage ``s``'s MMA chain (asynchronous, over BK = 128) of this warpgroup's 64 x rows and columns
    ``c0`` .. ``c0`` + tmp's width of weight block ``w_bufs[s]`` (gate or up) into ``tmp``; returns its pending
    result."""
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = w_bufs.type.shape[3]  # [STAGES, 1, 1, BN, BK]
    HALF: gl.constexpr = x_bufs.type.shape[1] // 2
    w = w_bufs.index(s).reshape([BN, BK]).slice(c0, tmp.type.shape[1])
    return warpgroup_mma(x_bufs.index(s).slice(WG * HALF, HALF), w.permute((1, 0)), tmp, use_acc=False,
                         is_async=True)


@gluon.jit
def _up_chains_after_first(x_bufs, g_bufs, u_bufs, s, ta, tb, acc_gl, acc_gh, acc_ul, scale_g, scale_u,
                           WG: gl.constexpr):
    """The issue-ahead up kernel's block of stage ``s`` after its first chain (the gate's left 64 columns, in
    flight in ``ta``): each chain done, the next issued, then the done one promoted under it; returns with the
    last chain (the up block's right 64 columns) in flight in ``tb``."""
    HB: gl.constexpr = tb.type.shape[1]  # (ta: pending, no shape of its own)
    ta = warpgroup_mma_wait(0, deps=(ta, ))
    tb = _up_mma(x_bufs, g_bufs, s, HB, tb, WG)
    acc_gl = _promote(acc_gl, ta, scale_g[:, None])
    tb = warpgroup_mma_wait(0, deps=(tb, ))
    ta = _up_mma(x_bufs, u_bufs, s, 0, ta, WG)
    acc_gh = _promote(acc_gh, tb, scale_g[:, None])
    ta = warpgroup_mma_wait(0, deps=(ta, ))
    tb = _up_mma(x_bufs, u_bufs, s, HB, tb, WG)
    acc_ul = _promote(acc_ul, ta, scale_u[:, None])
    return ta, tb, acc_gl, acc_gh, acc_ul


@gluon.jit
def _up_mma_partition(h_q_ptr, h_s_ptr, preact_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, x_bufs,
                      g_bufs, u_bufs, as_bufs, bs_bufs, staging, trace_ptr, N, D, I, num_n, work, WG: gl.constexpr,
                      PREACT: gl.constexpr, H_OUT: gl.constexpr, ISSUE_AHEAD: gl.constexpr, POW2: gl.constexpr,
                      TRACE: gl.constexpr, num_warps: gl.constexpr):
    """MMA partition ``WG`` (rows WG*64 .. WG*64+63 of each tile) of ``_fp8_up_ws_kernel``: per K-step the gate
    block's MMA, its promotion, the up block's MMA (into the same temporary) and its promotion (with
    ISSUE_AHEAD, 64-column chains, each promoted under the next); then h = silu(g) * u in fp32, quantised per
    row over the block's 128 columns into h_q / h_s (POW2: power-of-two scales), and with PREACT g and u rounded
    to bf16 into ``preact``. TRACE: the sorted-rows MMA partitions' stamps (``TRACE_BLOCKS``)."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[3]  # [STAGES, 1, 1, BN, BK]
    HALF: gl.constexpr = bs_bufs.type.shape[1]
    HB: gl.constexpr = BN // 2
    acc_layout: gl.constexpr = _acc_layout(HALF, BN, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    half_layout: gl.constexpr = _acc_layout(HALF, HB, num_warps)
    half_rows: gl.constexpr = gl.SliceLayout(1, half_layout)
    step = 0
    row0, end, e_next, row0_next = _blocks_ahead(tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, work)
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = _block_index(w)
        _stamp(trace_ptr, WG, block, 0, TRACE, num_warps)
        end_next, e_after, row0_after = _blocks_ahead_of(w, e_next, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n,
                                                         work)
        n0 = (w % num_n) * BN
        first = row0 + WG * HALF
        if first < end:
            if not ISSUE_AHEAD:
                acc_g = gl.zeros([HALF, BN], gl.float32, acc_layout)
                acc_u = gl.zeros([HALF, BN], gl.float32, acc_layout)
                tmp = gl.zeros([HALF, BN], gl.float32, acc_layout)  # both MMAs' destination registers
                for k in range(0, D, BK):
                    s, scale_g, scale_u = _up_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
                    if TRACE:  # noqa: SIM102 (compiled out unless traced)
                        if k == 0:
                            _stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
                    tmp = warpgroup_mma_wait(0, deps=(_up_mma(x_bufs, g_bufs, s, 0, tmp, WG), ))
                    acc_g = acc_g + tmp * scale_g[:, None]
                    tmp = warpgroup_mma_wait(0, deps=(_up_mma(x_bufs, u_bufs, s, 0, tmp, WG), ))
                    mbarrier.arrive(empty.index(s), count=1)
                    acc_u = acc_u + tmp * scale_u[:, None]
                    step += 1
                _stamp(trace_ptr, WG, block, 2, TRACE, num_warps)
                _up_epilogue(acc_g, acc_u, staging.index(WG), h_q_ptr, h_s_ptr, preact_ptr, first, end, n0, N, I,
                             PREACT, H_OUT, POW2, num_warps)
            else:
                # Two 64 x 128 temporaries beside the two accumulators do not fit (4 x 64 registers per
                # thread, of the 216 the gathering loader leaves), so each product runs as two 64-column
                # chains into two 64 x 64 temporaries (ta, tb: 2 x 32 registers): the four chains of a block
                # alternate between them, each done chain's promotion runs under the next chain, and the
                # last chain of a block overlaps the first of the next, so that the warpgroup keeps the tensor
                # cores busy through its promotions. (A chain is read only after a wait to zero in flight:
                # ptxas serialises every wgmma if a chain carried across the loop's back edge is retired by a
                # wait(1) and read, C7514.) The stage is freed when the block's last chain is done: a
                # warpgroup holds two stages at most (of four). The cost: x's 64 rows are read from shared
                # memory four times per block instead of twice.
                acc_gl = gl.zeros([HALF, HB], gl.float32, half_layout)
                acc_gh = gl.zeros([HALF, HB], gl.float32, half_layout)
                acc_ul = gl.zeros([HALF, HB], gl.float32, half_layout)
                acc_uh = gl.zeros([HALF, HB], gl.float32, half_layout)
                ta = gl.zeros([HALF, HB], gl.float32, half_layout)
                tb = gl.zeros([HALF, HB], gl.float32, half_layout)
                s, scale_g, scale_u = _up_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, half_rows)
                _stamp(trace_ptr, WG, block, 1, TRACE, num_warps)
                ta = _up_mma(x_bufs, g_bufs, s, 0, ta, WG)
                for k in range(BK, D, BK):  # [block `step`'s first chain in flight in ta]
                    ta, tb, acc_gl, acc_gh, acc_ul = _up_chains_after_first(x_bufs, g_bufs, u_bufs, s, ta, tb, acc_gl,
                                                                            acc_gh, acc_ul, scale_g, scale_u, WG)
                    s1, scale_g1, scale_u1 = _up_stage(as_bufs, bs_bufs, ready, step + 1, STAGES, WG, half_rows)
                    tb = warpgroup_mma_wait(0, deps=(tb, ))
                    ta = _up_mma(x_bufs, g_bufs, s1, 0, ta, WG)
                    mbarrier.arrive(empty.index(s), count=1)
                    acc_uh = _promote(acc_uh, tb, scale_u[:, None])
                    s, scale_g, scale_u = s1, scale_g1, scale_u1
                    step += 1
                ta, tb, acc_gl, acc_gh, acc_ul = _up_chains_after_first(x_bufs, g_bufs, u_bufs, s, ta, tb, acc_gl,
                                                                        acc_gh, acc_ul, scale_g, scale_u, WG)
                tb = warpgroup_mma_wait(0, deps=(tb, ))
                mbarrier.arrive(empty.index(s), count=1)
                acc_uh = _promote(acc_uh, tb, scale_u[:, None])
                step += 1
                _stamp(trace_ptr, WG, block, 2, TRACE, num_warps)
                _up_epilogue_halves(acc_gl, acc_gh, acc_ul, acc_uh, staging.index(WG), h_q_ptr, h_s_ptr, preact_ptr,
                                    first, end, n0, N, I, PREACT, H_OUT, POW2, num_warps)
        else:  # all 64 rows past the expert: hand the stages back untouched
            step = _pass_stages(ready, empty, step, D, BK)
        _stamp(trace_ptr, WG, block, 3, TRACE, num_warps)
        row0, end, e_next, row0_next = row0_next, end_next, e_after, row0_after


@gluon.jit
def _pass_stages(ready, empty, step, K, BK: gl.constexpr):
    """A warpgroup with no rows in a block: wait for each of the block's K-steps and hand its stage back unread (the
    loader filled it for both warpgroups); returns the next ring step."""
    STAGES: gl.constexpr = empty.type.shape[0]
    for _ in range(0, K, BK):
        mbarrier.arrive(empty.index(_stage_ready(ready, step, STAGES)), count=1)
        step += 1
    return step


@gluon.jit
def _up_h(acc_g, acc_u, stage, preact_ptr, first, end, c0, I, PREACT: gl.constexpr, num_warps: gl.constexpr):
    """h = silu(g) * u (fp32) of one warpgroup's 64 rows and the columns c0 .. of g and u; with PREACT g and u
    (bf16) into preact (N, 2I) at columns c0 and I + c0 (rows [first, end)), through the warpgroup's staging
    buffer ``stage`` (``gluon_sm90.store_staged``)."""
    if PREACT:
        store_staged(acc_g.to(gl.bfloat16), stage, preact_ptr, first, end, c0, 2 * I, I, num_warps)
        store_staged(acc_u.to(gl.bfloat16), stage, preact_ptr + I, first, end, c0, 2 * I, I, num_warps)
    return acc_g / (1.0 + gl.exp(-acc_g)) * acc_u


@gluon.jit
def _h_scales(amax, POW2: gl.constexpr):
    """The rows' h scales and the factors h is multiplied by, as ``quant.scale_and_inverse``: amax / 448 and
    448 / amax (IEEE), or with POW2 amax / 448 rounded up to a power of two and its exact inverse."""
    s = gl.div_rn(amax, gl.full(amax.type.shape, FP8_MAX, gl.float32, amax.type.layout))
    if POW2:
        bits = s.to(gl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(gl.int32)
        return (exponent << 23).to(gl.float32, bitcast=True), ((254 - exponent) << 23).to(gl.float32, bitcast=True)
    return s, gl.div_rn(gl.full(amax.type.shape, FP8_MAX, gl.float32, amax.type.layout), amax)


@gluon.jit
def _quantize_h(h, inv):
    """fp8(clamp(h * inv[row], ±448)), rounded to nearest even by the GPU's conversion (cvt.rn.satfinite.e4m3x2.f32,
    as ``kernels.quant.to_e4m3`` converts on the GPU)."""
    return gl.minimum(gl.maximum(h * inv[:, None], -FP8_MAX), FP8_MAX).to(gl.float8e4nv)


@gluon.jit
def _store_h_s(scale, h_s_ptr, first, end, group, N):
    """The rows' h scales into h_s (I // 128, N) at ``group``, rows [first, end)."""
    HALF: gl.constexpr = scale.type.shape[0]
    s_rows = first + gl.arange(0, HALF, layout=scale.type.layout)
    gl.store(h_s_ptr + group * N + s_rows, scale, mask=s_rows < end)


@gluon.jit
def _up_epilogue(acc_g, acc_u, stage, h_q_ptr, h_s_ptr, preact_ptr, first, end, n0, N, I, PREACT: gl.constexpr,
                 H_OUT: gl.constexpr, POW2: gl.constexpr, num_warps: gl.constexpr):
    """One warpgroup's (64, 128) block of h = silu(g) * u, quantised as the FP8 path quantises everywhere:
    amax = max(max|h|, 1e-12) over the row's 128 columns, q = fp8(clamp(h * (448 / amax), ±448)) (round to
    nearest even), scale amax / 448 (both divisions IEEE; POW2: ``_h_scales``); q into h_q (N, I) rows [first,
    end), the scale into h_s (I // 128, N); with PREACT g and u (bf16) into preact (N, 2I) at columns n0 and
    I + n0. Without H_OUT only the latter (the FP8 backward's recompute)."""
    BN: gl.constexpr = acc_g.type.shape[1]
    h = _up_h(acc_g, acc_u, stage, preact_ptr, first, end, n0, I, PREACT, num_warps)
    if H_OUT:
        scale, inv = _h_scales(gl.maximum(gl.max(gl.abs(h), axis=1), 1e-12), POW2)
        q = _quantize_h(h, inv)
        _store_h_s(scale, h_s_ptr, first, end, n0 // BN, N)
        store_staged(q, stage, h_q_ptr, first, end, n0, I, I, num_warps)


@gluon.jit
def _up_epilogue_halves(acc_gl, acc_gh, acc_ul, acc_uh, stage, h_q_ptr, h_s_ptr, preact_ptr, first, end, n0, N, I,
                        PREACT: gl.constexpr, H_OUT: gl.constexpr, POW2: gl.constexpr, num_warps: gl.constexpr):
    """``_up_epilogue`` of a block held as its left and right 64 columns (the issue-ahead up kernel's): the
    same h, row amax (the larger of the halves') and bytes."""
    HB: gl.constexpr = acc_gl.type.shape[1]
    h_lo = _up_h(acc_gl, acc_ul, stage, preact_ptr, first, end, n0, I, PREACT, num_warps)
    h_hi = _up_h(acc_gh, acc_uh, stage, preact_ptr, first, end, n0 + HB, I, PREACT, num_warps)
    if H_OUT:
        amax = gl.maximum(gl.maximum(gl.max(gl.abs(h_lo), axis=1), gl.max(gl.abs(h_hi), axis=1)), 1e-12)
        scale, inv = _h_scales(amax, POW2)
        q_lo = _quantize_h(h_lo, inv)
        q_hi = _quantize_h(h_hi, inv)
        _store_h_s(scale, h_s_ptr, first, end, n0 // (2 * HB), N)
        store_staged(q_lo, stage, h_q_ptr, first, end, n0, I, I, num_warps)
        store_staged(q_hi, stage, h_q_ptr, first, end, n0 + HB, I, I, num_warps)


@gluon.jit
def _fp8_up_ws_kernel(x_ptr, x_s_ptr, w13_desc, w13_s_ptr, h_q_ptr, h_s_ptr, preact_ptr, row_slot_ptr, offsets_ptr,
                      tile_expert_ptr, tile_row_ptr, trace_ptr, T, N, D, I, E, top_k, EB: gl.constexpr,
                      TILE_M: gl.constexpr, PREACT: gl.constexpr, H_OUT: gl.constexpr, ISSUE_AHEAD: gl.constexpr,
                      POW2: gl.constexpr, TRACE: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
                      MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """x (T, D) fp8 gathered by token and x_s (D // 128, T) fp32; w13_desc: W13 (E, 2, I, D) fp8 (gate rows, then
    up rows), block (1, 1, BN, BK); w13_s (E, 2I // 128, D // 128) fp32; h_q (N, I) fp8 and h_s (I // 128, N)
    fp32 out in sorted rows if H_OUT (rows past the routed count not written); preact (N, 2I) bf16 out if PREACT.
    Blocks: the busy tiles (EB: a power of two >= E) times the I-blocks of 128 (one h scale group each). TRACE:
    stamps into trace_ptr (int64, see ``TRACE_BLOCKS``)."""
    BN: gl.constexpr = w13_desc.block_type.shape[2]
    BK: gl.constexpr = w13_desc.block_type.shape[3]
    HALF: gl.constexpr = TILE_M // 2
    num_n = I // BN
    work = count_busy_tiles(offsets_ptr, E, EB, TILE_M, num_warps) * num_n
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_M, BK], gl.float8e4nv)
    x_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, TILE_M, BK], x_layout)
    g_bufs = gl.allocate_shared_memory(w13_desc.dtype, [STAGES] + w13_desc.block_type.shape, w13_desc.layout)
    u_bufs = gl.allocate_shared_memory(w13_desc.dtype, [STAGES] + w13_desc.block_type.shape, w13_desc.layout)
    scale_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # of one indexed row
    # Per stage: x's row scales (the two warpgroups' halves); the gate and up blocks' scales, each repeated
    as_bufs = gl.allocate_shared_memory(gl.float32, [STAGES * 2, HALF], scale_layout)
    bs_bufs = gl.allocate_shared_memory(gl.float32, [STAGES * 2, HALF], scale_layout)
    # Each MMA warpgroup's staging buffer for its epilogue's stores (8 KB: h's fp8 block, or half of g's or u's)
    staging = gl.allocate_shared_memory(gl.bfloat16, [2, HALF, BN // 2], staged_layout([HALF, BN // 2], gl.bfloat16))
    ready = barriers(STAGES, 1 + 32 * LOADER_WARPS)  # the TMA bytes' arrival + each thread's cp.async
    empty = barriers(STAGES, 2)  # one arrival per MMA warpgroup
    gl.warp_specialize([
        (_up_mma_partition, (h_q_ptr, h_s_ptr, preact_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty,
                             x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, staging, trace_ptr, N, D, I, num_n, work, 0,
                             PREACT, H_OUT, ISSUE_AHEAD, POW2, TRACE, num_warps)),
        (_up_mma_partition, (h_q_ptr, h_s_ptr, preact_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty,
                             x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, staging, trace_ptr, N, D, I, num_n, work, 1,
                             PREACT, H_OUT, ISSUE_AHEAD, POW2, TRACE, num_warps)),
        (_up_loader, (x_ptr, x_s_ptr, w13_desc, w13_s_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                      ready, empty, x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, trace_ptr, T, D, I, top_k, num_n,
                      work, TRACE, LOADER_WARPS)),
    ], [num_warps, LOADER_WARPS], [MMA_REGS, LOADER_REGS])


# ---------------------------------------------------------------------------------------------------------------
# Weight gradients: dW[e] = sum over expert e's plan tiles t of deq(A)[tile t]ᵀ deq(B)[tile t], 128x1 operands.
# ---------------------------------------------------------------------------------------------------------------


@gluon.jit
def _wgrad_loader(a_desc, b_desc, a_s_ptr, b_s_ptr, offsets_ptr, ready, empty, a_bufs, b_bufs, as_bufs, bs_bufs, P, Q,
                  num_p, num_q, tiles, EB: gl.constexpr, num_warps: gl.constexpr):
    """Loader partition (one warp) of ``_fp8_wgrad_ws_kernel``: per K-step (one plan tile t of the block's
    expert), the (128, 128) blocks of A at [p0, 128 t] and of B at [q0, 128 t] through TMA (zeros past the expert's
    rows are in the tensors), and the tile's scales of the block's 128 P-columns (two warpgroup halves) and 128
    Q-columns through ``cp.async``, each thread's copies arriving on the stage's ready barrier."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    HALF: gl.constexpr = as_bufs.type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    lanes_a = gl.arange(0, HALF, layout=gl.BlockedLayout([HALF // (32 * num_warps)], [32], [num_warps], [0]))
    lanes_b = gl.arange(0, BN, layout=gl.BlockedLayout([BN // (32 * num_warps)], [32], [num_warps], [0]))
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        e, p0, q0, start, end = wgrad_block(tile, offsets_ptr, num_p, num_q, BM, BN)
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


@gluon.jit
def _wgrad_mma(a_bufs, b_bufs, s, c0: gl.constexpr, tmp, WG: gl.constexpr):
    """Issue stage ``s``'s MMA chain for this warpgroup's 64 P-rows and the block's columns ``c0`` .. ``c0`` + 128
    into ``tmp`` (asynchronous); returns its pending result."""
    HALF: gl.constexpr = tmp.type.shape[0]
    b = b_bufs.index(s).slice(c0, tmp.type.shape[1])
    return warpgroup_mma(a_bufs.index(s).slice(WG * HALF, HALF), b.permute((1, 0)), tmp, use_acc=False, is_async=True)


@gluon.jit
def _wgrad_scale(as_bufs, bs_bufs, s, c0: gl.constexpr, WG: gl.constexpr, tmp):
    """The outer product of stage ``s``'s scales for the chain ``tmp`` of columns ``c0`` ..: A's of this warpgroup's
    rows times B's of the columns, read from the stage, in ``tmp``'s layout."""
    layout: gl.constexpr = tmp.type.layout
    sa = as_bufs.index(2 * s + WG).load(gl.SliceLayout(1, layout))
    sb = bs_bufs.index(s).slice(c0, tmp.type.shape[1]).load(gl.SliceLayout(0, layout))
    return sa[:, None] * sb[None, :]


@gluon.jit
def _wgrad_promote(acc, tmp, as_bufs, bs_bufs, empty, s, WG: gl.constexpr):
    """``acc`` + the finished chain ``tmp`` of stage ``s`` times the outer product of the stage's scales, which is
    then freed."""
    scale = _wgrad_scale(as_bufs, bs_bufs, s, 0, WG, tmp)
    mbarrier.arrive(empty.index(s), count=1)
    return _promote(acc, tmp, scale)


@gluon.jit
def _wgrad_main_ahead(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, steps, WG: gl.constexpr,
                      acc_layout: gl.constexpr):
    """A block's ``steps`` (>= 1) K-steps for one warpgroup with the next chain issued before a finished one is
    promoted (the pattern of ``_rows_main_narrow``'s issue-ahead branch, whose comments say why each wait is
    to zero chains in flight). The scales are read at the promotion, under the next chain: held from the stage's
    ready wait, as the sorted-rows kernel holds its row scales, B's 32 per thread would not fit beside two
    temporaries and the accumulator. Returns (the accumulator, the next ring step)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HALF: gl.constexpr = as_bufs.type.shape[1]
    BN: gl.constexpr = b_bufs.type.shape[1]
    acc = gl.zeros([HALF, BN], gl.float32, acc_layout)
    tmp1 = gl.zeros([HALF, BN], gl.float32, acc_layout)
    s0 = _stage_ready(ready, step, STAGES)
    tmp0 = _wgrad_mma(a_bufs, b_bufs, s0, 0, gl.zeros([HALF, BN], gl.float32, acc_layout), WG)
    for _ in range((steps - 1) // 2):  # [step `step` in flight in tmp0]
        s1 = _stage_ready(ready, step + 1, STAGES)
        tmp0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        tmp1 = _wgrad_mma(a_bufs, b_bufs, s1, 0, tmp1, WG)
        acc = _wgrad_promote(acc, tmp0, as_bufs, bs_bufs, empty, s0, WG)
        s0 = _stage_ready(ready, step + 2, STAGES)
        tmp1 = warpgroup_mma_wait(0, deps=(tmp1, ))
        tmp0 = _wgrad_mma(a_bufs, b_bufs, s0, 0, tmp0, WG)
        acc = _wgrad_promote(acc, tmp1, as_bufs, bs_bufs, empty, s1, WG)
        step += 2
    if steps % 2 == 0:  # two steps left: `step` in flight, and the next
        s1 = _stage_ready(ready, step + 1, STAGES)
        done0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        tmp1 = _wgrad_mma(a_bufs, b_bufs, s1, 0, tmp1, WG)
        acc = _wgrad_promote(acc, done0, as_bufs, bs_bufs, empty, s0, WG)
        tmp1 = warpgroup_mma_wait(0, deps=(tmp1, ))
        acc = _wgrad_promote(acc, tmp1, as_bufs, bs_bufs, empty, s1, WG)
        step += 2
    else:  # one step left, in flight
        done0 = warpgroup_mma_wait(0, deps=(tmp0, ))
        acc = _wgrad_promote(acc, done0, as_bufs, bs_bufs, empty, s0, WG)
        step += 1
    return acc, step


@gluon.jit
def _wgrad_wide_step(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, acc0, acc1, tmp, c_smem, out_desc, e, p0,
                     q0, WG: gl.constexpr, LAST: gl.constexpr):
    """One K-step of a 256-column block for one warpgroup (``_wgrad_main_wide``): the left chain, its promotion into
    ``acc0``, the right chain, its promotion into ``acc1``, the stage freed; with LAST (the block's last K-step) the
    left half stored (``store_block`` at [e, p0, q0]) under the right chain. Returns (acc0, acc1, tmp)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HB: gl.constexpr = tmp.type.shape[1]
    s = _stage_ready(ready, step, STAGES)
    tmp = warpgroup_mma_wait(0, deps=(_wgrad_mma(a_bufs, b_bufs, s, 0, tmp, WG), ))
    acc0 = _promote(acc0, tmp, _wgrad_scale(as_bufs, bs_bufs, s, 0, WG, tmp))
    tmp = _wgrad_mma(a_bufs, b_bufs, s, HB, tmp, WG)
    if LAST:
        store_block(acc0.to(out_desc.dtype), c_smem, out_desc, e, p0, q0)
    tmp = warpgroup_mma_wait(0, deps=(tmp, ))
    scale = _wgrad_scale(as_bufs, bs_bufs, s, HB, WG, tmp)
    mbarrier.arrive(empty.index(s), count=1)
    acc1 = _promote(acc1, tmp, scale)
    return acc0, acc1, tmp


@gluon.jit
def _wgrad_main_wide(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, steps, c_smem, out_desc, e, p0, q0,
                     WG: gl.constexpr, acc_layout: gl.constexpr):
    """A 256-column block's ``steps`` (>= 1) K-steps for one warpgroup, as two column halves of 128 with an
    accumulator each and one temporary (3 x 64 registers per thread: no second temporary fits for issue-ahead, so
    each promotion runs under the other warpgroup's MMAs); the left half is stored at [e, p0, q0] under the last
    K-step's right chain. Returns (the right half's accumulator, the next ring step)."""
    HALF: gl.constexpr = as_bufs.type.shape[1]
    HB: gl.constexpr = b_bufs.type.shape[1] // 2
    acc0 = gl.zeros([HALF, HB], gl.float32, acc_layout)
    acc1 = gl.zeros([HALF, HB], gl.float32, acc_layout)
    tmp = gl.zeros([HALF, HB], gl.float32, acc_layout)  # both chains' destination registers
    for k in range(steps - 1):
        acc0, acc1, tmp = _wgrad_wide_step(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step + k, acc0, acc1, tmp,
                                           c_smem, out_desc, e, p0, q0, WG, False)
    acc0, acc1, tmp = _wgrad_wide_step(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step + steps - 1, acc0, acc1,
                                       tmp, c_smem, out_desc, e, p0, q0, WG, True)
    return acc1, step + steps


@gluon.jit
def _wgrad_mma_partition(out_desc, c_smem, offsets_ptr, ready, empty, a_bufs, b_bufs, as_bufs, bs_bufs, num_p, num_q,
                         tiles, WG: gl.constexpr, num_warps: gl.constexpr):
    """MMA partition ``WG`` (P-rows WG*64 .. WG*64+63 of each block) of ``_fp8_wgrad_ws_kernel``: per K-step the
    block's MMA into a temporary and its promotion with the outer product of the tile's scales (A's of the 64 rows,
    B's of the block's columns); then the bf16 block, 128 columns at a time, through the warpgroup's buffer
    ``c_smem`` and a TMA store that runs on under the MMAs that follow. A block of 128 columns promotes under its
    next K-step's MMA (``_wgrad_main_ahead``), one of 256 runs as two column halves (``_wgrad_main_wide``). An
    expert without rows gets zeros."""
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    HB: gl.constexpr = c_smem.type.shape[2]  # columns per store and per accumulator
    HALF: gl.constexpr = as_bufs.type.shape[1]
    acc_layout: gl.constexpr = _acc_layout(HALF, HB, num_warps)
    step = 0
    # The expert's rows are read at the block's start. Read a block ahead (expert_rows_ahead, as the bf16 kernel
    # does), this kernel hung on the H200 at the 30B layer's shapes (docs/PERFORMANCE.md).
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        e, p0, q0, start, end = wgrad_block(tile, offsets_ptr, num_p, num_q, BM, BN)
        steps = (end - start + BK - 1) // BK
        acc = gl.zeros([HALF, HB], gl.float32, acc_layout)
        if BN == 2 * HB:
            if steps > 0:
                acc, step = _wgrad_main_wide(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, steps, c_smem,
                                             out_desc, e, p0 + WG * HALF, q0, WG, acc_layout)
            else:
                store_block(acc.to(out_desc.dtype), c_smem, out_desc, e, p0 + WG * HALF, q0)
            store_block(acc.to(out_desc.dtype), c_smem, out_desc, e, p0 + WG * HALF, q0 + HB)
        else:
            if steps > 0:
                acc, step = _wgrad_main_ahead(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, step, steps, WG,
                                              acc_layout)
            store_block(acc.to(out_desc.dtype), c_smem, out_desc, e, p0 + WG * HALF, q0)
    tma.store_wait(0)


@gluon.jit
def _fp8_wgrad_ws_kernel(a_desc, b_desc, a_s_ptr, b_s_ptr, out_desc, offsets_ptr, P, Q, tiles, EB: gl.constexpr,
                         STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, MMA_REGS: gl.constexpr,
                         LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """a_desc: A (P, NT * 128) fp8 in tile columns (``quant.quantize_tile_cols``), block (BM, BK = 128); b_desc: B
    (Q, NT * 128) fp8, block (BN, BK), BN 128 or 256; a_s (NT, P) and b_s (NT, Q) fp32; out_desc: out (E, P, Q)
    bf16, block (1, BM / 2, 128) (one warpgroup's half of 128 columns). Blocks: ``tiles`` = E * P/BM * Q/BN output
    blocks, expert-major (the programs at work share one expert's operands in L2), one program per SM walking them.
    P a multiple of 128, Q of BN; EB a power of two >= E."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    # B's scales of the block's Q-columns per stage
    a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty = _ring(a_desc, b_desc, 1, BN, STAGES, LOADER_WARPS)
    c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    num_p = P // BM
    num_q = Q // BN
    gl.warp_specialize([
        (_wgrad_mma_partition, (out_desc, c_bufs.index(0), offsets_ptr, ready, empty, a_bufs, b_bufs, as_bufs,
                                bs_bufs, num_p, num_q, tiles, 0, num_warps)),
        (_wgrad_mma_partition, (out_desc, c_bufs.index(1), offsets_ptr, ready, empty, a_bufs, b_bufs, as_bufs,
                                bs_bufs, num_p, num_q, tiles, 1, num_warps)),
        (_wgrad_loader, (a_desc, b_desc, a_s_ptr, b_s_ptr, offsets_ptr, ready, empty, a_bufs, b_bufs, as_bufs, bs_bufs,
                         P, Q, num_p, num_q, tiles, EB, LOADER_WARPS)),
    ], [num_warps, LOADER_WARPS], [MMA_REGS, LOADER_REGS])


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _fp8_layout(block: tuple[int, ...]) -> gl.NVMMASharedLayout:
    """The shared-memory layout of an FP8 TMA block (128-byte swizzle for 128-wide K), built once per shape."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv)


@functools.cache
def _bf16_layout(block: tuple[int, ...]) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a bf16 TMA block, built once per shape."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def _fp8_desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block, _fp8_layout(tuple(block)))


def fp8_ws_supported(t: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether these kernels run for FP8 operands on ``t``'s device with outputs (and saved products) in
    ``out_dtype``: an sm90 GPU and bf16."""
    return t.is_cuda and out_dtype == torch.bfloat16 and device_capability(t.device.index)[0] == 9


def fp8_rows_gemm_ws(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, out: torch.Tensor,
                     plan, *, weights: torch.Tensor | None = None, to_slots: bool = False,
                     issue_ahead: bool | None = None, defer_epilogue: bool | None = None,
                     block_n: int | None = None, trace: torch.Tensor | None = None) -> None:
    """out (M, N) bf16 = the blockwise-dequantised a (M, K) in sorted rows times each row's expert weight
    w[e] (E, N, K)ᵀ, through ``_fp8_rows_ws_kernel``; row r into row ``plan.row_slot_N[r]`` if ``to_slots``, else
    r; times ``weights[row_slot[r]]`` (fp32, (M,) by slot) if given. Only the plan's routed rows are written.
    ``block_n``: the block's columns, 128 or 256 (N a multiple of it; None: ``ROWS_BLOCK_N`` where N is a multiple
    of it, else 128). At 128 columns, ``issue_ahead``: each warpgroup issues the next K-block's MMA before promoting
    the last (None: ``ROWS_ISSUE_AHEAD``); ``defer_epilogue``: a block's stores run under the warpgroup's next
    block's first MMA (None: ``ROWS_DEFER_EPILOGUE``). 256 columns run without issue-ahead, their stores deferred
    (None: ``ROWS_DEFER_EPILOGUE``) under the block's own chains (``_rows_main_wide``).
    ``trace``: int64, at least ``trace_size(sm_count)`` elements: the block trace (``TRACE_BLOCKS``; untraced
    launches compile without its stamps).

    a_q (M, K) float8_e4m3fn contiguous, a_s (K // 128, M) fp32 contiguous, w_q (E, N, K) float8_e4m3fn
    contiguous, w_s (E, N // 128, K // 128) fp32 contiguous; K and N multiples of 128; M >= 1; an sm90 GPU;
    ``plan`` built with BLOCK_M = 128 rows per tile."""
    num_rows, k_dim = a_q.shape
    num_experts, n_out, _ = w_q.shape
    assert k_dim % FP8_BK == 0 and n_out % FP8_BN == 0 and w_q.shape[2] == k_dim
    assert a_s.shape == (k_dim // SCALE_BLOCK, num_rows) and w_s.shape == (num_experts, n_out // SCALE_BLOCK,
                                                                           k_dim // SCALE_BLOCK)
    assert out.shape == (num_rows, n_out) and out.dtype == torch.bfloat16 and BLOCK_M == FP8_BM
    assert trace is None or (trace.dtype == torch.int64 and trace.numel() >= trace_size(sm_count(a_q.device.index)))
    block_n, issue_ahead, defer_epilogue = rows_pattern(n_out, block_n, issue_ahead, defer_epilogue)
    _fp8_rows_ws_kernel[(sm_count(a_q.device.index),)](
        a_desc=_fp8_desc(a_q, [FP8_BM, FP8_BK]), w_desc=_fp8_desc(w_q, [1, block_n, FP8_BK]), a_s_ptr=a_s,
        w_s_ptr=w_s, out_ptr=out, weights_ptr=weights if weights is not None else a_s, row_slot_ptr=plan.row_slot_N,
        offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT, tile_row_ptr=plan.tile_row_NT,
        trace_ptr=trace if trace is not None else out, M=num_rows, N_OUT=n_out, K=k_dim, E=num_experts,
        EB=triton.next_power_of_2(num_experts), TILE_M=BLOCK_M, WEIGHTED=weights is not None, TO_SLOTS=to_slots,
        ISSUE_AHEAD=issue_ahead, DEFER_EPILOGUE=defer_epilogue, TRACE=trace is not None,
        STAGES=ROWS_STAGES if block_n == FP8_BN else ROWS_WIDE_STAGES, LOADER_WARPS=ROWS_LOADER_WARPS,
        MMA_REGS=MATH_REGS, LOADER_REGS=ROWS_LOADER_REGS, num_warps=MATH_WARPS, maxnreg=FP8_MAXNREG)


def rows_pattern(n_out: int, block_n: int | None = None, issue_ahead: bool | None = None,
                 defer_epilogue: bool | None = None) -> tuple[int, bool, bool]:
    """The sorted-rows kernel's (block_n, issue_ahead, defer_epilogue) for N = ``n_out``, the Nones resolved as
    ``fp8_rows_gemm_ws`` says; raises ValueError for a width N is not a multiple of, or a pattern 256 columns lack."""
    if block_n is None:
        block_n = ROWS_BLOCK_N if n_out % ROWS_BLOCK_N == 0 else FP8_BN
    if block_n not in (FP8_BN, 2 * FP8_BN) or n_out % block_n:
        raise ValueError(f"block_n={block_n}: the FP8 sorted-rows kernel's blocks are 128 or 256 columns, and N "
                         f"({n_out}) must be a multiple of it")
    defer_epilogue = ROWS_DEFER_EPILOGUE if defer_epilogue is None else defer_epilogue
    if block_n == FP8_BN:
        return block_n, ROWS_ISSUE_AHEAD if issue_ahead is None else issue_ahead, defer_epilogue
    if issue_ahead:
        raise ValueError("block_n=256 runs without issue-ahead (no registers for a second temporary)")
    return block_n, False, defer_epilogue


def trace_size(programs: int) -> int:
    """The block trace's length (int64 elements) for a launch of ``programs`` programs."""
    return programs * TRACE_PARTS.value * TRACE_BLOCKS.value * 2 * TRACE_POINTS.value


def fp8_up_swiglu_ws(x_q: torch.Tensor, x_s: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor,
                     h_q: torch.Tensor | None, h_s: torch.Tensor | None, plan, top_k: int,
                     preact: torch.Tensor | None = None, *, issue_ahead: bool = UP_ISSUE_AHEAD,
                     trace: torch.Tensor | None = None) -> None:
    """h = silu(x W1gᵀ) * (x W1uᵀ) for the plan's sorted rows (row r: token ``row_slot[r] // top_k``), blockwise
    dequantised operands, through ``_fp8_up_ws_kernel``; quantised per row and 128 columns into h_q (N, I)
    float8_e4m3fn and h_s (I // 128, N) fp32; with ``preact`` (N, 2I) bf16 also g and u (h_q and h_s None:
    only those). Only the routed rows are written. ``issue_ahead``: the MMA warpgroups' issue pattern (see
    ``UP_ISSUE_AHEAD``); ``trace``: as for ``fp8_rows_gemm_ws`` (the same points: the epilogue, SwiGLU and h's
    quantisation with its stores, lies between points 2 and 3).

    x_q (T, D) float8_e4m3fn, x_s (D // 128, T) fp32, w13_q (E, 2I, D) float8_e4m3fn (gate rows then up
    rows), w13_s (E, 2I // 128, D // 128) fp32, all contiguous; D and I multiples of 128; an sm90 GPU."""
    num_tokens, dim = x_q.shape
    num_experts, two_i, _ = w13_q.shape
    inter = two_i // 2
    num_rows = plan.row_slot_N.numel()
    assert dim % FP8_BK == 0 and inter % FP8_BN == 0 and w13_q.shape[2] == dim
    assert x_s.shape == (dim // SCALE_BLOCK, num_tokens) and w13_s.shape == (num_experts, two_i // SCALE_BLOCK,
                                                                             dim // SCALE_BLOCK)
    h_out = h_q is not None
    assert h_out == (h_s is not None) and (h_out or preact is not None) and BLOCK_M == FP8_BM
    assert not h_out or (h_q.shape == (num_rows, inter) and h_s.shape == (inter // SCALE_BLOCK, num_rows))
    assert preact is None or (preact.shape == (num_rows, two_i) and preact.dtype == torch.bfloat16)
    assert trace is None or (trace.dtype == torch.int64 and trace.numel() >= trace_size(sm_count(x_q.device.index)))
    _fp8_up_ws_kernel[(sm_count(x_q.device.index),)](
        x_ptr=x_q, x_s_ptr=x_s, w13_desc=_fp8_desc(w13_q.view(num_experts, 2, inter, dim), [1, 1, FP8_BN, FP8_BK]),
        w13_s_ptr=w13_s, h_q_ptr=h_q if h_out else x_q, h_s_ptr=h_s if h_out else x_s,
        preact_ptr=preact if preact is not None else h_s,
        row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, trace_ptr=trace if trace is not None else x_s, T=num_tokens, N=num_rows,
        D=dim, I=inter, E=num_experts, top_k=top_k, EB=triton.next_power_of_2(num_experts), TILE_M=BLOCK_M,
        PREACT=preact is not None, H_OUT=h_out, ISSUE_AHEAD=issue_ahead, POW2=fp8_pow2_scales(),
        TRACE=trace is not None,
        STAGES=UP_STAGES_PREACT if preact is not None else UP_STAGES, LOADER_WARPS=UP_LOADER_WARPS,
        MMA_REGS=UP_MATH_REGS, LOADER_REGS=UP_LOADER_REGS, num_warps=MATH_WARPS, maxnreg=FP8_MAXNREG)


def wgrad_block_n(q: int, block_n: int | None = None) -> int:
    """The FP8 weight-gradient kernel's block width for Q columns: ``block_n`` (128 or 256, a divisor of Q) if given,
    else ``WGRAD_BLOCK_N`` where it divides Q, else 128."""
    if block_n is None:
        return WGRAD_BLOCK_N if q % WGRAD_BLOCK_N == 0 else FP8_BN
    if block_n not in (FP8_BN, 2 * FP8_BN) or q % block_n:
        raise ValueError(f"block_n must be 128 or 256 and divide Q = {q}, got {block_n}")
    return block_n


def fp8_wgrad_ws(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, out: torch.Tensor,
                 offsets: torch.Tensor, block_n: int | None = None) -> None:
    """out (E, P, Q) bf16: per expert e the sum over its sorted rows of the blockwise-dequantised outer products
    a[r]ᵀ b[r], through ``_fp8_wgrad_ws_kernel``; an expert without rows gets zeros.

    a_q (P, NT * 128) and b_q (Q, NT * 128) float8_e4m3fn, a_s (NT, P) and b_s (NT, Q) fp32: the sorted rows in tile
    columns (``quant.quantize_tile_cols`` with the plan whose expert offsets are ``offsets`` (E + 1,) int32); P and Q
    multiples of 128; q's and s's rows contiguous; out contiguous; an sm90 GPU. ``block_n``: the output block's
    width (``wgrad_block_n``)."""
    num_experts, p, q = out.shape
    num_tiles = a_s.shape[0]
    assert p % FP8_BM == 0 and q % FP8_BN == 0 and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert a_q.shape == (p, num_tiles * FP8_BK) and b_q.shape == (q, num_tiles * FP8_BK)
    assert a_s.shape == (num_tiles, p) and b_s.shape == (num_tiles, q) and offsets.numel() == num_experts + 1
    block_n = wgrad_block_n(q, block_n)
    tiles = num_experts * (p // FP8_BM) * (q // block_n)
    block = [1, FP8_BM // 2, FP8_BN]  # one MMA warpgroup's rows, 128 columns
    _fp8_wgrad_ws_kernel[(min(tiles, sm_count(a_q.device.index)),)](
        a_desc=_fp8_desc(a_q, [FP8_BM, FP8_BK]), b_desc=_fp8_desc(b_q, [block_n, FP8_BK]), a_s_ptr=a_s, b_s_ptr=b_s,
        out_desc=TensorDescriptor.from_tensor(out, block, _bf16_layout(tuple(block))), offsets_ptr=offsets, P=p,
        Q=q, tiles=tiles, EB=triton.next_power_of_2(num_experts),
        STAGES=WGRAD_STAGES if block_n == FP8_BN else WGRAD_WIDE_STAGES, LOADER_WARPS=ROWS_LOADER_WARPS,
        MMA_REGS=MATH_REGS, LOADER_REGS=ROWS_LOADER_REGS, num_warps=MATH_WARPS, maxnreg=FP8_MAXNREG)


# The kernels by name, for the ahead-of-time compile check.
KERNELS = {"fp8_rows": _fp8_rows_ws_kernel, "fp8_up": _fp8_up_ws_kernel, "fp8_wgrad": _fp8_wgrad_ws_kernel}


def aot_compile(name: str, *, weighted: bool = True, to_slots: bool = True, preact: bool = False,
                h_out: bool = True, sizes_divisible: bool = True, issue_ahead: bool | None = None, pow2: bool = False,
                defer_epilogue: bool | None = None, block_n: int = FP8_BN, trace: bool = False):
    """The kernel ``name`` of ``KERNELS`` compiled ahead of time for sm_90a (no GPU needed), as its launcher
    configures it, 128 experts: the compiled kernel (``.asm["ptx"]``, ``.metadata.shared``), for
    ``tools.resources.ptxas_report``. Pointers, and with ``sizes_divisible`` the sizes that the
    launchers' asserts make multiples of 128, are specialised as 16-divisible, as Triton does at run time.
    ``weighted`` / ``to_slots``: the sorted-rows kernel's variant (down projection: both); ``preact``: the up
    kernel's saved-activation variant, ``h_out=False`` (with ``preact``) its products-only one; ``issue_ahead``:
    either kernel's issue pattern (``None``: its default, ``ROWS_ISSUE_AHEAD`` or ``UP_ISSUE_AHEAD``); ``pow2``: the
    up kernel's power-of-two h scales; ``defer_epilogue`` (None: ``ROWS_DEFER_EPILOGUE``) and ``block_n``: the
    sorted-rows kernel's (``rows_pattern``), ``block_n`` also the weight-gradient kernel's; ``trace``: the block-traced variant (``TRACE_BLOCKS``) of the sorted-rows
    or the up kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block, dtype="fp8e4nv"):
        layout = (_fp8_layout if dtype == "fp8e4nv" else _bf16_layout)(tuple(block))
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout}>"

    if name == "fp8_rows":
        _, issue_ahead, defer_epilogue = rows_pattern(block_n, block_n, issue_ahead, defer_epilogue)
    elif issue_ahead is None:
        issue_ahead = UP_ISSUE_AHEAD
    common = {"EB": 128, "TILE_M": BLOCK_M, "ISSUE_AHEAD": issue_ahead, "num_warps": MATH_WARPS}
    if name == "fp8_rows":
        blocks = {"a_desc": [FP8_BM, FP8_BK], "w_desc": [1, block_n, FP8_BK]}
        constexprs = {**common, "WEIGHTED": weighted, "TO_SLOTS": to_slots, "DEFER_EPILOGUE": defer_epilogue,
                      "TRACE": trace,
                      "STAGES": ROWS_STAGES if block_n == FP8_BN else ROWS_WIDE_STAGES,
                      "LOADER_WARPS": ROWS_LOADER_WARPS, "MMA_REGS": MATH_REGS, "LOADER_REGS": ROWS_LOADER_REGS}
        pointers = {"a_s_ptr": "*fp32", "w_s_ptr": "*fp32", "out_ptr": "*bf16", "weights_ptr": "*fp32",
                    "trace_ptr": "*i64"}
        sizes = {"N_OUT", "K"}
    elif name == "fp8_wgrad":
        blocks = {"a_desc": [FP8_BM, FP8_BK], "b_desc": [block_n, FP8_BK]}
        constexprs = {"EB": 128, "num_warps": MATH_WARPS, "LOADER_WARPS": ROWS_LOADER_WARPS,
                      "STAGES": WGRAD_STAGES if block_n == FP8_BN else WGRAD_WIDE_STAGES,
                      "MMA_REGS": MATH_REGS, "LOADER_REGS": ROWS_LOADER_REGS}
        blocks["out_desc"] = ([1, FP8_BM // 2, FP8_BN], "bf16")
        pointers = {"a_s_ptr": "*fp32", "b_s_ptr": "*fp32"}
        sizes = {"P", "Q"}
    else:
        blocks = {"w13_desc": [1, 1, FP8_BN, FP8_BK]}
        constexprs = {**common, "PREACT": preact, "H_OUT": h_out, "POW2": pow2, "TRACE": trace,
                      "STAGES": UP_STAGES_PREACT if preact else UP_STAGES, "LOADER_WARPS": UP_LOADER_WARPS,
                      "MMA_REGS": UP_MATH_REGS, "LOADER_REGS": UP_LOADER_REGS}
        pointers = {"x_ptr": "*fp8e4nv", "x_s_ptr": "*fp32", "w13_s_ptr": "*fp32", "h_q_ptr": "*fp8e4nv",
                    "h_s_ptr": "*fp32", "preact_ptr": "*bf16", "trace_ptr": "*i64"}
        sizes = {"D", "I"}
    fn = KERNELS[name]

    def arg_type(arg):
        if arg in blocks:
            block = blocks[arg]
            return desc(*block) if isinstance(block, tuple) else desc(block)
        if arg in constexprs:
            return "constexpr"
        return pointers.get(arg, "*i32") if arg.endswith("_ptr") else "i32"

    signature = {arg: arg_type(arg) for arg in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if arg.endswith("_ptr") or (sizes_divisible and arg in sizes)}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": MATH_WARPS, "maxnreg": FP8_MAXNREG})
