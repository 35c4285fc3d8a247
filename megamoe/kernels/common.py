"""Device helpers and launch helpers that several kernel files share (the one-device expert kernels and the
expert-parallel owner's kernels): how a program finds its tile's rows, the K-loops over sorted or gathered
rows, the busy-tile count of persistent kernels, TMA descriptors, grids and dot precision.

Shape legend: N = T*K slots, NT tiles (see plan.py), E experts of the plan, D / K the reduced dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.env import sm_count, warn_once
from megamoe.kernels.plan import BLOCK_M, Plan


def descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over all of ``t`` (contiguous, rows 16-byte multiples: see ``api.fused_supports``);
    its block shape is set per config at launch (``TunedKernel.blocks``). TMA also needs the start
    16-byte aligned: a tensor that is not (a weight view at an odd offset into a larger buffer) is
    copied, with a one-time warning, since that copy is paid on every call."""
    if t.data_ptr() % 16:
        warn_once(f"megamoe: a {tuple(t.shape)} operand does not start 16-byte aligned; copying it on every "
                  "call (slow). Allocate the expert weights aligned (any fresh tensor is).")
        t = t.clone()
    return TensorDescriptor.from_tensor(t, [1] * t.dim())


def tile_grid(plan: Plan, n_dim: int):
    """1-D grid over every (sub-tile of every plan tile) × N-block, as a function of the config."""
    return lambda cfg: (plan.tile_expert_NT.numel() * (BLOCK_M // cfg["BM"]) * triton.cdiv(n_dim, cfg["BN"]),)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (tests) use exact fp32 products; tf32 would miss the reference by ~1e-3.
    return "ieee" if dtype == torch.float32 else "tf32"


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM (4 in the interpreter, so that each strides)."""
    if device.type != "cuda":
        return 4
    return sm_count(device.index)


@triton.jit
def tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, BM: tl.constexpr, TILE_M: tl.constexpr):
    """Expert, first sorted row, sorted rows, row mask and N-block of program ``pid`` of a 1-D tile grid,
    which covers BM rows (a sub-tile when BM < TILE_M) of a plan tile. The grid runs the N-blocks of one
    (sub-)tile next to each other, so its gathered rows are read from DRAM once and then hit in L2 (a
    tile-major order re-reads them from DRAM once per N-block)."""
    split: tl.constexpr = TILE_M // BM
    pid_m = pid // num_n
    pid_t = pid_m // split
    e = tl.load(tile_expert_ptr + pid_t)
    row0 = tl.load(tile_row_ptr + pid_t) + (pid_m % split) * BM
    row_end = tl.load(offsets_ptr + e + 1)
    rows = row0 + tl.arange(0, BM)
    return e, row0, rows, rows < row_end, pid % num_n


@triton.jit
def rows_k_block(a_ptrs, rmask, ks, k0, D, EVEN_K: tl.constexpr):
    """The (BM, BK) block at column k0 of rows read through pointers (``a_ptrs``: their column-k0 entries),
    zero past the rows (``rmask``) and, unless EVEN_K, past D."""
    if EVEN_K:
        return tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
    return tl.load(a_ptrs, mask=rmask[:, None] & (ks + k0 < D)[None, :], other=0.0)


@triton.jit
def sorted_rows_matmul(a_desc, w_desc, e, row0, n0, K, W_K_LAST: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                       a_scale_ptr=None, w_scale_ptr=None, M=0, N_W=0, SCALED: tl.constexpr = False):
    """fp32 (BM, BN) = A[row0 : row0+BM, :K] @ W[e][:K, n0 : n0+BN], both through TMA. A holds sorted rows
    (block (BM, BK)); rows past the expert's end belong to the next expert, and the caller masks them at
    the store. W is (E, N, K) when ``W_K_LAST`` (block (1, BN, BK)), else (E, K, N) (block (1, BK, BN)).
    The descriptors zero-fill past K and past the expert's N, so the loop needs no masks.

    SCALED: blockwise FP8 operands (``kernels.quant``'s formats; BK = 128, W_K_LAST): A's (K/128, M) row scales
    at ``a_scale_ptr``, W's (E, N_W/128, K/128) block scales at ``w_scale_ptr``; each K-block's product is
    promoted into the fp32 accumulator times its two scales."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if SCALED:
        rows = row0 + tl.arange(0, BM)
        w_blocks = (e * (N_W // 128) + (n0 + tl.arange(0, BN)) // 128) * (K // 128)
        col_ok = n0 + tl.arange(0, BN) < N_W
    for k0 in range(0, K, BK):
        a = a_desc.load([row0, k0])
        if W_K_LAST:
            b = w_desc.load([e, n0, k0]).reshape(BN, BK).T
        else:
            b = w_desc.load([e, k0, n0]).reshape(BK, BN)
        if SCALED:
            sa = tl.load(a_scale_ptr + (k0 // 128) * M + rows, mask=rows < M, other=0.0)
            sw = tl.load(w_scale_ptr + w_blocks + k0 // 128, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sw[None, :])
        else:
            acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def busy_tiles(offsets_ptr, E, EB: tl.constexpr, TILE_M: tl.constexpr):
    """How many plan tiles hold rows (they come first in the tile table): the sum over experts of
    ceil(rows / TILE_M). EB: a power of two >= E."""
    experts = tl.arange(0, EB)
    lo = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
    hi = tl.load(offsets_ptr + experts + 1, mask=experts < E, other=0)
    return tl.sum((hi - lo + TILE_M - 1) // TILE_M, axis=0)
