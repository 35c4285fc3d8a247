"""The FP8 up projection: h = silu(x W1gᵀ) * (x W1uᵀ) over gathered x rows, quantised to FP8 per row and 128
columns (and the bf16 products, for the saved mode); launched by ``gluon_fp8_sm90.fp8_up_swiglu_ws``."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)

from megamoe.kernels.gluon_fp8_sm90_details.common import (
    AMAX_FLOOR,
    block_scales,
    blocks_ahead,
    blocks_ahead_of,
    fp8_scales,
    issue_chain,
    pass_stages,
    quantize_by,
    stage_ready,
)
from megamoe.kernels.gluon_sm90 import (
    barriers,
    block_index,
    count_busy_tiles,
    next_slot,
    staged_layout,
    stamp,
    stamp_first,
    store_staged,
    swiglu,
    tile_block,
    wgmma_acc_layout,
)


@gluon.jit
def _up_loader(x_ptr, x_s_ptr, w13_desc, w13_s_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready,
               empty, x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, trace_ptr, T, D, I, top_k, num_n, work,
               TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Loader partition (one warpgroup) of ``up_ws_kernel``: per K-step, the gate and up weight blocks
    through TMA; the tile's x rows gathered from their tokens (``row_slot[r] // top_k``) through 16-byte
    ``cp.async`` copies and their scales ``x_s[kb, token]`` through 4-byte ones (rows past the expert
    zero-filled); the gate and up blocks' scales, each repeated into 64 entries. TRACE: the sorted-rows loader's
    stamps (``gluon_sm90.TRACE_BLOCKS``)."""
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
        block = block_index(w)
        stamp(trace_ptr, 2, block, 0, TRACE, num_warps)
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
            stamp_first(trace_ptr, 2, block, 1, kb == 0, TRACE, num_warps)
        stamp(trace_ptr, 2, block, 2, TRACE, num_warps)


@gluon.jit
def _up_stage(as_bufs, bs_bufs, ready, step, STAGES: gl.constexpr, WG: gl.constexpr, row_layout: gl.constexpr):
    """Wait for ring step ``step``'s stage and read this warpgroup's scales of it: (the stage, the gate block's
    scales, the up block's)."""
    s = stage_ready(ready, step, STAGES)
    fence_async_shared()  # x arrived through cp.async (generic proxy); the MMAs read it (async proxy)
    return s, block_scales(as_bufs, bs_bufs, s, 0, WG, row_layout), block_scales(as_bufs, bs_bufs, s, 1, WG, row_layout)


