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
promotion can hide under the other warpgroup's MMA. Nothing holds them out of phase, though: a stage that
arrives late releases both at once. Holding them a chain apart (the second warpgroup issuing each K-step's
first chain once the first's had finished) was measured and did not help: the main loops took as long
(docs/PERFORMANCE.md, "The warpgroups in turn").

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
  stage, promote. In the sorted-rows kernel's 128-column blocks the next K-step's chain is issued before the
  promotion, into a second temporary (issue-ahead); a block of 256 columns (``ROWS_BLOCK_N``, the default where N
  allows) runs as two column halves of 128, each with its accumulator, without issue-ahead; the up kernel's gate
  and up chains have no registers for a second temporary either. A warpgroup whose 64 rows all lie past its
  expert's end (the last tile of an expert) skips its MMAs and epilogue.

The weight-gradient kernel has the sorted-rows kernel's partitions, with both operands K-major along the tokens
(``quant.quantize_tile_cols``): a K-step is one plan tile of the block's expert, and its promotion multiplies by the
outer product of A's scales of the block's rows and B's of its columns (both copied into the stage). At 128
columns its warpgroups issue each K-step's chain before the previous one's promotion; at 256 (``WGRAD_BLOCK_N``, the
default where Q allows) they run two column halves without; they store their blocks through shared memory by TMA.

See ``fp8_rows_gemm_ws``, ``fp8_up_swiglu_ws``, ``fp8_wgrad_ws``, ``fp8_act_tile_cols_ws`` (the FP8 weight
gradients' act step) and ``fp8_tile_cols_ws`` (their tile-column quantiser of bf16 rows, ``quant.quantize_tile_cols``
on sm90) for the five launchers; the kernels are in ``gluon_fp8_sm90_details`` (``rows``, ``up``, ``wgrad``, ``act``,
``tile_cols``, and their shared device helpers in ``common``).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.env import device_capability, fp8_pow2_scales, sm_count
from megamoe.kernels.gluon_fp8_sm90_details.act import act_tile_cols_kernel
from megamoe.kernels.gluon_fp8_sm90_details.rows import rows_ws_kernel
from megamoe.kernels.gluon_fp8_sm90_details.tile_cols import (
    TILE_COLS_WARPS,
    tile_cols_kernel,
)
from megamoe.kernels.gluon_fp8_sm90_details.up import up_ws_kernel
from megamoe.kernels.gluon_fp8_sm90_details.wgrad import wgrad_ws_kernel
from megamoe.kernels.gluon_sm90 import WGRAD_BY_SIZE, trace_args, wgrad_by_size
from megamoe.kernels.plan import BLOCK_M

# Tile: one plan tile of 128 rows (two warpgroups of 64) x 128 output columns, K-steps of one 128-wide scale
# block: a warpgroup holds its fp32 accumulator and the MMA's temporary, 2 x 64 registers per thread at 128 columns
# (the up kernel three, for gate and up). The sorted-rows and weight-gradient kernels' 256-column blocks (below) are
# two such halves, their two accumulators beside one temporary.
FP8_BM, FP8_BN, FP8_BK = BLOCK_M, 128, 128
SCALE_BLOCK = 128  # elements per scale, along K and along N of the weights and per h group
MATH_WARPS = 4  # per MMA partition: one warpgroup
# Ring stages (ptxas / Triton's figures, of the 227 KB): sorted-rows kernel, 16 KB of A + 16 KB of B +
# 0.75 KB of scales per stage and the epilogue's conversion scratch: 6 stages, 213 KB. Up kernel, 16 KB of x
# + 2 x 16 KB of weights + 1 KB of scales per stage and each MMA warpgroup's 8 KB staging buffer, through which
# its epilogue stores h and the bf16 pre-activations (``gluon_sm90.store_staged``): 4 stages, 212 KB.
ROWS_STAGES = 6
UP_STAGES = 4
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
# The sorted-rows kernel's 128-column blocks issue each K-step's chain before the previous one's promotion, and
# defer a block's stores until their warpgroup's next block has issued its first chain: measured on the H200
# (``python -m tools.fp8``, docs/PERFORMANCE.md), issue-ahead made the sorted-rows GEMMs 3-5% faster (and the up
# kernel, in 64-column chains, 2-5% slower), the deferred stores dx 3% and dh' 1% faster, down level. The other
# patterns were removed once measured (docs/PERFORMANCE.md names the commits).
# The sorted-rows kernel's block width where N is a multiple of it (else 128): 256 runs a block as two column
# halves of 128 (``rows._rows_main_wide``: a temporary beside the two accumulators, so no issue-ahead; its stores
# deferred under its own chains) in ROWS_WIDE_STAGES ring stages of 48 KB (A 16 KB, the weight block 32 KB): each
# byte that crosses from L2 feeds 171 FLOPs, against 128 at 128 columns. Measured on the H200 (``python -m
# tools.fp8_trace --wide``, docs/PERFORMANCE.md): 2-5% faster than 128 columns at 30B, stores deferred.
ROWS_BLOCK_N = 256
ROWS_WIDE_STAGES = 4
SHARED_MEMORY_LIMIT = 232448  # bytes of shared memory per block on the H200 (sm_90)
# The FP8 weight-gradient kernel's ring: 33 KB per stage (A, B and their scales) beside each MMA warpgroup's 16 KB store
# buffer: 5 x 33 + 32 = 197 KB. Its block width where Q is a multiple of it (else 128): 256 runs a block as two column
# halves of 128 (``_wgrad_main_wide``, no issue-ahead) in WGRAD_WIDE_STAGES stages of 49.5 KB (B's block 32 KB, B's
# scales 1 KB): 3 x 49.5 + 32 = 181 KB. A block's K-steps are its expert's plan tiles, ~8 at 16 384 tokens and top-8
# of 128 experts: its fixed cost (the start, the last promotion, the stores) is paid once per twice the MMAs. Measured
# and removed (docs/PERFORMANCE.md): a fourth stage at 256 columns (2-10% slower), the blocks' expert rows read a
# block ahead and their right halves stored under the next block (within the runs' movement at 256 columns).
WGRAD_STAGES = 5
WGRAD_BLOCK_N = 256
WGRAD_WIDE_STAGES = 3
# The FP8 weight gradients' act step (``act.act_tile_cols_kernel``): rows per block of its first pass, and warps.
ACT_BM = 16
ACT_WARPS = 8
ACT_MAXNREG = 128  # two programs an SM (2 x 256 threads x 128 registers: the register file)


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
                     row_dest: torch.Tensor | None = None, block_n: int | None = None,
                     trace: torch.Tensor | None = None) -> None:
    """out (M, N) bf16 = the blockwise-dequantised a (M, K) in sorted rows times each row's expert weight
    w[e] (E, N, K)ᵀ, through ``rows_ws_kernel``; row r into row ``plan.row_slot_N[r]`` if ``to_slots``, else
    r; times ``weights[row_slot[r]]`` (fp32, (M,) by slot) if given. Only the plan's routed rows are written.
    ``row_dest`` (int64, (M,), with ``to_slots``): row r written instead at ``out``'s first element plus
    ``row_dest[r]`` 16-byte units, anywhere in the device's address space (``out`` of any shape then: the base of
    the offsets).
    ``block_n``: the block's columns, 128 or 256 (N a multiple of it; None: ``ROWS_BLOCK_N`` where N is a multiple
    of it, else 128). At 128 columns each warpgroup issues the next K-block's MMA before promoting the last, and a
    block's stores run under the warpgroup's next block's first MMA. 256 columns run without issue-ahead, their stores
    under the block's own chains (``rows._rows_main_wide``).
    ``trace``: the block trace (``gluon_sm90.trace_args``, ``TRACE_BLOCKS``; untraced launches compile without its
    stamps).

    a_q (M, K) float8_e4m3fn contiguous, a_s (K // 128, M) fp32 contiguous, w_q (E, N, K) float8_e4m3fn
    contiguous, w_s (E, N // 128, K // 128) fp32 contiguous; K and N multiples of 128; M >= 1; an sm90 GPU;
    ``plan`` built with BLOCK_M = 128 rows per tile."""
    num_rows, k_dim = a_q.shape
    num_experts, n_out, _ = w_q.shape
    assert k_dim % FP8_BK == 0 and n_out % FP8_BN == 0 and w_q.shape[2] == k_dim
    assert a_s.shape == (k_dim // SCALE_BLOCK, num_rows) and w_s.shape == (num_experts, n_out // SCALE_BLOCK,
                                                                           k_dim // SCALE_BLOCK)
    assert out.dtype == torch.bfloat16 and BLOCK_M == FP8_BM and out.data_ptr() % 16 == 0
    assert out.shape == (num_rows, n_out) if row_dest is None else (row_dest.dtype == torch.int64 and to_slots
                                                                     and row_dest.numel() >= num_rows)
    block_n = rows_block_n(n_out, block_n)
    rows_ws_kernel[(sm_count(a_q.device.index),)](
        a_desc=_fp8_desc(a_q, [FP8_BM, FP8_BK]), w_desc=_fp8_desc(w_q, [1, block_n, FP8_BK]), a_s_ptr=a_s,
        w_s_ptr=w_s, out_ptr=out, weights_ptr=weights if weights is not None else a_s, row_slot_ptr=plan.row_slot_N,
        row_dest_ptr=row_dest if row_dest is not None else plan.row_slot_N, offsets_ptr=plan.offsets_E1,
        tile_expert_ptr=plan.tile_expert_NT, tile_row_ptr=plan.tile_row_NT, M=num_rows, N_OUT=n_out, K=k_dim,
        E=num_experts, EB=triton.next_power_of_2(num_experts), TILE_M=BLOCK_M, WEIGHTED=weights is not None,
        TO_SLOTS=to_slots, **trace_args(trace, out),
        STAGES=ROWS_STAGES if block_n == FP8_BN else ROWS_WIDE_STAGES, LOADER_WARPS=ROWS_LOADER_WARPS,
        MMA_REGS=MATH_REGS, LOADER_REGS=ROWS_LOADER_REGS, num_warps=MATH_WARPS, maxnreg=FP8_MAXNREG)


def block_width(kernel: str, n: int, block_n: int | None, default: int) -> int:
    """The output block width of an FP8 GEMM (``kernel``, for the error) with ``n`` output columns: ``block_n`` (128 or
    256, a divisor of ``n``) if given, else ``default`` where it divides ``n``, else 128; raises ValueError for a width
    that is not 128 or 256 or does not divide ``n``."""
    if block_n is None:
        return default if n % default == 0 else FP8_BN
    if block_n not in (FP8_BN, 2 * FP8_BN) or n % block_n:
        raise ValueError(f"block_n={block_n}: the FP8 {kernel} kernel's blocks are 128 or 256 columns, and its output "
                         f"columns ({n}) must be a multiple of them")
    return block_n


def rows_block_n(n_out: int, block_n: int | None = None) -> int:
    """The sorted-rows kernel's block width for N = ``n_out`` (``block_width``, default ``ROWS_BLOCK_N``)."""
    return block_width("sorted-rows", n_out, block_n, ROWS_BLOCK_N)


def fp8_up_swiglu_ws(x_q: torch.Tensor, x_s: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor,
                     h_q: torch.Tensor | None, h_s: torch.Tensor | None, plan, top_k: int,
                     preact: torch.Tensor | None = None, *, trace: torch.Tensor | None = None) -> None:
    """h = silu(x W1gᵀ) * (x W1uᵀ) for the plan's sorted rows (row r: token ``row_slot[r] // top_k``), blockwise
    dequantised operands, through ``up_ws_kernel``; quantised per row and 128 columns into h_q (N, I)
    float8_e4m3fn and h_s (I // 128, N) fp32; with ``preact`` (N, 2I) bf16 also g and u (h_q and h_s None:
    only those). Only the routed rows are written. ``trace``: as for ``fp8_rows_gemm_ws`` (the same points: the
    epilogue, SwiGLU and h's quantisation with its stores, lies between points 2 and 3).

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
    up_ws_kernel[(sm_count(x_q.device.index),)](
        x_ptr=x_q, x_s_ptr=x_s, w13_desc=_fp8_desc(w13_q.view(num_experts, 2, inter, dim), [1, 1, FP8_BN, FP8_BK]),
        w13_s_ptr=w13_s, h_q_ptr=h_q if h_out else x_q, h_s_ptr=h_s if h_out else x_s,
        preact_ptr=preact if preact is not None else h_s,
        row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, T=num_tokens, N=num_rows, D=dim, I=inter, E=num_experts, top_k=top_k,
        EB=triton.next_power_of_2(num_experts), TILE_M=BLOCK_M, PREACT=preact is not None, H_OUT=h_out,
        POW2=fp8_pow2_scales(), **trace_args(trace, x_s),
        STAGES=UP_STAGES, LOADER_WARPS=UP_LOADER_WARPS, MMA_REGS=UP_MATH_REGS, LOADER_REGS=UP_LOADER_REGS,
        num_warps=MATH_WARPS, maxnreg=FP8_MAXNREG)


def wgrad_block_n(q: int, block_n: int | None = None) -> int:
    """The FP8 weight-gradient kernel's block width for Q columns (``block_width``, default ``WGRAD_BLOCK_N``)."""
    return block_width("weight-gradient", q, block_n, WGRAD_BLOCK_N)


def fp8_wgrad_ws(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, out: torch.Tensor,
                 offsets: torch.Tensor, block_n: int | None = None, *, by_size: bool | None = None,
                 trace: torch.Tensor | None = None, b_const: bool = False) -> None:
    """out (E, P, Q) bf16: per expert e the sum over its sorted rows of the blockwise-dequantised outer products
    a[r]ᵀ b[r], through ``wgrad_ws_kernel``; an expert without rows gets zeros.

    a_q (P, NT * 128) and b_q (Q, NT * 128) float8_e4m3fn, a_s (NT, P) and b_s (NT, Q) fp32: the sorted rows in tile
    columns (``quant.quantize_tile_cols`` with the plan whose expert offsets are ``offsets`` (E + 1,) int32); P and Q
    multiples of 128; q's and s's rows contiguous; out contiguous; an sm90 GPU. ``block_n``: the output block's
    width (``wgrad_block_n``); ``by_size``: the blocks dealt in order of their experts' rows (None:
    ``gluon_sm90.WGRAD_BY_SIZE``); ``trace``: the block trace, as for ``fp8_rows_gemm_ws``; ``b_const``: b's scales
    the same in every tile of an expert (quantised with a ``col_amax``), promoted with a's alone
    (``wgrad_ws_kernel``'s B_CONST)."""
    num_experts, p, q = out.shape
    num_tiles = a_s.shape[0]
    assert p % FP8_BM == 0 and q % FP8_BN == 0 and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert a_q.shape == (p, num_tiles * FP8_BK) and b_q.shape == (q, num_tiles * FP8_BK)
    assert a_s.shape == (num_tiles, p) and b_s.shape == (num_tiles, q) and offsets.numel() == num_experts + 1
    block_n = wgrad_block_n(q, block_n)
    tiles = num_experts * (p // FP8_BM) * (q // block_n)
    block = [1, FP8_BM // 2, FP8_BN]  # one MMA warpgroup's rows, the columns of one store
    wgrad_ws_kernel[(min(tiles, sm_count(a_q.device.index)),)](
        a_desc=_fp8_desc(a_q, [FP8_BM, FP8_BK]), b_desc=_fp8_desc(b_q, [block_n, FP8_BK]), a_s_ptr=a_s, b_s_ptr=b_s,
        out_desc=TensorDescriptor.from_tensor(out, block, _bf16_layout(tuple(block))), offsets_ptr=offsets, P=p,
        Q=q, tiles=tiles, EB=triton.next_power_of_2(num_experts),
        STAGES=WGRAD_STAGES if block_n == FP8_BN else WGRAD_WIDE_STAGES, **wgrad_by_size(offsets, by_size),
        B_CONST=b_const,
        **trace_args(trace, a_s), LOADER_WARPS=ROWS_LOADER_WARPS,
        MMA_REGS=MATH_REGS, LOADER_REGS=ROWS_LOADER_REGS, num_warps=MATH_WARPS, maxnreg=FP8_MAXNREG)


def fp8_act_tile_cols_ws(preact: torch.Tensor, dh: torch.Tensor, weights: torch.Tensor, plan,
                         dweight_part: torch.Tensor, dzq: torch.Tensor, dzs: torch.Tensor,
                         dz_t: tuple[torch.Tensor, torch.Tensor], hw_t: tuple[torch.Tensor, torch.Tensor],
                         part_cols: int) -> None:
    """The SwiGLU backward of the plan's sorted rows from their gate and up products, through
    ``act_tile_cols_kernel``: the d(routing weight) partials (sums of dh'·h over each ``part_cols`` columns) into
    dweight_part (I / part_cols, N) fp32 by slot, dz = [dg | du] (routing weight applied) quantised 1x128 into dzq
    (N, 2I) e4m3 and dzs (2I / 128, N) fp32, and dz and h·w, rounded to bf16, quantised 128x1 into the tile columns
    dz_t ((2I, NT * 128) e4m3, (NT, 2I) fp32) and hw_t ((I, NT * 128), (NT, I)). Only the routed rows and busy tiles
    are written.

    preact (N, 2I) and dh (N, I) bf16, weights (N,) fp32 by slot, all contiguous; I a multiple of 128 and of
    ``part_cols``; N >= 1; an sm90 GPU; ``plan`` built with BLOCK_M = 128 rows per tile."""
    num_rows, two_i = preact.shape
    inter = two_i // 2
    num_tiles = plan.tile_expert_NT.numel()
    assert preact.dtype == dh.dtype == torch.bfloat16 and dh.shape == (num_rows, inter) and num_rows >= 1
    assert inter % SCALE_BLOCK == 0 and SCALE_BLOCK % part_cols == 0 and BLOCK_M == 128
    assert dweight_part.shape == (inter // part_cols, num_rows) and dzq.shape == (num_rows, two_i)
    assert dz_t[0].shape == (two_i, num_tiles * BLOCK_M) and hw_t[1].shape == (num_tiles, inter)
    act_tile_cols_kernel[(num_tiles, inter // SCALE_BLOCK)](
        preact_ptr=preact, dh_ptr=dh, weights_ptr=weights, dweight_part_ptr=dweight_part,
        row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, dzq_ptr=dzq, dzs_ptr=dzs, dzt_ptr=dz_t[0], dzts_ptr=dz_t[1], hwt_ptr=hw_t[0],
        hwts_ptr=hw_t[1], N=num_rows, I=inter, E=plan.offsets_E1.numel() - 1, TILE_M=BLOCK_M, BM=ACT_BM,
        PART_COLS=part_cols, POW2=fp8_pow2_scales(), num_warps=ACT_WARPS, maxnreg=ACT_MAXNREG)


def fp8_tile_cols_ws(a: torch.Tensor, plan, top_k: int | None, q: torch.Tensor, s: torch.Tensor) -> None:
    """``a``'s sorted rows quantised 128x1 into the tile columns q (C, NT * 128) e4m3 and s (NT, C) fp32 through
    ``tile_cols_kernel``, bit for bit ``quant.quantize_tile_cols``'s Triton kernel. ``a`` (N, C) sorted rows, or
    with ``top_k`` (T, C) the tokens' rows, each sorted row read from its token; contiguous, 16-bit, C a multiple of
    128; an sm90 GPU; ``plan`` built with BLOCK_M = 128 rows per tile."""
    num_tiles = plan.tile_expert_NT.numel()
    cols = a.shape[1]
    assert a.dtype in (torch.bfloat16, torch.float16) and a.is_contiguous() and cols % SCALE_BLOCK == 0
    assert q.shape == (cols, num_tiles * BLOCK_M) and s.shape == (num_tiles, cols) and BLOCK_M == 128
    tile_cols_kernel[(num_tiles, cols // SCALE_BLOCK)](
        a_ptr=a, q_ptr=q, s_ptr=s, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, row_slot_ptr=plan.row_slot_N, C=cols, E=plan.offsets_E1.numel() - 1,
        TOP_K=top_k or 0, POW2=fp8_pow2_scales(), num_warps=TILE_COLS_WARPS)


# The kernels by name, for the ahead-of-time compile check.
KERNELS = {"fp8_rows": rows_ws_kernel, "fp8_up": up_ws_kernel, "fp8_wgrad": wgrad_ws_kernel,
           "fp8_act": act_tile_cols_kernel, "fp8_tile_cols": tile_cols_kernel}


def aot_compile(name: str, *, weighted: bool = True, to_slots: bool = True, row_dest: bool = False,
                preact: bool = False, h_out: bool = True, sizes_divisible: bool = True,
                pow2: bool = False, block_n: int = FP8_BN, by_size: bool | None = None, trace: bool = False,
                b_const: bool = False):
    """The kernel ``name`` of ``KERNELS`` compiled ahead of time for sm_90a (no GPU needed), as its launcher configures
    it, 128 experts: the compiled kernel (``.asm["ptx"]``, ``.metadata.shared``), for
    ``tools.resources.ptxas_report``. Pointers, and with ``sizes_divisible`` the sizes that the launchers' asserts
    make multiples of 128, are specialised as 16-divisible, as Triton does at run time. ``weighted`` / ``to_slots``
    / ``row_dest``: the sorted-rows kernel's variant (down projection: the first two; an expert-parallel owner's:
    ``row_dest`` too); ``preact``: the up kernel's saved-activation variant, ``h_out=False`` (with ``preact``) its
    products-only one; ``pow2``: the up kernel's (and the act step's, ``fp8_act``, and the tile-column quantiser's,
    ``fp8_tile_cols``, reading the tokens' rows at top-8) power-of-two scales;
    ``block_n``: the sorted-rows kernel's and the weight-gradient kernel's, ``by_size`` the latter's blocks' order
    (None: ``gluon_sm90.WGRAD_BY_SIZE``), ``b_const`` its B scales the same in an expert's tiles (``fp8_wgrad_ws``'s);
    ``trace``: the block-traced variant (``gluon_sm90.TRACE_BLOCKS``) of the sorted-rows, up or weight-gradient
    kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block, dtype="fp8e4nv"):
        layout = (_fp8_layout if dtype == "fp8e4nv" else _bf16_layout)(tuple(block))
        return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout}>"

    common = {"EB": 128, "TILE_M": BLOCK_M, "num_warps": MATH_WARPS}
    if name == "fp8_rows":
        blocks = {"a_desc": [FP8_BM, FP8_BK], "w_desc": [1, block_n, FP8_BK]}
        constexprs = {**common, "WEIGHTED": weighted, "TO_SLOTS": to_slots, "TRACE": trace,
                      "STAGES": ROWS_STAGES if block_n == FP8_BN else ROWS_WIDE_STAGES,
                      "LOADER_WARPS": ROWS_LOADER_WARPS, "MMA_REGS": MATH_REGS, "LOADER_REGS": ROWS_LOADER_REGS}
        pointers = {"a_s_ptr": "*fp32", "w_s_ptr": "*fp32", "out_ptr": "*bf16", "weights_ptr": "*fp32",
                    "row_dest_ptr": "*i64" if row_dest else "*i32", "trace_ptr": "*i64"}
        sizes = {"N_OUT", "K"}
    elif name == "fp8_act":
        blocks = {}
        constexprs = {"TILE_M": BLOCK_M, "BM": ACT_BM, "PART_COLS": 64,  # expert_bwd.PART_COLS
                      "POW2": pow2, "num_warps": ACT_WARPS}
        pointers = {"preact_ptr": "*bf16", "dh_ptr": "*bf16", "weights_ptr": "*fp32", "dweight_part_ptr": "*fp32",
                    "dzq_ptr": "*fp8e4nv", "dzs_ptr": "*fp32", "dzt_ptr": "*fp8e4nv", "dzts_ptr": "*fp32",
                    "hwt_ptr": "*fp8e4nv", "hwts_ptr": "*fp32"}
        sizes = {"I"}
    elif name == "fp8_tile_cols":
        blocks = {}
        constexprs = {"TOP_K": 8, "POW2": pow2, "num_warps": TILE_COLS_WARPS}
        pointers = {"a_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        sizes = {"C"}
    elif name == "fp8_wgrad":
        blocks = {"a_desc": [FP8_BM, FP8_BK], "b_desc": [block_n, FP8_BK]}
        constexprs = {"EB": 128, "num_warps": MATH_WARPS, "LOADER_WARPS": ROWS_LOADER_WARPS,
                      "STAGES": WGRAD_STAGES if block_n == FP8_BN else WGRAD_WIDE_STAGES, "TRACE": trace,
                      "BY_SIZE": WGRAD_BY_SIZE if by_size is None else by_size, "MMA_REGS": MATH_REGS,
                      "LOADER_REGS": ROWS_LOADER_REGS, "B_CONST": b_const}
        blocks["out_desc"] = ([1, FP8_BM // 2, FP8_BN], "bf16")
        pointers = {"a_s_ptr": "*fp32", "b_s_ptr": "*fp32", "trace_ptr": "*i64"}
        sizes = {"P", "Q"}
    else:
        blocks = {"w13_desc": [1, 1, FP8_BN, FP8_BK]}
        constexprs = {**common, "PREACT": preact, "H_OUT": h_out, "POW2": pow2, "TRACE": trace,
                      "STAGES": UP_STAGES, "LOADER_WARPS": UP_LOADER_WARPS,
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
    options = ({"num_warps": ACT_WARPS, "maxnreg": ACT_MAXNREG} if name == "fp8_act"
               else {"num_warps": TILE_COLS_WARPS} if name == "fp8_tile_cols"
               else {"num_warps": MATH_WARPS, "maxnreg": FP8_MAXNREG})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
