"""Persistent, warp-specialized Gluon GEMM kernels for Hopper (sm90, 16-bit operands), used there in place of
their Triton twins (which stay for fp32, other GPUs, the interpreter — the CPU tests run those — and the
expert-parallel kernels).

The Triton GEMMs run one output block per program. Each block's pipeline fill and epilogue (and, for
the weight gradients, the last partial K-step through masked pointer loads) sit exposed between main
loops (docs/DESIGN.md, "Warp-specialized Gluon kernels"). Here one program per SM walks the blocks, in two partitions:

- a loader warp streams the operands of every K-step of every block through TMA into a ring of
  ``STAGES`` buffers, running ahead into the next block while the current one finishes;
- the default partition (8 warps, two warpgroups) issues the warpgroup MMAs, keeps one in flight, frees
  each buffer when its MMA is done, and runs the epilogue.

Four kernels, each where it measured faster than its Triton twin (docs/PERFORMANCE.md; the down
projection and dx as Gluon kernels did not, and stay Triton):

- ``_wgrad_ws_kernel``: dW[e] = sum over expert e's sorted rows r of outer(a[r], b[r]), as
  ``expert_bwd._expert_wgrad_kernel``; blocks expert-major. An expert's last, partial K-step is loaded
  whole by TMA (rows past the expert belong to the next expert, or were never written); the MMA partition
  zeroes those rows of both operands in shared memory first. The bf16 block leaves through an
  asynchronous TMA store that overlaps the next block's main loop. Its ring: 6 stages of BK 32 (``WGRAD_TILE``).
  For dW13 in the dx-first order (``MEGAMOE_LOW_PEAK_BACKWARD=0``) a third partition (two warps) runs the dx
  combine beside the MMAs.
- ``_dh_ws_kernel``: dh' = dy W2[e] in sorted rows, as ``expert_bwd.DH``: blocks over the plan's busy
  tiles, a tile's I-blocks side by side; the epilogue converts the block through shared memory into
  16-byte row segments and stores them through masked pointer stores (a tile's rows past its expert
  belong to the next tile). A third partition (two warps) copies x's rows into sorted order beside the
  MMAs, for the act kernel and dW13.
- ``_act_ws_kernel``: the one-device act kernel (``expert_bwd.ACT_BWD``): recomputes both gate/up
  products and hands them, rounded to bf16/fp16, through shared memory to a third partition (4 warps) that
  runs the SwiGLU-backward epilogue on them while the MMA warps start the next block; three ring stages.
- ``_up_ws_kernel``: the one-device forward up kernel (gate/up GEMM + SwiGLU), four stages; its loader
  (one warpgroup) gathers the x rows from their tokens through ``cp.async`` beside the weights' TMA.

The two side copies are memory-bound work that no MMA beside them waits for; run as kernels of their own
they cost about 0.3 / 0.6 ms of a 30B / 235B step (docs/PERFORMANCE.md).
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

from megamoe.env import (
    WGRAD_GEMMS,
    device_capability,
    sm_count,
    wgrad_by_size_requested,
    wgrad_taken_requested,
)
from megamoe.kernels.plan import experts_by_size

# (BM, BN, BK, STAGES) of the GEMM kernels: 128x256 blocks, as the Triton kernels' usual pick at 16k tokens;
# 3 stages of 48 KB (and the weight gradients' 64 KB output block) fit the 227 KB of shared memory.
WS_TILE = (128, 256, 64, 3)
WS_NUM_WARPS = 8
WS_MAXNREG = 168  # 12 warps (8 + the loader's warpgroup) x 32 x 168 <= 64 K registers
# The same as a config dict, for the benchmarks' records.
WS_CONFIG = {"BM": WS_TILE[0], "BN": WS_TILE[1], "BK": WS_TILE[2], "num_warps": WS_NUM_WARPS,
             "num_stages": WS_TILE[3], "WARP_SPECIALIZED": True}


# Warps of the side copy that the dh' and weight-gradient kernels run beside their MMAs (the x rows into sorted
# order; the dx combine). Two share the loader's warpgroup, so a kernel stays at 12 warps and 168 registers;
# a warpgroup of its own would make 16 warps, a cap of 128 registers, and the 64x256 MMA needs more.
COPY_WARPS = gl.constexpr(2)
# Registers per thread of the loader's warpgroup, which the side copy shares (the loader's and the copy's): a
# pass's eight row chunks of 16-byte vectors; the MMA warps keep (64 K - 128 x 128) / 256 = 192 >= 168.
SIDE_REGS = gl.constexpr(128)


# (BM, BN, BK, STAGES) of the act kernel: 128 rows x 128 columns of gate and of up (the Triton kernel's
# pick), 3 stages of 48 KB and the 64 KB g/u hand-off block (208 KB).
ACT_TILE = (128, 128, 64, 3)
ACT_CONFIG = {**WS_CONFIG, "BN": ACT_TILE[1], "num_stages": ACT_TILE[3], "EPILOGUE_WARPS": 4}
ACT_EPILOGUE_WARPS = ACT_CONFIG["EPILOGUE_WARPS"]
ACT_MAXNREG = 128  # 16 warps (8 MMA, the loader's warpgroup, 4 epilogue) x 32 x 128 = 64 K registers
# Per epilogue thread; the loader keeps 24 and the MMA warps get the rest: (64 K - 128 x 24 - 128 x 152) / 256 = 168.
ACT_EPILOGUE_REGS = 152


UP_LOADER_WARPS = 4  # the up kernel's gathering loader: 128 threads, one cp.async arrival each per stage
# The act kernel's block with four stages: 4 x 48 KB and the epilogue's 16 KB staging buffer (208 KB).
UP_TILE = (*ACT_TILE[:3], 4)
UP_CONFIG = {**WS_CONFIG, "BN": UP_TILE[1], "num_stages": UP_TILE[3]}

# The weight gradients' block with a finer ring: 6 stages of BK 32 (24 KB) beside the 64 KB output block (208 KB). The
# same ring bytes as WS_TILE's 3 x 48 KB, in stages of half the size, so that the one or two the MMAs hold keep half the
# bytes from the loader: 1.6-5.9% faster than WS_TILE's ring (docs/PERFORMANCE.md, "What holds the bf16 GEMMs"; the
# row kernels' K-loops, over D, ran 1-8% slower with such rings).
WGRAD_TILE = (*WS_TILE[:2], 32, 6)
WGRAD_CONFIG = {**WS_CONFIG, "BK": WGRAD_TILE[2], "num_stages": WGRAD_TILE[3]}

# Whether the weight-gradient kernels (this file's and the FP8 one) deal their blocks to the programs in order of their
# experts' rows, most first, each full round of blocks dealt from alternate ends (``wgrad_block``), instead of in expert
# order. A block's time grows with its expert's rows: dealt in expert order, a skewed routing's long blocks pile onto
# the programs its big experts' blocks fall to, and the launch waits for those (``python -m tools.wgrad_schedule``, a
# model of the programs' K-steps: under the layer benchmark's skewed routing 30B dW2 at 1.57x / 1.67x the balanced time
# in FP8 / bf16, dW13 at 1.18x / 1.21x; in size order 1.01-1.02x; random routing 1.01x either way; docs/PERFORMANCE.md).
# The same blocks, each computed as before: the outputs are bitwise the same. Timed on an H100 (PERFORMANCE.md, "The
# weight gradients under a skewed routing"): under the skewed routing 11-31% faster (bf16) and 3-22% (FP8), level under
# the random one. ``MEGAMOE_WGRAD_BY_SIZE=0`` sets it off for a process (``env.wgrad_by_size_requested``).
WGRAD_BY_SIZE = wgrad_by_size_requested()

# The bf16 weight gradients ("dw13", "dw2": ``env.WGRAD_GEMMS``) whose kernel's programs take their blocks in turn
# instead of by a fixed deal: each program's loader takes its next block of the size order from a counter that the
# launch shares (one atomic add a block, a block ahead) and hands it (id, expert, rows) to the MMA partition through a
# ring in shared memory (``take_block``, ``hand_block``, ``taken_block``), so that a program slowed by its blocks
# (their operands missing L2, the stores of many small blocks) takes fewer of them and the launch ends within a block
# of the programs' mean. Under the skewed routing the fixed deal's last program ends 0.43 ms after the median one at
# 235B (dW13, one H100; docs/PERFORMANCE.md, "What is left of the 235B skew"). Each order timed as the layer's stage in
# processes of its own (H100s): dW13 taken in turn 14-20% faster under the skewed routing at 235B (the layer's total
# -4.6 / -5.1%), level at 30B, and level under the random routing (-1.4 to +4.7% a process; the layer's total +0.2 to
# +1.4% in one run); dW2 2-5% slower under the random routing in each of four processes. So dW13 only by default. The
# same blocks, each computed as before: the outputs are bitwise the same. ``MEGAMOE_WGRAD_TAKEN`` sets the set for a
# process (``env.wgrad_taken_requested``).
WGRAD_TAKEN = wgrad_taken_requested()
TAKEN_RING = gl.constexpr(8)  # blocks in flight from a loader to its MMA partition
BLOCK_FIELDS = gl.constexpr(8)  # int32 a block takes in that ring: its id, expert, P, Q, first and end rows (6 used)


# The block trace of the Gluon GEMM kernels (``trace=`` of their launchers; read by ``tools.fp8_trace`` and
# ``tools.kernels_trace``): per program, per partition (TRACE_PARTS: the MMA partitions, then the loader) and per block
# of its first TRACE_BLOCKS, TRACE_POINTS stamps of the SM's cycle counter, then the same points on the global timer
# (ns). An MMA partition's points: the block's start, its first stage ready, its main loop done, its end; the loader's:
# the block's start, its first K-step's copies issued, all of them issued (the fourth unused). Compiled out unless
# traced (constexpr TRACE). The FP8 kernels' two MMA warpgroups are partitions 0 and 1; the bf16 kernels' one MMA
# partition (both warpgroups) is partition 0, and partition 1 is the act kernel's epilogue (its points: the block's
# start, its products ready, its stores issued).
TRACE_BLOCKS = gl.constexpr(512)
TRACE_POINTS = gl.constexpr(4)
TRACE_PARTS = gl.constexpr(3)


def trace_size(programs: int) -> int:
    """The block trace's length (int64 elements) for a launch of ``programs`` programs."""
    return programs * TRACE_PARTS.value * TRACE_BLOCKS.value * 2 * TRACE_POINTS.value