@gluon.jit
def _up_mma_partition(h_q_ptr, h_s_ptr, preact_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, x_bufs,
                      g_bufs, u_bufs, as_bufs, bs_bufs, staging, trace_ptr, N, D, I, num_n, work, WG: gl.constexpr,
                      PREACT: gl.constexpr, H_OUT: gl.constexpr, POW2: gl.constexpr, TRACE: gl.constexpr,
                      num_warps: gl.constexpr):
    """MMA partition ``WG`` (rows WG*64 .. WG*64+63 of each tile) of ``up_ws_kernel``: per K-step the gate
    block's MMA, its promotion, the up block's MMA (into the same temporary) and its promotion; then h = silu(g) *
    u in fp32, quantised per row over the block's 128 columns into h_q / h_s (POW2: power-of-two scales), and with
    PREACT g and u rounded to bf16 into ``preact``. TRACE: the sorted-rows MMA partitions' stamps
    (``gluon_sm90.TRACE_BLOCKS``)."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[3]  # [STAGES, 1, 1, BN, BK]
    HALF: gl.constexpr = bs_bufs.type.shape[1]
    acc_layout: gl.constexpr = wgmma_acc_layout(BN, num_warps, 32)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
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
            acc_g = gl.zeros([HALF, BN], gl.float32, acc_layout)
            acc_u = gl.zeros([HALF, BN], gl.float32, acc_layout)
            tmp = gl.zeros([HALF, BN], gl.float32, acc_layout)  # both MMAs' destination registers
            for k in range(0, D, BK):
                s, scale_g, scale_u = _up_stage(as_bufs, bs_bufs, ready, step, STAGES, WG, row_layout)
                stamp_first(trace_ptr, WG, block, 1, k == 0, TRACE, num_warps)
                tmp = warpgroup_mma_wait(0, deps=(issue_chain(x_bufs, g_bufs, s, 0, tmp, WG), ))
                acc_g = acc_g + tmp * scale_g[:, None]
                tmp = warpgroup_mma_wait(0, deps=(issue_chain(x_bufs, u_bufs, s, 0, tmp, WG), ))
                mbarrier.arrive(empty.index(s), count=1)
                acc_u = acc_u + tmp * scale_u[:, None]
                step += 1
            stamp(trace_ptr, WG, block, 2, TRACE, num_warps)
            _up_epilogue(acc_g, acc_u, staging.index(WG), h_q_ptr, h_s_ptr, preact_ptr, first, end, n0, N, I,
                         PREACT, H_OUT, POW2, num_warps)
        else:  # all 64 rows past the expert: hand the stages back untouched
            step = pass_stages(ready, empty, step, D, BK)
        stamp(trace_ptr, WG, block, 3, TRACE, num_warps)
        row0, end, e_next, row0_next = row0_next, end_next, e_after, row0_after


@gluon.jit
def _up_h(acc_g, acc_u, stage, preact_ptr, first, end, c0, I, PREACT: gl.constexpr, num_warps: gl.constexpr):
    """h = silu(g) * u (fp32) of one warpgroup's 64 rows and the columns c0 .. of g and u; with PREACT g and u
    (bf16) into preact (N, 2I) at columns c0 and I + c0 (rows [first, end)), through the warpgroup's staging
    buffer ``stage`` (``gluon_sm90.store_staged``)."""
    if PREACT:
        store_staged(acc_g.to(gl.bfloat16), stage, preact_ptr, first, end, c0, 2 * I, I, num_warps)
        store_staged(acc_u.to(gl.bfloat16), stage, preact_ptr + I, first, end, c0, 2 * I, I, num_warps)
    return swiglu(acc_g, acc_u)


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
    amax = max(max|h|, 1e-12) over the row's 128 columns, q = fp8(h * (448 / amax)) (round to nearest even,
    saturated to ±448), scale amax / 448 (both divisions IEEE; POW2: ``common.fp8_scales``); q into h_q (N, I) rows
    [first, end), the scale into h_s (I // 128, N); with PREACT g and u (bf16) into preact (N, 2I) at columns n0 and
    I + n0. Without H_OUT only the latter (the FP8 backward's recompute)."""
    BN: gl.constexpr = acc_g.type.shape[1]
    h = _up_h(acc_g, acc_u, stage, preact_ptr, first, end, n0, I, PREACT, num_warps)
    if H_OUT:
        scale, inv = fp8_scales(gl.maximum(gl.max(gl.abs(h), axis=1), AMAX_FLOOR), POW2)
        q = quantize_by(h, inv[:, None])
        _store_h_s(scale, h_s_ptr, first, end, n0 // BN, N)
        store_staged(q, stage, h_q_ptr, first, end, n0, I, I, num_warps)


@gluon.jit
def up_ws_kernel(x_ptr, x_s_ptr, w13_desc, w13_s_ptr, h_q_ptr, h_s_ptr, preact_ptr, row_slot_ptr, offsets_ptr,
                      tile_expert_ptr, tile_row_ptr, trace_ptr, T, N, D, I, E, top_k, EB: gl.constexpr,
                      TILE_M: gl.constexpr, PREACT: gl.constexpr, H_OUT: gl.constexpr, POW2: gl.constexpr,
                      TRACE: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr, MMA_REGS: gl.constexpr,
                      LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """x (T, D) fp8 gathered by token and x_s (D // 128, T) fp32; w13_desc: W13 (E, 2, I, D) fp8 (gate rows, then
    up rows), block (1, 1, BN, BK); w13_s (E, 2I // 128, D // 128) fp32; h_q (N, I) fp8 and h_s (I // 128, N)
    fp32 out in sorted rows if H_OUT (rows past the routed count not written); preact (N, 2I) bf16 out if PREACT.
    Blocks: the busy tiles (EB: a power of two >= E) times the I-blocks of 128 (one h scale group each).
    TRACE: stamps into trace_ptr (int64, see ``gluon_sm90.TRACE_BLOCKS``)."""
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
                             x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, staging, trace_ptr, N, D, I, num_n, work,
                             0, PREACT, H_OUT, POW2, TRACE, num_warps)),
        (_up_mma_partition, (h_q_ptr, h_s_ptr, preact_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty,
                             x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, staging, trace_ptr, N, D, I, num_n, work,
                             1, PREACT, H_OUT, POW2, TRACE, num_warps)),
        (_up_loader, (x_ptr, x_s_ptr, w13_desc, w13_s_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                      ready, empty, x_bufs, g_bufs, u_bufs, as_bufs, bs_bufs, trace_ptr, T, D, I, top_k, num_n,
                      work, TRACE, LOADER_WARPS)),
    ], [num_warps, LOADER_WARPS], [MMA_REGS, LOADER_REGS])

