"""Weight gradients as one persistent, warp-specialized Gluon kernel (Hopper, 16-bit operands).

dW[e] = sum over expert e's sorted rows r of outer(a[r], b[r]): the same product as
``expert_bwd._expert_wgrad_kernel``, scheduled differently. The Triton kernel runs one output block per
program: each block's pipeline fill, its last partial K-step (masked pointer loads, not pipelined) and
its store sit exposed between main loops, about a fifth of the time at 16k tokens (docs/NOTES.md §24).
Here one program per SM walks the blocks (expert-major, as the Triton grid) with two partitions:

- a loader warp streams both operands of every K-step of every block through TMA into a ring of
  ``STAGES`` buffers, running ahead into the next block while the current one finishes;
- the default partition (8 warps, two warpgroups) issues the warpgroup MMAs, keeps one in flight, and
  frees each buffer when its MMA is done. An expert's last, partial K-step is loaded whole by TMA
  (rows past the expert belong to the next expert, or were never written); the MMA partition zeroes
  those rows of both operands in shared memory before its MMA. The block's bf16 result leaves through
  an asynchronous TMA store that overlaps the next block's main loop.

Gluon kernels do not run in Triton's interpreter; the CPU tests run the Triton kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.kernels.expert_fwd import persistent_programs


@gluon.jit
def _wgrad_block(tile, offsets_ptr, num_p, num_q, BM: gl.constexpr, BN: gl.constexpr):
    """Block ``tile`` of the expert-major order: its expert, first P and Q, and the expert's sorted rows
    [start, end)."""
    e = tile // (num_p * num_q)
    pq = tile % (num_p * num_q)
    return e, (pq // num_q) * BM, (pq % num_q) * BN, gl.load(offsets_ptr + e), gl.load(offsets_ptr + e + 1)


@gluon.jit
def _loader(a_desc, b_desc, offsets_ptr, ready, empty, a_bufs, b_bufs, num_p, num_q, tiles):
    """Producer partition (one warp): every K-step's operand blocks, in the MMA partition's order."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[0]
    BM: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        _, p0, q0, start, end = _wgrad_block(tile, offsets_ptr, num_p, num_q, BM, BN)
        for r0 in range(start, end, BK):
            s = step % STAGES
            mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [r0, p0], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [r0, q0], ready.index(s), b_bufs.index(s))
            step += 1


@gluon.constexpr_function
def _row_block_layout(cols, num_warps):
    """8 contiguous elements per thread, a warp across min(cols, 256) columns, warps down the rows."""
    lanes = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [num_warps, 1], [1, 0])


@gluon.jit
def _zero_rows_past(buf, r0, end, num_warps: gl.constexpr):
    """Zero the rows of a (BK, X) operand block in shared memory whose sorted row r0 + i is >= end."""
    BK: gl.constexpr = buf.type.shape[0]
    X: gl.constexpr = buf.type.shape[1]
    layout: gl.constexpr = _row_block_layout(X, num_warps)
    rows = r0 + gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
    block = buf.load(layout)
    buf.store(gl.where((rows < end)[:, None], block, gl.zeros([BK, X], block.dtype, layout)))


@gluon.jit
def _mma_partition(dw_desc, offsets_ptr, ready, empty, a_bufs, b_bufs, c_smem, num_p, num_q, tiles,
                   num_warps: gl.constexpr):
    """Default partition: the MMAs of each block, its tail rows zeroed, and its TMA store."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[1]
    BM: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        e, p0, q0, start, end = _wgrad_block(tile, offsets_ptr, num_p, num_q, BM, BN)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for r0 in range(start, end, BK):
            s = step % STAGES
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
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
        tma.store_wait(0)  # the previous block's store has left c_smem
        c_smem.reshape([BM, BN]).store(acc.to(dw_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dw_desc, [e, p0, q0], c_smem)
    tma.store_wait(0)


@gluon.jit
def _wgrad_ws_kernel(a_desc, b_desc, dw_desc, offsets_ptr, num_p, num_q, tiles, STAGES: gl.constexpr,
                     num_warps: gl.constexpr):
    """a_desc: (N, P) sorted rows, block (BK, BM); b_desc: (N, Q), block (BK, BN); dw_desc: (E, P, Q),
    block (1, BM, BN). Tiles: E * num_p * num_q output blocks, expert-major."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dw_desc.dtype, dw_desc.block_type.shape, dw_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma_partition, (dw_desc, offsets_ptr, ready, empty, a_bufs, b_bufs, c_smem, num_p, num_q, tiles,
                          num_warps)),
        (_loader, (a_desc, b_desc, offsets_ptr, ready, empty, a_bufs, b_bufs, num_p, num_q, tiles)),
    ], [1], [40])


# (BM, BN, BK, STAGES): 128x256 blocks as the Triton kernel's pick at 16k tokens; 3 stages of 48 KB and a
# 64 KB output block fit the 227 KB of shared memory.
WS_TILE = (128, 256, 64, 3)
WS_NUM_WARPS = 8
WS_MAXNREG = 168  # 12 warps (8 + the loader's warpgroup) x 32 x 168 <= 64 K registers
# The same as a config dict, for the benchmarks' records.
WS_CONFIG = {"BM": WS_TILE[0], "BN": WS_TILE[1], "BK": WS_TILE[2], "num_warps": WS_NUM_WARPS,
             "num_stages": WS_TILE[3], "WARP_SPECIALIZED": True}


def ws_supported(a_NP: torch.Tensor) -> bool:
    """Whether the warp-specialized kernel takes these operands: 16-bit, on an sm90 GPU."""
    return (a_NP.is_cuda and a_NP.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(a_NP.device)[0] == 9)


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor.from_tensor(t, block, layout)


def expert_wgrad_ws(a_NP: torch.Tensor, b_NQ: torch.Tensor, offsets_E1: torch.Tensor, dw: torch.Tensor) -> None:
    """dw (E, P, Q) = per expert, the sum over its sorted rows r of outer(a[r], b[r]); a, b, dw 16-bit,
    contiguous, on an sm90 GPU (``ws_supported``), with at least one row."""
    bm, bn, bk, stages = WS_TILE
    num_experts, p, q = dw.shape
    num_p, num_q = triton.cdiv(p, bm), triton.cdiv(q, bn)
    tiles = num_experts * num_p * num_q
    _wgrad_ws_kernel[(min(tiles, persistent_programs(a_NP.device)),)](
        _desc(a_NP, [bk, bm]), _desc(b_NQ, [bk, bn]), _desc(dw, [1, bm, bn]), offsets_E1, num_p, num_q, tiles,
        STAGES=stages, num_warps=WS_NUM_WARPS, maxnreg=WS_MAXNREG,
    )