@gluon.jit
def _clock(asm: gl.constexpr, like):
    """A clock register read by ``asm`` (the cycle counter or the global timer), one per element of ``like``."""
    return gl.inline_asm_elementwise(asm, "=l,r", [like], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def stamp(trace_ptr, part: gl.constexpr, block, point: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """With TRACE, point ``point`` of partition ``part``'s block ``block`` (counted from 0 in this program) into the
    block trace (``TRACE_BLOCKS``): the cycle counter and the global timer, stored by one lane."""
    if TRACE:
        one = gl.arange(0, 1, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        at = ((gl.program_id(0) * TRACE_PARTS + part) * TRACE_BLOCKS + block) * (2 * TRACE_POINTS) + point + one
        keep = (block < TRACE_BLOCKS) & (one == 0)
        gl.store(trace_ptr + at, _clock("mov.u64 $0, %clock64;", one), mask=keep)
        gl.store(trace_ptr + at + TRACE_POINTS, _clock("mov.u64 $0, %globaltimer;", one), mask=keep)


@gluon.jit
def stamp_first(trace_ptr, part: gl.constexpr, block, point: gl.constexpr, first, TRACE: gl.constexpr,
                num_warps: gl.constexpr):
    """``stamp`` where ``first`` holds (at a loop's first step, say): with TRACE only, the test included."""
    if TRACE:  # noqa: SIM102 (a Triton condition does not short-circuit)
        if first:
            stamp(trace_ptr, part, block, point, TRACE, num_warps)


@gluon.jit
def block_index(w):
    """Block ``w``'s place among this program's blocks of a persistent grid-stride loop (counted from 0): the phase
    of a barrier passed once per block, and the block's index in the FP8 kernels' block trace."""
    return (w - gl.program_id(0)) // gl.num_programs(0)


@gluon.jit
def next_slot(empty, ready, step, nbytes: gl.constexpr):
    """Loader side of the ring: wait until slot ``step % STAGES`` is free, announce ``nbytes`` on its ready
    barrier, and return the slot."""
    STAGES: gl.constexpr = empty.type.shape[0]
    s = step % STAGES
    mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), nbytes)
    return s


@gluon.jit
def tile_block(w, tile_expert_ptr, tile_row_ptr, num_n, BN: gl.constexpr):
    """Block ``w`` of the busy tiles × N-blocks order: its expert, first sorted row and first column."""
    return gl.load(tile_expert_ptr + w // num_n), gl.load(tile_row_ptr + w // num_n), (w % num_n) * BN


@gluon.jit
def block_rows(w, work, tile_expert_ptr, tile_row_ptr, num_n):
    """Expert and first sorted row of block ``w`` of the busy tiles × N-blocks order, for loading blocks ahead of
    their turn: ``w`` is clamped into the ``work`` blocks (a look-ahead past the last one reads it again, in
    bounds)."""
    t = gl.maximum(gl.minimum(w, work - 1), 0) // num_n
    return gl.load(tile_expert_ptr + t), gl.load(tile_row_ptr + t)


@gluon.jit
def expert_end(offsets_ptr, e, work):
    """Expert ``e``'s end row (its last sorted row + 1), read only if there is ``work`` (with none, ``e`` may be the
    idle marker E, past the offsets)."""
    return gl.load(offsets_ptr + e + 1, mask=work > 0, other=0)


@gluon.jit
def dealt_block(w, tiles):
    """The block that a grid-stride loop's block ``w`` (of ``tiles``) runs in the size order (``wgrad_block``): the
    programs take each full round of blocks from alternate ends (program j the round's j-th block, then the next
    round's j-th from the end), so that the program dealt one round's longest block is dealt the next round's
    shortest; the last, partial round as it comes."""
    n = gl.num_programs(0)
    r = w // n
    back = ((r % 2) == 1) & ((r + 1) * n <= tiles)
    return w + back.to(gl.int32) * (n - 1 - 2 * (w - r * n))


@gluon.jit
def wgrad_block(tile, tiles, offsets_ptr, by_size_ptr, num_p, num_q, BM: gl.constexpr, BN: gl.constexpr,
                BY_SIZE: gl.constexpr, TAKEN: gl.constexpr = False):
    """Block ``tile`` (of ``tiles``) of the expert-major order: its expert, first P and Q, and the expert's sorted rows
    [start, end). BY_SIZE (``WGRAD_BY_SIZE``): the experts in order of their rows, most first (``by_size_ptr``:
    ``plan.experts_by_size``'s table), and ``tile`` the grid-stride loop's block, dealt as ``dealt_block`` says, or,
    with TAKEN (``WGRAD_TAKEN``), the block taken from the launch's counter, as it comes; else the experts in index
    order, ``tile`` as it comes."""
    i = dealt_block(tile, tiles) if BY_SIZE and not TAKEN else tile
    pq = i % (num_p * num_q)
    p0 = (pq // num_q) * BM
    q0 = (pq % num_q) * BN
    if BY_SIZE:
        row = by_size_ptr + 3 * (i // (num_p * num_q))
        e = gl.load(row)
        start = gl.load(row + 1)
        end = gl.load(row + 2)
    else:
        e = i // (num_p * num_q)
        start = gl.load(offsets_ptr + e)
        end = gl.load(offsets_ptr + e + 1)
    return e, p0, q0, start, end


@gluon.jit
def expert_rows_ahead(tile, tiles, offsets_ptr, by_size_ptr, num_p, num_q, BY_SIZE: gl.constexpr):
    """The sorted rows [start, end) of block ``tile``'s expert in the order of ``wgrad_block``, for loading them a
    block ahead of its turn (``tile`` clamped into the ``tiles`` blocks, in bounds): read at the block's start, their
    latency stood between the previous block's last MMA and this one's first."""
    t = gl.minimum(tile, tiles - 1)
    if BY_SIZE:
        row = by_size_ptr + 3 * (dealt_block(t, tiles) // (num_p * num_q))
        start = gl.load(row + 1)
        end = gl.load(row + 2)
    else:
        e = t // (num_p * num_q)
        start = gl.load(offsets_ptr + e)
        end = gl.load(offsets_ptr + e + 1)
    return start, end


@gluon.jit
def take_block(counter_ptr):
    """The next block of the launch (``WGRAD_TAKEN``): one atomic add on the counter that its programs share, zero at
    the launch; values from the number of blocks on mean that none is left."""
    return gl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")


@gluon.jit
def hand_block(ids, full, empty, b, tile, e, p0, q0, start, end, num_warps: gl.constexpr):
    """Loader side of the block ring (``ids``, one slot of ``BLOCK_FIELDS`` int32 per block, with its ``full`` and
    ``empty`` barriers): this program's ``b``-th block (``tile``; its expert, first P and Q and the expert's rows
    [start, end), as ``wgrad_block`` gives them) into slot ``b % depth`` once the slot's last block has been read, so
    that the MMA partition reads them from shared memory rather than waiting on global loads between its blocks."""
    DEPTH: gl.constexpr = ids.type.shape[0]
    FIELDS: gl.constexpr = ids.type.shape[1]
    s = b % DEPTH
    field = gl.arange(0, FIELDS, layout=gl.BlockedLayout([FIELDS], [32], [num_warps], [0]))
    row = gl.where(field == 0, tile, gl.where(field == 1, e, gl.where(field == 2, p0, gl.where(
        field == 3, q0, gl.where(field == 4, start, end)))))
    mbarrier.wait(empty.index(s), ((b // DEPTH) & 1) ^ 1)
    ids.index(s).store(row)
    gl.thread_barrier()  # every thread's store before the one arrival
    mbarrier.arrive(full.index(s), count=1)


@gluon.jit
def taken_block(ids, full, empty, b, num_warps: gl.constexpr):
    """Consumer side of the block ring (``hand_block``): this program's ``b``-th block, (tile, e, p0, q0, start, end),
    its slot then handed back."""
    DEPTH: gl.constexpr = ids.type.shape[0]
    FIELDS: gl.constexpr = ids.type.shape[1]
    s = b % DEPTH
    field = gl.arange(0, FIELDS, layout=gl.BlockedLayout([FIELDS], [32], [num_warps], [0]))
    mbarrier.wait(full.index(s), (b // DEPTH) & 1)
    row = ids.index(s).load(field.type.layout)
    gl.thread_barrier()  # every thread's read before the one arrival
    mbarrier.arrive(empty.index(s), count=1)
    tile = gl.sum(gl.where(field == 0, row, 0), axis=0)
    e = gl.sum(gl.where(field == 1, row, 0), axis=0)
    p0 = gl.sum(gl.where(field == 2, row, 0), axis=0)
    q0 = gl.sum(gl.where(field == 3, row, 0), axis=0)
    start = gl.sum(gl.where(field == 4, row, 0), axis=0)
    end = gl.sum(gl.where(field == 5, row, 0), axis=0)
    return tile, e, p0, q0, start, end


@gluon.jit
def block_ring(depth: gl.constexpr):
    """The block ring of ``hand_block`` and ``taken_block``: ``depth`` slots of ``BLOCK_FIELDS`` int32 in shared
    memory and their full and empty barriers."""
    ids = gl.allocate_shared_memory(gl.int32, [depth, BLOCK_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    return ids, barriers(depth), barriers(depth)


@gluon.jit
def _load_block(a_desc, b_desc, ready, empty, a_bufs, b_bufs, p0, q0, start, end, step, trace_ptr, block,
                TRACE: gl.constexpr):
    """The loader's K-steps of one weight-gradient block (rows [start, end) at P-column p0 and Q-column q0); returns
    the next ring step. TRACE: the block's points 1 and 2 (partition 2)."""
    BK: gl.constexpr = a_desc.block_type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for r0 in range(start, end, BK):
        s = next_slot(empty, ready, step, nbytes)
        tma.async_copy_global_to_shared(a_desc, [r0, p0], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [r0, q0], ready.index(s), b_bufs.index(s))
        step += 1
        stamp_first(trace_ptr, 2, block, 1, r0 == start, TRACE, 1)
    stamp(trace_ptr, 2, block, 2, TRACE, 1)
    return step


@gluon.jit
def _loader(a_desc, b_desc, offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs, num_p, num_q, tiles, trace_ptr,
            counter_ptr, ids, id_full, id_empty, BY_SIZE: gl.constexpr, TAKEN: gl.constexpr, TRACE: gl.constexpr):
    """Producer partition (one warp): every K-step's operand blocks, in the MMA partition's order; with TAKEN each
    block taken from the launch's counter first (``take_block``) and handed to the MMA partition (``hand_block``), one
    past the last block at the end. TRACE: its stamps (partition 2 of ``TRACE_BLOCKS``)."""
    BM: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    step = 0
    if TAKEN:
        # Each block is taken one block ahead, before the loads of the block in hand: the atomic's and the fields'
        # latency then passes while the ring still holds the previous block's last K-steps. A block past the last
        # (the end) reads the last one's fields, in bounds.
        b = 0
        tile = take_block(counter_ptr)
        e, p0, q0, start, end = wgrad_block(gl.minimum(tile, tiles - 1), tiles, offsets_ptr, by_size_ptr, num_p,
                                            num_q, BM, BN, True, True)
        hand_block(ids, id_full, id_empty, b, tile, e, p0, q0, start, end, 1)
        while tile < tiles:
            stamp(trace_ptr, 2, b, 0, TRACE, 1)
            next_tile = take_block(counter_ptr)
            e_next, p_next, q_next, start_next, end_next = wgrad_block(gl.minimum(next_tile, tiles - 1), tiles,
                                                                       offsets_ptr, by_size_ptr, num_p, num_q, BM,
                                                                       BN, True, True)
            step = _load_block(a_desc, b_desc, ready, empty, a_bufs, b_bufs, p0, q0, start, end, step, trace_ptr, b,
                               TRACE)
            b += 1
            hand_block(ids, id_full, id_empty, b, next_tile, e_next, p_next, q_next, start_next, end_next, 1)
            tile, p0, q0, start, end = next_tile, p_next, q_next, start_next, end_next
    else:
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            block = block_index(tile)
            stamp(trace_ptr, 2, block, 0, TRACE, 1)
            _, p0, q0, start, end = wgrad_block(tile, tiles, offsets_ptr, by_size_ptr, num_p, num_q, BM, BN, BY_SIZE)
            step = _load_block(a_desc, b_desc, ready, empty, a_bufs, b_bufs, p0, q0, start, end, step, trace_ptr,
                               block, TRACE)


@gluon.constexpr_function
def wgmma_acc_layout(cols, num_warps, k):
    """The warpgroup MMA accumulator layout of a block ``cols`` wide: warps stacked down the rows, one
    m16 x ``cols`` x ``k`` instruction shape (``k`` 16 for 16-bit operands, 32 for e4m3)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, k])


@gluon.constexpr_function
def row_segments(cols, bytes_per_elem, num_warps):
    """16 contiguous bytes of a row per thread (8 bf16, 16 e4m3), a warp across up to 32 of them, warps down the
    rows: each global load or store of a block in it is one 16-byte ``ld``/``st.global.v4`` per thread."""
    per_thread = 16 // bytes_per_elem
    lanes = min(32, cols // per_thread)
    return gl.BlockedLayout([1, per_thread], [32 // lanes, lanes], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def staged_layout(shape, dtype):
    """A staging buffer's layout for a block of ``shape`` and ``dtype`` (``store_staged``): the MMA operands'
    128-byte swizzle, so that both the accumulator-layout writes and the 16-byte row reads meet few bank
    conflicts."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), dtype)


@gluon.jit
def _store_rows_of(val, stage, out_ptr, first, end, c0, stride, limit, num_warps: gl.constexpr):
    """``store_staged`` of a block no larger than ``stage``."""
    ROWS: gl.constexpr = val.type.shape[0]
    COLS: gl.constexpr = val.type.shape[1]
    layout: gl.constexpr = row_segments(COLS, val.dtype.primitive_bitwidth // 8, num_warps)
    buf = stage._reinterpret(val.dtype, [ROWS, COLS], staged_layout([ROWS, COLS], val.dtype))
    buf.store(val)
    gl.thread_barrier()  # the partition's writes before its reads
    seg = buf.load(layout)
    gl.thread_barrier()  # and its reads before the next writes
    local = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = c0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    mask = (first + local < end)[:, None] & (cols < limit)[None, :]
    gl.store(out_ptr + first.to(gl.int64) * stride + (local[:, None] * stride + cols[None, :]), seg, mask=mask)


@gluon.jit
def store_staged(val, stage, out_ptr, first, end, c0, stride, limit, num_warps: gl.constexpr):
    """An epilogue's block ``val`` (any distributed layout, e.g. the MMA accumulator's) into rows [first, end) of
    the row-major ``out_ptr`` (``stride`` elements per row) at columns c0 .. (those < ``limit``), through the
    partition's shared staging buffer ``stage`` (any 2-D shape and dtype; ``staged_layout``): written from val's
    layout, read back in ``row_segments`` and stored from those, so that a warp's store covers whole 128-byte lines.
    (From the accumulator's layout a warp's 4-byte stores touch 8 rows x 16 bytes each, and a ``convert_layout``
    takes compiler scratch of the whole block.) A block larger than the buffer leaves as its left and right column
    halves, split in registers (each thread holds both)."""
    ROWS: gl.constexpr = val.type.shape[0]
    COLS: gl.constexpr = val.type.shape[1]
    STAGE_BYTES: gl.constexpr = stage.type.shape[0] * stage.type.shape[1] * (stage.dtype.primitive_bitwidth // 8)
    if ROWS * COLS * (val.dtype.primitive_bitwidth // 8) > STAGE_BYTES:
        lo, hi = gl.split(gl.permute(gl.reshape(val, [ROWS, 2, COLS // 2]), [0, 2, 1]))
        _store_rows_of(lo, stage, out_ptr, first, end, c0, stride, limit, num_warps)
        _store_rows_of(hi, stage, out_ptr, first, end, c0 + COLS // 2, stride, limit, num_warps)
    else:
        _store_rows_of(val, stage, out_ptr, first, end, c0, stride, limit, num_warps)


@gluon.jit
def _zero_rows_past(buf, r0, end, num_warps: gl.constexpr):
    """Zero the rows of a (BK, X) operand block in shared memory whose sorted row r0 + i is >= end."""
    BK: gl.constexpr = buf.type.shape[0]
    X: gl.constexpr = buf.type.shape[1]
    layout: gl.constexpr = row_segments(X, 2, num_warps)
    rows = r0 + gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    block = buf.load(layout)
    buf.store(gl.where((rows < end)[:, None], block, gl.zeros([BK, X], block.dtype, layout)))


@gluon.jit
def _wgrad_main(ready, empty, a_bufs, b_bufs, start, end, step, trace_ptr, block, acc_layout: gl.constexpr,
                TRACE: gl.constexpr, num_warps: gl.constexpr):
    """The MMAs of one weight-gradient block over its expert's rows [start, end), the rows past the expert zeroed in
    the last, partial step; returns the accumulator and the next ring step. TRACE: the block's points 1 and 2."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[1]
    BM: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[2]
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for r0 in range(start, end, BK):
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        stamp_first(trace_ptr, 0, block, 1, r0 == start, TRACE, num_warps)
        if r0 + BK > end:  # the expert's last, partial step
            _zero_rows_past(a_bufs.index(s), r0, end, num_warps)
            _zero_rows_past(b_bufs.index(s), r0, end, num_warps)
            fence_async_shared()
        acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        if r0 > start:  # the previous step's MMA is done: its buffers go back to the loader
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
        step += 1
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    if end > start:
        mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
    stamp(trace_ptr, 0, block, 2, TRACE, num_warps)
    return acc, step


@gluon.jit
def _mma_partition(dw_desc, offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs, c_smem, num_p, num_q, tiles,
                   trace_ptr, ids, id_full, id_empty, BY_SIZE: gl.constexpr, TAKEN: gl.constexpr, TRACE: gl.constexpr,
                   num_warps: gl.constexpr):
    """Default partition: the MMAs of each block, its tail rows zeroed, and its TMA store; with TAKEN the blocks the
    loader hands over (``taken_block``), the next one's read after this one's MMAs. TRACE: its stamps (partition 0 of
    ``TRACE_BLOCKS``)."""
    BM: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[2]
    acc_layout: gl.constexpr = wgmma_acc_layout(BN, num_warps, 16)
    step = 0
    if TAKEN:
        b = 0
        tile, e, p0, q0, start, end = taken_block(ids, id_full, id_empty, b, num_warps)
        while tile < tiles:
            stamp(trace_ptr, 0, b, 0, TRACE, num_warps)
            acc, step = _wgrad_main(ready, empty, a_bufs, b_bufs, start, end, step, trace_ptr, b, acc_layout, TRACE,
                                    num_warps)
            next_tile, e_next, p_next, q_next, start, end = taken_block(ids, id_full, id_empty, b + 1, num_warps)
            store_block(acc.to(dw_desc.dtype), c_smem, dw_desc, e, p0, q0)
            stamp(trace_ptr, 0, b, 3, TRACE, num_warps)
            tile, e, p0, q0 = next_tile, e_next, p_next, q_next
            b += 1
    else:
        start, end = expert_rows_ahead(gl.program_id(0), tiles, offsets_ptr, by_size_ptr, num_p, num_q, BY_SIZE)
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            block = block_index(tile)
            stamp(trace_ptr, 0, block, 0, TRACE, num_warps)
            e, p0, q0, _, _ = wgrad_block(tile, tiles, offsets_ptr, by_size_ptr, num_p, num_q, BM, BN, BY_SIZE)
            start_next, end_next = expert_rows_ahead(tile + gl.num_programs(0), tiles, offsets_ptr, by_size_ptr, num_p,
                                                     num_q, BY_SIZE)
            acc, step = _wgrad_main(ready, empty, a_bufs, b_bufs, start, end, step, trace_ptr, block, acc_layout,
                                    TRACE, num_warps)
            store_block(acc.to(dw_desc.dtype), c_smem, dw_desc, e, p0, q0)
            stamp(trace_ptr, 0, block, 3, TRACE, num_warps)
            start, end = start_next, end_next
    tma.store_wait(0)


@gluon.jit
def store_block(out, c_smem, desc, e, p0, q0):
    """``out`` into ``desc``'s (E, P, Q) tensor at [e, p0, q0] by a TMA store through ``c_smem`` (block (1, rows,
    cols)), once the previous store has read it out; the store runs on after the call returns."""
    tma.store_wait(0)
    c_smem.reshape(out.type.shape).store(out)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [e, p0, q0], c_smem)


@gluon.jit
def _wgrad_ws_kernel(a_desc, b_desc, dw_desc, offsets_ptr, num_p, num_q, tiles, rows_ptr, topk_idx_ptr, out_ptr, T, D,
                     trace_ptr, by_size_ptr, counter_ptr, TOP_K: gl.constexpr, STAGES: gl.constexpr,
                     TRACE: gl.constexpr, BY_SIZE: gl.constexpr, TAKEN: gl.constexpr, num_warps: gl.constexpr):
    """a_desc: (N, P) sorted rows, block (BK, BM); b_desc: (N, Q), block (BK, BN); dw_desc: (E, P, Q),
    block (1, BM, BN). Tiles: E * num_p * num_q output blocks, expert-major. A third partition (``COPY_WARPS``
    warps) combines slot rows (T * TOP_K, D) into out (T, D) beside them (``_combine_partition``; ``topk_idx``
    marks the dropped slots); with T = 0 it has nothing to do and returns. TRACE: the MMA partition's and the
    loader's stamps into trace_ptr (int64, ``TRACE_BLOCKS``). BY_SIZE: the blocks dealt in order of their experts'
    rows (``wgrad_block``; by_size_ptr ``plan.experts_by_size``'s table). TAKEN: the blocks of that order taken in
    turn from the counter at counter_ptr (int32, zero; ``WGRAD_TAKEN``)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dw_desc.dtype, dw_desc.block_type.shape, dw_desc.layout)
    ready = barriers(STAGES)
    empty = barriers(STAGES)
    if TAKEN:
        ids, id_full, id_empty = block_ring(TAKEN_RING)
    else:  # never read: the fixed deal's partitions know their blocks
        ids, id_full, id_empty = ready, ready, ready
    gl.warp_specialize([
        (_mma_partition, (dw_desc, offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs, c_smem, num_p, num_q, tiles,
                          trace_ptr, ids, id_full, id_empty, BY_SIZE, TAKEN, TRACE, num_warps)),
        (_loader, (a_desc, b_desc, offsets_ptr, by_size_ptr, ready, empty, a_bufs, b_bufs, num_p, num_q, tiles,
                   trace_ptr, counter_ptr, ids, id_full, id_empty, BY_SIZE, TAKEN, TRACE)),
        (_combine_partition, (rows_ptr, topk_idx_ptr, out_ptr, T, D, TOP_K, COPY_WARPS)),
    ], [1, COPY_WARPS], [SIDE_REGS, SIDE_REGS])


@gluon.jit
def count_busy_tiles(offsets_ptr, E, EB: gl.constexpr, TILE_M: gl.constexpr, num_warps: gl.constexpr):
    """How many plan tiles hold rows (they come first in the tile table): the sum over experts of
    ceil(rows / TILE_M). EB: a power of two >= E."""
    experts = gl.arange(0, EB, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    lo = gl.load(offsets_ptr + experts, mask=experts < E, other=0)
    hi = gl.load(offsets_ptr + experts + 1, mask=experts < E, other=0)
    return gl.sum((hi - lo + TILE_M - 1) // TILE_M, axis=0)


@gluon.jit
def barriers(count: gl.constexpr, arrivals: gl.constexpr = 1):
    """``count`` mbarriers, each completing on ``arrivals`` arrivals (plus, for TMA, its expected bytes): one,
    or for a ring that a gathering loader fills, one plus a cp.async arrival per loader thread."""
    bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(count):
        mbarrier.init(bars.index(i), count=arrivals)
    return bars


@gluon.jit
def _tiles_loader(a_desc, w_desc, tile_expert_ptr, tile_row_ptr, ready, empty, a_bufs, w_bufs, u_bufs, K, num_n, work,
                  trace_ptr, GATE_UP: gl.constexpr, TRACE: gl.constexpr):
    """Producer partition (one warp) of the kernels over the plan's busy tiles × N-blocks: per block, its
    K-steps (the sorted rows ``a`` and the expert's weight blocks) into the ring. Without ``GATE_UP``: w (E, K, N),
    block (1, BK, BN), into ``w_bufs`` (``u_bufs`` unread). With it: gate and up weights (E, 2, I, K), block
    (1, 1, BN, BK), into ``w_bufs`` and ``u_bufs``. TRACE: its stamps (partition 2 of ``TRACE_BLOCKS``)."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[2]  # (1, BK, BN) or (1, 1, BN, BK)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + (2 if GATE_UP else 1) * w_desc.block_type.nbytes
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = block_index(w)
        stamp(trace_ptr, 2, block, 0, TRACE, 1)
        e, row0, n0 = tile_block(w, tile_expert_ptr, tile_row_ptr, num_n, BN)
        for k in range(0, K, BK):
            s = next_slot(empty, ready, step, nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, k], ready.index(s), a_bufs.index(s))
            if GATE_UP:
                tma.async_copy_global_to_shared(w_desc, [e, 0, n0, k], ready.index(s), w_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [e, 1, n0, k], ready.index(s), u_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(w_desc, [e, k, n0], ready.index(s), w_bufs.index(s))
            step += 1
            stamp_first(trace_ptr, 2, block, 1, k == 0, TRACE, 1)
        stamp(trace_ptr, 2, block, 2, TRACE, 1)


@gluon.constexpr_function
def _items_layout(per_thread, num_warps):
    """Items down the rows, ``per_thread`` contiguous elements per thread along each item's row chunk (8: one
    16-byte vector of a 16-bit type): a thread holds one vector per item of the pass."""
    return gl.BlockedLayout([1, per_thread], [1, 32], [1, num_warps], [1, 0])


@gluon.constexpr_function
def _items_per_pass(top_k):
    """How many (token, column chunk) items a side copy moves per pass: 8 // top_k, so that a pass moves about
    eight rows' chunks whatever top_k is. A pass costs about one load latency, whatever it moves: with one item
    per pass, at top_k = 1 the copies took longer than the GEMMs beside them (docs/PERFORMANCE.md)."""
    return max(1, 8 // top_k)


@gluon.jit
def _pass_items(first, group, cols, chunks, T, D, BD: gl.constexpr):
    """The side copies' items ``first + group`` of the T * chunks (token, BD-column chunk) items: whether each
    exists, its token, its columns (G, BD) and their mask."""
    item = first + group
    valid = item < T * chunks
    c = ((item % chunks) * BD)[:, None] + cols[None, :]
    return valid, item // chunks, c, valid[:, None] & (c < D)


@gluon.jit
def _scatter_rows_partition(src_ptr, dst_ptr, slot_row_ptr, offsets_ptr, T, D, E, TOP_K: gl.constexpr,
                            num_warps: gl.constexpr):
    """A side job beside the MMAs (``expert_bwd._scatter_rows_kernel`` for one tensor): each token's row of src
    (T, D) into its TOP_K sorted rows of dst (N, D); slots past the routed rows (dropped) are not written. The
    programs share the (token, column chunk) items, several per pass when TOP_K is small; the copy reads and
    writes HBM while the MMAs, which it does not feed, keep the tensor cores busy."""
    BD: gl.constexpr = 16 * 32 * num_warps  # two 16-byte vectors per thread and item: one load, TOP_K stores
    G: gl.constexpr = _items_per_pass(TOP_K)
    layout: gl.constexpr = _items_layout(16, num_warps)
    cols = gl.arange(0, BD, layout=gl.SliceLayout(0, layout))
    group = gl.arange(0, G, layout=gl.SliceLayout(1, layout))
    routed = gl.load(offsets_ptr + E)
    chunks = gl.cdiv(D, BD)
    for first in range(gl.program_id(0) * G, T * chunks, gl.num_programs(0) * G):
        valid, t, c, mask = _pass_items(first, group, cols, chunks, T, D, BD)
        row = gl.load(src_ptr + t.to(gl.int64)[:, None] * D + c, mask=mask)
        for k in gl.static_range(TOP_K):
            r = gl.load(slot_row_ptr + t * TOP_K + k, mask=valid, other=0)
            gl.store(dst_ptr + r.to(gl.int64)[:, None] * D + c, row, mask=mask & (r < routed)[:, None])


@gluon.jit
def _combine_partition(rows_ptr, topk_idx_ptr, out_ptr, T, D, TOP_K: gl.constexpr, num_warps: gl.constexpr):
    """A side job beside the MMAs (``combine._combine_kernel``): out[t] = the sum over k of rows[t * TOP_K + k]
    for the slots not dropped (topk_idx >= 0), in slot order, in fp32 — the same sums as that kernel. The
    programs share the (token, column chunk) items, several per pass when TOP_K is small."""
    BD: gl.constexpr = 8 * 32 * num_warps  # one 16-byte vector per thread, item and slot
    G: gl.constexpr = _items_per_pass(TOP_K)
    layout: gl.constexpr = _items_layout(8, num_warps)
    cols = gl.arange(0, BD, layout=gl.SliceLayout(0, layout))
    group = gl.arange(0, G, layout=gl.SliceLayout(1, layout))
    chunks = gl.cdiv(D, BD)
    for first in range(gl.program_id(0) * G, T * chunks, gl.num_programs(0) * G):
        valid, t, c, mask = _pass_items(first, group, cols, chunks, T, D, BD)
        acc = gl.zeros([G, BD], gl.float32, layout)
        for k in gl.static_range(TOP_K):
            e = gl.load(topk_idx_ptr + t * TOP_K + k, mask=valid, other=-1)
            v = gl.load(rows_ptr + (t.to(gl.int64) * TOP_K + k)[:, None] * D + c, mask=mask & (e >= 0)[:, None],
                        other=0.0)
            acc += v.to(gl.float32)
        gl.store(out_ptr + t.to(gl.int64)[:, None] * D + c, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _dh_mma_partition(out_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, a_bufs, w_bufs, N_OUT, K,
                      num_n, work, trace_ptr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Default partition of ``_dh_ws_kernel``: the MMAs of each block and its masked epilogue; TRACE: its stamps
    (partition 0 of ``TRACE_BLOCKS``)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = w_bufs.type.shape[3]  # [STAGES, 1, BK, BN]
    acc_layout: gl.constexpr = wgmma_acc_layout(BN, num_warps, 16)
    out_layout: gl.constexpr = row_segments(BN, 2, num_warps)
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = block_index(w)
        stamp(trace_ptr, 0, block, 0, TRACE, num_warps)
        e, row0, n0 = tile_block(w, tile_expert_ptr, tile_row_ptr, num_n, BN)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for k in range(0, K, BK):
            s = step % STAGES
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
            stamp_first(trace_ptr, 0, block, 1, k == 0, TRACE, num_warps)
            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).reshape([BK, BN]), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            if k > 0:
                mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
            step += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
        stamp(trace_ptr, 0, block, 2, TRACE, num_warps)
        # Through shared memory into a layout of 16-byte row segments: stores straight from the
        # accumulator's layout are 4 bytes each (the kernel lost 3-23% to Triton's, which converts).
        out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), out_layout)
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
        cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        mask = (rows < gl.load(offsets_ptr + e + 1))[:, None] & (cols < N_OUT)[None, :]
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * N_OUT + cols[None, :], out, mask=mask)
        stamp(trace_ptr, 0, block, 3, TRACE, num_warps)


@gluon.jit
def _dh_ws_kernel(a_desc, w_desc, out_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, x_ptr, x_sorted_ptr, slot_row_ptr,
                  T, N_OUT, K, E, trace_ptr, EB: gl.constexpr, TILE_M: gl.constexpr, TOP_K: gl.constexpr,
                  STAGES: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """a_desc: (N, K) sorted dy rows, block (TILE_M, BK); w_desc: W2 (E, K, N_OUT), block (1, BK, BN); out (N, N_OUT)
    in sorted rows; other arguments as for ``expert_fwd.sorted_rows_gemm_kernel``. Blocks: the busy tiles
    (counted from the offsets; EB a power of two >= E) times the N-blocks. A third partition (``COPY_WARPS`` warps)
    copies x (T, K) into sorted rows (``x_sorted``, through each slot's sorted row ``slot_row``) for the kernels
    after this one; with T = 0 it has nothing to do and returns. TRACE: the MMA partition's and the loader's stamps
    into trace_ptr (int64, ``TRACE_BLOCKS``)."""
    BN: gl.constexpr = w_desc.block_type.shape[2]
    num_n = gl.cdiv(N_OUT, BN)
    work = count_busy_tiles(offsets_ptr, E, EB, TILE_M, num_warps) * num_n
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = barriers(STAGES)
    empty = barriers(STAGES)
    gl.warp_specialize([
        (_dh_mma_partition, (out_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, a_bufs, w_bufs, N_OUT,
                             K, num_n, work, trace_ptr, TRACE, num_warps)),
        (_tiles_loader, (a_desc, w_desc, tile_expert_ptr, tile_row_ptr, ready, empty, a_bufs, w_bufs, w_bufs, K, num_n,
                         work, trace_ptr, False, TRACE)),
        (_scatter_rows_partition, (x_ptr, x_sorted_ptr, slot_row_ptr, offsets_ptr, T, K, E, TOP_K, COPY_WARPS)),
    ], [1, COPY_WARPS], [SIDE_REGS, SIDE_REGS])


@gluon.jit
def _gate_up_mainloop(ready, empty, x_bufs, g_bufs, u_bufs, step, D, trace_ptr, block, acc_layout: gl.constexpr,
                      GENERIC_WRITES: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """One block's K-loop over the ring for the gate and up accumulators (x rows times both weight
    blocks), one MMA pair in flight; returns both accumulators and the next ring step. GENERIC_WRITES:
    the loader wrote x through generic-proxy copies (cp.async), fenced before the MMAs read them. TRACE: the
    block's points 1 and 2 (partition 0 of ``TRACE_BLOCKS``)."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[3]  # [STAGES, 1, 1, BN, BK]
    acc_g = gl.zeros([BM, BN], gl.float32, acc_layout)
    acc_u = gl.zeros([BM, BN], gl.float32, acc_layout)
    for k in range(0, D, BK):
        s = step % STAGES
        mbarrier.wait(ready.index(s), (step // STAGES) & 1)
        stamp_first(trace_ptr, 0, block, 1, k == 0, TRACE, num_warps)
        if GENERIC_WRITES:
            fence_async_shared()
        acc_g = warpgroup_mma(x_bufs.index(s), g_bufs.index(s).reshape([BN, BK]).permute((1, 0)), acc_g, is_async=True)
        acc_u = warpgroup_mma(x_bufs.index(s), u_bufs.index(s).reshape([BN, BK]).permute((1, 0)), acc_u, is_async=True)
        acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))
        if k > 0:
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
        step += 1
    acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
    mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
    stamp(trace_ptr, 0, block, 2, TRACE, num_warps)
    return acc_g, acc_u, step


@gluon.jit
def _act_mma_partition(ready, empty, gu_ready, gu_empty, x_bufs, g_bufs, u_bufs, gu_smem, D, work, trace_ptr,
                       TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Default partition of ``_act_ws_kernel``: both GEMMs of each block, then g and u, rounded to the operands'
    dtype, into ``gu_smem`` for the epilogue partition, and on to the next block's GEMMs. TRACE: its stamps
    (partition 0 of ``TRACE_BLOCKS``; the block's end once g and u are handed over)."""
    BN: gl.constexpr = g_bufs.type.shape[3]  # [STAGES, 1, 1, BN, BK]
    acc_layout: gl.constexpr = wgmma_acc_layout(BN, num_warps, 16)
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        stamp(trace_ptr, 0, block_index(w), 0, TRACE, num_warps)
        acc_g, acc_u, step = _gate_up_mainloop(ready, empty, x_bufs, g_bufs, u_bufs, step, D, trace_ptr,
                                               block_index(w), acc_layout, False, TRACE, num_warps)
        block = block_index(w)
        mbarrier.wait(gu_empty.index(0), (block & 1) ^ 1)  # the epilogue has read the previous block's
        gu_smem.index(0).store(acc_g.to(gu_smem.dtype))
        gu_smem.index(1).store(acc_u.to(gu_smem.dtype))
        gl.thread_barrier()  # every thread's stores before the one arrival
        mbarrier.arrive(gu_ready.index(0), count=1)
        stamp(trace_ptr, 0, block, 3, TRACE, num_warps)


@gluon.jit
def _act_epilogue_partition(weights_ptr, dh_ptr, dz_ptr, hw_ptr, dweight_part_ptr, row_slot_ptr, offsets_ptr,
                            tile_expert_ptr, tile_row_ptr, gu_ready, gu_empty, gu_smem, N, I, num_n, work, trace_ptr,
                            PART_COLS: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Epilogue partition of ``_act_ws_kernel``, ``expert_bwd._act_bwd_kernel``'s epilogue on each
    block's g and u from ``gu_smem`` and its dh' rows (loaded here), ``CHUNK`` rows at a time, in a layout of
    16-byte row segments: h, the d(weight) partials, dz = [dg | du] and h * w, masked to the expert's rows and
    to I. It overlaps the MMA partition's next block. TRACE: its stamps (partition 1 of ``TRACE_BLOCKS``: the block's
    start, its g and u ready, its stores issued, its end once it has let go of them)."""
    BM: gl.constexpr = gu_smem.type.shape[1]
    BN: gl.constexpr = gu_smem.type.shape[2]
    CHUNK: gl.constexpr = 16
    layout: gl.constexpr = row_segments(BN, 2, num_warps)
    dtype: gl.constexpr = dz_ptr.dtype.element_ty
    local = gl.arange(0, BN, layout=gl.SliceLayout(0, layout)) // PART_COLS
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        stamp(trace_ptr, 1, block_index(w), 0, TRACE, num_warps)
        e, row0, n0 = tile_block(w, tile_expert_ptr, tile_row_ptr, num_n, BN)
        pid_n = w % num_n
        end = gl.load(offsets_ptr + e + 1)
        cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        mbarrier.wait(gu_ready.index(0), block_index(w) & 1)
        stamp(trace_ptr, 1, block_index(w), 1, TRACE, num_warps)
        for c in gl.static_range(BM // CHUNK):
            rows = row0 + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            rmask = rows < end
            mask = rmask[:, None] & (cols < I)[None, :]
            rows64 = rows.to(gl.int64)[:, None]
            dhp = gl.load(dh_ptr + rows64 * I + cols[None, :], mask=mask, other=0.0).to(gl.float32)
            slots = gl.load(row_slot_ptr + rows, mask=rmask, other=0).to(gl.int64)
            wt = gl.load(weights_ptr + slots, mask=rmask, other=0.0).to(gl.float32)
            g = gu_smem.index(0).slice(c * CHUNK, CHUNK).load(layout).to(gl.float32)
            u = gu_smem.index(1).slice(c * CHUNK, CHUNK).load(layout).to(gl.float32)
            sig = 1.0 / (1.0 + gl.exp(-g))
            silu = g * sig
            h = silu * u
            dwh = dhp * h
            for j in gl.static_range(BN // PART_COLS):
                part_row = pid_n * (BN // PART_COLS) + j
                gl.store(dweight_part_ptr + part_row.to(gl.int64) * N + slots,
                         gl.sum(gl.where((local == j)[None, :], dwh, 0.0), axis=1),
                         mask=rmask & (part_row * PART_COLS < I))
            dh = dhp * wt[:, None]
            dz_ptrs = dz_ptr + rows64 * 2 * I + cols[None, :]
            gl.store(dz_ptrs, (dh * u * (sig + silu * (1.0 - sig))).to(dtype), mask=mask)
            gl.store(dz_ptrs + I, (dh * silu).to(dtype), mask=mask)
            gl.store(hw_ptr + rows64 * I + cols[None, :], (h * wt[:, None]).to(dtype), mask=mask)
        stamp(trace_ptr, 1, block_index(w), 2, TRACE, num_warps)
        gl.thread_barrier()  # every thread's reads of gu_smem before the one arrival
        mbarrier.arrive(gu_empty.index(0), count=1)
        stamp(trace_ptr, 1, block_index(w), 3, TRACE, num_warps)


@gluon.jit
def _act_ws_kernel(x_desc, w13_desc, dh_ptr, weights_ptr, dz_ptr, hw_ptr, dweight_part_ptr, row_slot_ptr, offsets_ptr,
                   tile_expert_ptr, tile_row_ptr, N, D, I, E, trace_ptr, EB: gl.constexpr, TILE_M: gl.constexpr,
                   PART_COLS: gl.constexpr, STAGES: gl.constexpr, EPILOGUE_WARPS: gl.constexpr,
                   EPILOGUE_REGS: gl.constexpr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """The act kernel (``expert_bwd._act_bwd_kernel``): x_desc (N, D) sorted rows,
    block (TILE_M, BK); w13_desc (E, 2, I, D), block (1, 1, BN, BK); dh (N, I) dh' in sorted rows; outputs and
    other arguments as for the Triton kernel. Blocks: the busy tiles times the I-blocks. Three partitions: the
    TMA loader (one warp), the MMAs (``num_warps``), the epilogue (``EPILOGUE_WARPS``), which takes each block's
    g and u through shared memory (rounded to the operands' dtype) while the MMAs run the next block. TRACE: the
    three partitions' stamps into trace_ptr (int64, ``TRACE_BLOCKS``)."""
    BN: gl.constexpr = w13_desc.block_type.shape[2]
    num_n = gl.cdiv(I, BN)
    work = count_busy_tiles(offsets_ptr, E, EB, TILE_M, num_warps) * num_n
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    g_bufs = gl.allocate_shared_memory(w13_desc.dtype, [STAGES] + w13_desc.block_type.shape, w13_desc.layout)
    u_bufs = gl.allocate_shared_memory(w13_desc.dtype, [STAGES] + w13_desc.block_type.shape, w13_desc.layout)
    gu_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_M, BN], w13_desc.dtype)
    gu_smem = gl.allocate_shared_memory(w13_desc.dtype, [2, TILE_M, BN], gu_layout)
    ready = barriers(STAGES)
    empty = barriers(STAGES)
    gu_ready = barriers(1)
    gu_empty = barriers(1)
    gl.warp_specialize([
        (_act_mma_partition, (ready, empty, gu_ready, gu_empty, x_bufs, g_bufs, u_bufs, gu_smem, D, work, trace_ptr,
                              TRACE, num_warps)),
        (_tiles_loader, (x_desc, w13_desc, tile_expert_ptr, tile_row_ptr, ready, empty, x_bufs, g_bufs, u_bufs, D, num_n,
                         work, trace_ptr, True, TRACE)),
        (_act_epilogue_partition, (weights_ptr, dh_ptr, dz_ptr, hw_ptr, dweight_part_ptr, row_slot_ptr, offsets_ptr,
                                   tile_expert_ptr, tile_row_ptr, gu_ready, gu_empty, gu_smem, N, I, num_n, work,
                                   trace_ptr, PART_COLS, TRACE, EPILOGUE_WARPS)),
    ], [1, EPILOGUE_WARPS], [24, EPILOGUE_REGS])


@gluon.jit
def _up_loader(x_ptr, w13_desc, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, x_bufs, g_bufs,
               u_bufs, D, top_k, num_n, work, trace_ptr, TRACE: gl.constexpr, num_warps: gl.constexpr):
    """Producer partition (4 warps) of ``_up_ws_kernel``: per K-step, the gate and up weight blocks through
    TMA and the block's x rows, gathered from their tokens through 16-byte ``cp.async`` copies (rows past
    the expert's end zero-filled). Each thread's copies arrive on the stage's ready barrier when they
    land, so the barrier completes on the TMA bytes and every producer thread's copies. TRACE: its stamps
    (partition 2 of ``TRACE_BLOCKS``)."""
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = w13_desc.block_type.shape[2]
    layout: gl.constexpr = row_segments(BK, 2, num_warps)
    # D itself (its rows are 16-byte multiples: api.fused_supports), written so that the compiler knows it is a
    # multiple of 8 elements even where D is not one of 16: else its row offsets and column mask could split a
    # 16-byte copy, and cp.async has no 2-byte form (the kernel would not compile for D = 40, 136, 520).
    D8 = D // 8 * 8
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = block_index(w)
        stamp(trace_ptr, 2, block, 0, TRACE, num_warps)
        e, row0, n0 = tile_block(w, tile_expert_ptr, tile_row_ptr, num_n, BN)
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        rmask = rows < gl.load(offsets_ptr + e + 1)
        tok = (gl.load(row_slot_ptr + rows, mask=rmask, other=0) // top_k).to(gl.int64)
        cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
        ptrs = x_ptr + tok[:, None] * D8 + cols[None, :]
        for k in range(0, D, BK):
            s = next_slot(empty, ready, step, 2 * w13_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w13_desc, [e, 0, n0, k], ready.index(s), g_bufs.index(s))
            tma.async_copy_global_to_shared(w13_desc, [e, 1, n0, k], ready.index(s), u_bufs.index(s))
            # Whole 16-byte chunks in or out: rows are 16-byte multiples (api.fused_supports).
            async_copy.async_copy_global_to_shared(x_bufs.index(s), ptrs + k, mask=rmask[:, None] & (cols + k < D8)[None, :])
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            step += 1
            stamp_first(trace_ptr, 2, block, 1, k == 0, TRACE, num_warps)
        stamp(trace_ptr, 2, block, 2, TRACE, num_warps)


@gluon.jit
def swiglu(acc_g, acc_u):
    """h = silu(g) * u in fp32 from the gate and up accumulators: the one expression of every Gluon up kernel, so that
    their h agree bit for bit."""
    return acc_g / (1.0 + gl.exp(-acc_g)) * acc_u


@gluon.jit
def _up_mma_partition(h_ptr, preact_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, x_bufs, g_bufs,
                      u_bufs, staging, D, I, num_n, work, trace_ptr, SAVE_PREACT: gl.constexpr, TRACE: gl.constexpr,
                      num_warps: gl.constexpr):
    """Default partition of ``_up_ws_kernel``: both GEMMs of each block, then h = silu(g) * u, masked to the expert's
    rows and to I; with SAVE_PREACT also g and u, rounded to h's dtype, into preact (N, 2I) at columns n0 and
    I + n0; each through the staging buffer (``store_staged``). TRACE: its stamps (partition 0 of ``TRACE_BLOCKS``)."""
    BN: gl.constexpr = g_bufs.type.shape[3]  # [STAGES, 1, 1, BN, BK]
    acc_layout: gl.constexpr = wgmma_acc_layout(BN, num_warps, 16)
    dtype: gl.constexpr = h_ptr.dtype.element_ty
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        block = block_index(w)
        stamp(trace_ptr, 0, block, 0, TRACE, num_warps)
        e, row0, n0 = tile_block(w, tile_expert_ptr, tile_row_ptr, num_n, BN)
        acc_g, acc_u, step = _gate_up_mainloop(ready, empty, x_bufs, g_bufs, u_bufs, step, D, trace_ptr, block,
                                               acc_layout, True, TRACE, num_warps)
        end = gl.load(offsets_ptr + e + 1)
        h = swiglu(acc_g, acc_u).to(dtype)
        store_staged(h, staging, h_ptr, row0, end, n0, I, I, num_warps)
        if SAVE_PREACT:
            store_staged(acc_g.to(dtype), staging, preact_ptr, row0, end, n0, 2 * I, I, num_warps)
            store_staged(acc_u.to(dtype), staging, preact_ptr + I, row0, end, n0, 2 * I, I, num_warps)
        stamp(trace_ptr, 0, block, 3, TRACE, num_warps)


@gluon.jit
def _up_ws_kernel(x_ptr, w13_desc, h_ptr, preact_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, D, I,
                  E, top_k, trace_ptr, EB: gl.constexpr, TILE_M: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  LOADER_WARPS: gl.constexpr, SAVE_PREACT: gl.constexpr, TRACE: gl.constexpr,
                  num_warps: gl.constexpr):
    """The one-device up kernel (``expert_fwd._up_swiglu_fwd_kernel``): x (T, D)
    gathered by token, w13_desc (E, 2, I, D), block (1, 1, BN, BK); h (N, I) out in sorted rows, and with
    SAVE_PREACT the gate/up products (N, 2I) into preact (the saved-activation mode). Blocks:
    the busy tiles times the I-blocks. Each ready barrier counts the loader's TMA arrival and one
    ``cp.async`` arrival per loader thread. The epilogue's stores go through a staging buffer of half a block.
    TRACE: the MMA partition's and the loader's stamps into trace_ptr (int64, ``TRACE_BLOCKS``)."""
    BN: gl.constexpr = w13_desc.block_type.shape[2]
    num_n = gl.cdiv(I, BN)
    work = count_busy_tiles(offsets_ptr, E, EB, TILE_M, num_warps) * num_n
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_M, BK], x_ptr.dtype.element_ty)
    x_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, TILE_M, BK], x_layout)
    g_bufs = gl.allocate_shared_memory(w13_desc.dtype, [STAGES] + w13_desc.block_type.shape, w13_desc.layout)
    u_bufs = gl.allocate_shared_memory(w13_desc.dtype, [STAGES] + w13_desc.block_type.shape, w13_desc.layout)
    staging = gl.allocate_shared_memory(w13_desc.dtype, [TILE_M, BN // 2],
                                        staged_layout([TILE_M, BN // 2], w13_desc.dtype))
    ready = barriers(STAGES, 1 + 32 * LOADER_WARPS)
    empty = barriers(STAGES)
    gl.warp_specialize([
        (_up_mma_partition, (h_ptr, preact_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, x_bufs,
                             g_bufs, u_bufs, staging, D, I, num_n, work, trace_ptr, SAVE_PREACT, TRACE, num_warps)),
        (_up_loader, (x_ptr, w13_desc, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, ready, empty, x_bufs,
                      g_bufs, u_bufs, D, top_k, num_n, work, trace_ptr, TRACE, LOADER_WARPS)),
    ], [LOADER_WARPS], [80])


def ws_supported(a: torch.Tensor) -> bool:
    """Whether the warp-specialized kernels take this operand: 16-bit, on an sm90 GPU."""
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and device_capability(a.device.index)[0] == 9


@functools.cache
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA block, built once per block shape and dtype: building it is most of
    a launch's host time otherwise (``get_default_for``; §25)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block, _smem_layout(tuple(block), t.dtype))


def wgrad_by_size(offsets_E1: torch.Tensor, by_size: bool | None) -> dict:
    """A weight-gradient launch's ``by_size_ptr`` and ``BY_SIZE`` arguments for the expert offsets ``offsets_E1``:
    with ``by_size`` (None: ``WGRAD_BY_SIZE``) the experts by their rows (``plan.experts_by_size``, one small launch),
    else the offsets in its place, never read."""
    if WGRAD_BY_SIZE if by_size is None else by_size:
        return {"by_size_ptr": experts_by_size(offsets_E1), "BY_SIZE": True}
    return {"by_size_ptr": offsets_E1, "BY_SIZE": False}


def taken_args(taken: bool, idle: torch.Tensor) -> dict:
    """A weight-gradient launch's ``counter_ptr`` and ``TAKEN`` arguments: with ``taken``, a fresh counter of the blocks
    taken (int32, zero; one small fill on the stream), else ``idle`` (any tensor) in its place, never read."""
    if taken:
        return {"counter_ptr": torch.zeros(1, device=idle.device, dtype=torch.int32), "TAKEN": True}
    return {"counter_ptr": idle, "TAKEN": False}


def trace_args(trace: torch.Tensor | None, idle: torch.Tensor) -> dict:
    """A launch's ``trace_ptr`` and ``TRACE`` arguments for the block trace ``trace`` (int64, at least ``trace_size``
    elements for one program per SM of ``idle``'s device) or, with None, untraced: the stamps compiled out and
    ``idle`` (any tensor) passed in its place, never written."""
    if trace is None:
        return {"trace_ptr": idle, "TRACE": False}
    assert trace.dtype == torch.int64 and trace.numel() >= trace_size(sm_count(idle.device.index)), \
        "the block trace: int64, trace_size(programs) elements"
    return {"trace_ptr": trace, "TRACE": True}


def _launch_ws(kernel, programs: int, stages: int, maxnreg: int = WS_MAXNREG, **kwargs) -> None:
    kernel[(programs,)](**kwargs, STAGES=stages, num_warps=WS_NUM_WARPS, maxnreg=maxnreg)


def expert_wgrad_ws(a_NP: torch.Tensor, b_NQ: torch.Tensor, offsets_E1: torch.Tensor, dw: torch.Tensor,
                    combine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *, gemm: str | None = None,
                    by_size: bool | None = None, taken: bool | None = None,
                    trace: torch.Tensor | None = None) -> None:
    """dw (E, P, Q) = per expert, the sum over its sorted rows r of outer(a[r], b[r]); a, b, dw 16-bit,
    contiguous, on an sm90 GPU (``ws_supported``), with at least one row. ``combine``: (slot rows (T*K, D),
    topk_idx (T, K), out (T, D)), all contiguous, to reduce into ``out`` beside the MMAs, with the sums of
    ``combine.combine``. ``gemm``: which of the layer's weight gradients this is ("dw13" or "dw2", for the default of
    ``taken``; None: neither). ``by_size``: the blocks dealt in order of their experts' rows (None: ``WGRAD_BY_SIZE``;
    ``wgrad_by_size``); ``taken``: the blocks of the size order taken in turn (None: whether ``gemm`` is in
    ``WGRAD_TAKEN``; with it ``by_size`` is ignored); ``trace``: the block trace (``trace_args``;
    ``tools.kernels_trace`` reads it)."""
    assert gemm in (None, *WGRAD_GEMMS), f"gemm: one of {WGRAD_GEMMS} or None, not {gemm!r}"
    bm, bn, bk, stages = WGRAD_TILE
    num_experts, p, q = dw.shape
    num_p, num_q = triton.cdiv(p, bm), triton.cdiv(q, bn)
    tiles = num_experts * num_p * num_q
    if combine is None:  # no tokens: the combine partition returns at once and reads none of these
        rows, topk_idx, out, num_tokens, top_k = a_NP, offsets_E1, a_NP, 0, 1
    else:
        (rows, topk_idx, out), (num_tokens, top_k) = combine, combine[1].shape
    taken = gemm in WGRAD_TAKEN if taken is None else taken
    _launch_ws(_wgrad_ws_kernel, min(tiles, sm_count(a_NP.device.index)), stages, a_desc=_desc(a_NP, [bk, bm]),
               b_desc=_desc(b_NQ, [bk, bn]), dw_desc=_desc(dw, [1, bm, bn]), offsets_ptr=offsets_E1, num_p=num_p,
               num_q=num_q, tiles=tiles, rows_ptr=rows, topk_idx_ptr=topk_idx, out_ptr=out, T=num_tokens,
               D=out.shape[1], TOP_K=top_k, **wgrad_by_size(offsets_E1, True if taken else by_size),
               **taken_args(taken, offsets_E1), **trace_args(trace, offsets_E1))


def dh_ws(dy_sorted_ND: torch.Tensor, w2_EDI: torch.Tensor, out_NI: torch.Tensor, plan, tile_m: int,
          copy_x: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None, *,
          trace: torch.Tensor | None = None) -> None:
    """``expert_bwd.dh_sorted``'s product through ``_dh_ws_kernel`` into ``out_NI`` (sorted rows); 16-bit operands
    on an sm90 GPU (``ws_supported``), at least one row; ``tile_m`` the plan's tile height. ``copy_x``: (x (T, D),
    x_sorted (N, D) out, slot_row (N,) each slot's sorted row, top_k), the rows of x to copy into sorted order
    beside the MMAs. ``trace``: the block trace (``trace_args``)."""
    bm, bn, bk, stages = WS_TILE
    assert bm == tile_m, "a block is one plan tile"
    num_experts = w2_EDI.shape[0]
    if copy_x is None:  # no tokens: the copy partition returns at once and reads none of these
        x, x_sorted, slot_row, top_k = dy_sorted_ND[:0], dy_sorted_ND, plan.offsets_E1, 1
    else:
        x, x_sorted, slot_row, top_k = copy_x
    _launch_ws(_dh_ws_kernel, sm_count(dy_sorted_ND.device.index), stages, a_desc=_desc(dy_sorted_ND, [bm, bk]),
               w_desc=_desc(w2_EDI, [1, bk, bn]), out_ptr=out_NI, offsets_ptr=plan.offsets_E1,
               tile_expert_ptr=plan.tile_expert_NT, tile_row_ptr=plan.tile_row_NT, x_ptr=x, x_sorted_ptr=x_sorted,
               slot_row_ptr=slot_row, T=x.shape[0], N_OUT=out_NI.shape[1], K=dy_sorted_ND.shape[1], E=num_experts,
               EB=triton.next_power_of_2(num_experts), TILE_M=tile_m, TOP_K=top_k, **trace_args(trace, plan.offsets_E1))


def act_bwd_ws(x_sorted: torch.Tensor, dh_NI: torch.Tensor, w13_EHD: torch.Tensor, weights_N: torch.Tensor, plan,
               dz_NH: torch.Tensor, hw_NI: torch.Tensor, dweight_part: torch.Tensor, tile_m: int,
               part_cols: int, *, trace: torch.Tensor | None = None) -> None:
    """``expert_bwd.act_bwd_into``'s act kernel through ``_act_ws_kernel``; 16-bit
    operands on an sm90 GPU (``ws_supported``), at least one row; ``tile_m`` the plan's tile height. ``trace``: the
    block trace (``trace_args``)."""
    bm, bn, bk, stages = ACT_TILE
    assert bm == tile_m and bn % part_cols == 0
    num_experts, two_i, dim = w13_EHD.shape
    inter = two_i // 2
    _launch_ws(_act_ws_kernel, sm_count(x_sorted.device.index), stages=stages, maxnreg=ACT_MAXNREG,
               x_desc=_desc(x_sorted, [bm, bk]), w13_desc=_desc(w13_EHD.view(num_experts, 2, inter, dim), [1, 1, bn, bk]),
               dh_ptr=dh_NI, weights_ptr=weights_N, dz_ptr=dz_NH, hw_ptr=hw_NI, dweight_part_ptr=dweight_part,
               row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
               tile_row_ptr=plan.tile_row_NT, N=dz_NH.shape[0], D=dim, I=inter, E=num_experts,
               EB=triton.next_power_of_2(num_experts), TILE_M=tile_m, PART_COLS=part_cols,
               EPILOGUE_WARPS=ACT_EPILOGUE_WARPS, EPILOGUE_REGS=ACT_EPILOGUE_REGS, **trace_args(trace, plan.offsets_E1))


def up_swiglu_ws(x_TD: torch.Tensor, w13_EHD: torch.Tensor, h_NI: torch.Tensor, plan, top_k: int, tile_m: int,
                 preact_NH: torch.Tensor | None = None, *, trace: torch.Tensor | None = None) -> None:
    """``expert_fwd.up_swiglu_fwd``'s one-device kernel through ``_up_ws_kernel`` into ``h_NI`` (and the gate/up
    products into ``preact_NH``, (N, 2I) in x's dtype, if given); 16-bit operands on an sm90 GPU
    (``ws_supported``), x contiguous with 16-byte aligned rows, at least one row; ``tile_m`` the plan's tile
    height. ``trace``: the block trace (``trace_args``)."""
    bm, bn, bk, stages = UP_TILE
    assert bm == tile_m, "a block is one plan tile"
    num_experts, two_i, dim = w13_EHD.shape
    inter = two_i // 2
    _launch_ws(_up_ws_kernel, sm_count(x_TD.device.index), stages=stages, x_ptr=x_TD,
               w13_desc=_desc(w13_EHD.view(num_experts, 2, inter, dim), [1, 1, bn, bk]), h_ptr=h_NI,
               preact_ptr=h_NI if preact_NH is None else preact_NH, row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
               tile_row_ptr=plan.tile_row_NT, D=dim, I=inter, E=num_experts, top_k=top_k,
               EB=triton.next_power_of_2(num_experts), TILE_M=tile_m, BK=bk, LOADER_WARPS=UP_LOADER_WARPS,
               SAVE_PREACT=preact_NH is not None, **trace_args(trace, plan.offsets_E1))


# The Gluon kernels by name, for the ahead-of-time compile check (``tools.resources``).
KERNELS = {"wgrad": _wgrad_ws_kernel, "dh": _dh_ws_kernel, "act": _act_ws_kernel, "up": _up_ws_kernel}
