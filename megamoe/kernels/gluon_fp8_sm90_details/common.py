"""Device helpers shared by the FP8 Gluon kernels (``gluon_fp8_sm90``): the ring of stages and its waits, a
warpgroup's MMA chain and its promotion, the blocks' look-ahead and the FP8 groups' scales."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma

from megamoe.kernels.gluon_sm90 import barriers, block_rows, expert_end

FP8_MAX = gl.constexpr(448.0)  # largest finite float8_e4m3fn
AMAX_FLOOR = gl.constexpr(1e-12)  # an all-zero group's amax, as ``quant.AMAX_FLOOR``


@gluon.jit
def block_scales(as_bufs, bs_bufs, s, j: gl.constexpr, WG: gl.constexpr, layout: gl.constexpr):
    """This warpgroup's combined scales of stage ``s`` for weight block ``j``: a_s of its 64 rows times the
    weight block's scale (stored repeated), (64,) fp32 in ``layout`` (the accumulator's rows). as_bufs:
    (STAGES * 2, 64), a stage's two row halves; bs_bufs: (STAGES * NB, 64), a stage's NB weight blocks."""
    NB: gl.constexpr = bs_bufs.type.shape[0] // (as_bufs.type.shape[0] // 2)
    return as_bufs.index(s * 2 + WG).load(layout) * bs_bufs.index(s * NB + j).load(layout)


@gluon.jit
def issue_chain(a_bufs, w_bufs, s, c0: gl.constexpr, tmp, WG: gl.constexpr):
    """Issue stage ``s``'s MMA chain (asynchronous: wgmma m64 x tmp's width x k32 over BK = 128) of this warpgroup's
    64 rows of ``a_bufs[s]`` and columns ``c0`` .. ``c0`` + tmp's width of the weight block ``w_bufs[s]`` (a ring of
    [STAGES, 1, BN, BK] or [STAGES, 1, 1, BN, BK]) into ``tmp``; returns its pending result."""
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = w_bufs.type.shape[-2]
    HALF: gl.constexpr = a_bufs.type.shape[1] // 2
    w = w_bufs.index(s).reshape([BN, BK]).slice(c0, tmp.type.shape[1])
    return warpgroup_mma(a_bufs.index(s).slice(WG * HALF, HALF), w.permute((1, 0)), tmp, use_acc=False,
                         is_async=True)


@gluon.jit
def promote(acc, tmp, scale):
    """``acc + tmp * scale`` (``scale`` broadcast to the block: a row's as ``[:, None]``, one FMA per element),
    pinned by an empty side-effecting asm per register (CUTLASS's ``warpgroup_fence_operand``) before the wgmma
    issued next. Left free, LLVM sinks a promotion past the next chain into the temporary it reads, copies that
    temporary aside and then copies a chain's registers while in flight, for which ptxas serialises every wgmma of
    the kernel (C7514)."""
    return gl.inline_asm_elementwise("", "=r,0", [acc + tmp * scale], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def stage_ready(ready, step, STAGES: gl.constexpr):
    """Wait for ring step ``step``'s stage; returns it."""
    s = step % STAGES
    mbarrier.wait(ready.index(s), (step // STAGES) & 1)
    return s


@gluon.jit
def pass_stages(ready, empty, step, K, BK: gl.constexpr):
    """A warpgroup with no rows in a block: wait for each of the block's K-steps and hand its stage back unread (the
    loader filled it for both warpgroups); returns the next ring step."""
    STAGES: gl.constexpr = empty.type.shape[0]
    for _ in range(0, K, BK):
        mbarrier.arrive(empty.index(stage_ready(ready, step, STAGES)), count=1)
        step += 1
    return step


@gluon.jit
def ring(a_desc, b_desc, B_SCALE_ROWS: gl.constexpr, B_SCALES: gl.constexpr, STAGES: gl.constexpr,
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
def blocks_ahead(tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, work):
    """An MMA partition's view of its first two blocks, before its loop: the first one's first row and expert end,
    the second one's expert and first row. The loop then reads each block's expert and first row two blocks ahead
    and its expert's end one block ahead (``block_rows``, ``expert_end``), so that no load's latency stands between
    a block's last MMA and the next one's first. (Read at the block's start, the two dependent loads held both
    warpgroups there: the half-tile test ``first < end`` needs the end before the first MMA is issued.)"""
    e, row0 = block_rows(gl.program_id(0), work, tile_expert_ptr, tile_row_ptr, num_n)
    e_next, row0_next = block_rows(gl.program_id(0) + gl.num_programs(0), work, tile_expert_ptr, tile_row_ptr, num_n)
    return row0, expert_end(offsets_ptr, e, work), e_next, row0_next


@gluon.jit
def blocks_ahead_of(w, e_next, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, work):
    """At block ``w``'s start, the reads ``blocks_ahead`` describes: the next block's expert end (its expert
    ``e_next`` read a block ago; the end is used a block later) and the expert and first row of the block after it."""
    end_next = expert_end(offsets_ptr, e_next, work)
    e_after, row0_after = block_rows(w + 2 * gl.num_programs(0), work, tile_expert_ptr, tile_row_ptr, num_n)
    return end_next, e_after, row0_after


@gluon.jit
def fp8_scales(amax, POW2: gl.constexpr):
    """The scales of FP8 groups and the factors their values are multiplied by, from their amax (any shape), as
    ``quant.scale_and_inverse``: amax / 448 and 448 / amax (IEEE), or with POW2 amax / 448 rounded up to a power of
    two and its exact inverse."""
    s = gl.div_rn(amax, gl.full(amax.type.shape, FP8_MAX, gl.float32, amax.type.layout))
    if POW2:
        bits = s.to(gl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(gl.int32)
        return (exponent << 23).to(gl.float32, bitcast=True), ((254 - exponent) << 23).to(gl.float32, bitcast=True)
    return s, gl.div_rn(gl.full(amax.type.shape, FP8_MAX, gl.float32, amax.type.layout), amax)


@gluon.jit
def quantize_by(v, inv):
    """fp8(v * inv), ``inv`` broadcast over v (each row's factor as ``inv[:, None]``, each column's as ``inv[None,
    :]``), rounded to nearest even and saturated to +-448 by the GPU's conversion (cvt.rn.satfinite.e4m3x2.f32, as
    ``kernels.quant.to_e4m3`` converts on the GPU), NaN kept NaN."""
    return (v * inv).to(gl.float8e4nv)
