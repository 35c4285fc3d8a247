"""Plain-PyTorch MoE experts: the ground truth every kernel is checked against, and the baseline.

Shape legend: T tokens, K experts per token (slots), E experts, D hidden size, I expert intermediate
size, N = T*K routed rows, M padded rows of the grouped GEMM.

The layer computed by every function here (and by ``megamoe.moe``)::

    y[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),  e = topk_idx[t, k]

Slots with ``topk_idx == -1`` are dropped (contribute nothing, get zero weight gradient).

* :func:`moe_loop` — the per-expert loop of Hugging Face's ``Qwen3MoeSparseMoeBlock``: simplest truth.
* :func:`moe_grouped_mm` — the TorchTitan path (stable sort by expert, per-expert groups padded to a
  multiple of 8 rows, gather, ``torch._grouped_mm`` for gate/up and down, scores applied after the
  experts in fp32, deterministic un-permute). This is what users run today; it is kept faithful. On CPU
  tensors its two grouped GEMMs are :func:`grouped_mm_per_group` (one matmul per group, any float dtype,
  ``torch.compile``-able), since there ``torch._grouped_mm`` takes no fp64 and compiles for bf16 only.
* :func:`moe_grouped_mm_fp8` — the same with torchao's FP8 rowwise MoE training recipe (what TorchTitan's
  float8 converter runs for MoE experts): every grouped GEMM of forward and backward in e4m3 through
  ``torch._scaled_grouped_mm``, groups padded to 16 rows. CUDA only; the GEMMs' outputs are bf16.
* :func:`moe_loop_fp8` — megamoe's blockwise FP8 recipe (``precision="fp8"``) as a per-expert loop in fp32 on
  the dequantised operands: what the FP8 kernels must compute.

All four are differentiable in ``x``, ``topk_weights``, ``w13`` and ``w2``. ``fp32=True`` of :func:`moe_loop`
upcasts every input and returns fp32: that is the reference the tests compare against.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from megamoe.env import (
    FP8_WGRAD_X_SCALES,
    fp8_pow2_scales,
    fp8_wgrad_requested,
    fp8_wgrad_x_scales_requested,
)

# TorchTitan pads each expert's group of rows to this multiple for bf16 grouped GEMMs (the weight
# gradient is grouped along the row dimension, which needs 16-byte aligned group boundaries).
GROUP_ALIGN_M = 8


def _maybe_fp32(fp32: bool, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors] if fp32 else list(tensors)


def grouped_mm_supports(dim: int, inter: int, dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` needs every row stride to be a multiple of 16 bytes."""
    size = dtype.itemsize
    return (dim * size) % 16 == 0 and (inter * size) % 16 == 0


@torch.library.custom_op("megamoe::grouped_mm_per_group", mutates_args=())
def grouped_mm_per_group(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a_MK, b_EKN, offs=offs)`` as one matmul per group, for CPU tensors of any float
    dtype: rows ``[offs[e-1], offs[e])`` times ``b_EKN[e]``; rows past ``offs[-1]`` are zero. A custom op,
    so that ``torch.compile`` takes it whole (on CPU ``torch._grouped_mm`` compiles for bf16 only); the group
    bounds are read on the host, which costs nothing on CPU tensors."""
    out_MN = a_MK.new_zeros(a_MK.shape[0], b_EKN.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out_MN[start:end] = a_MK[start:end] @ b_EKN[e]
        start = end
    return out_MN


@torch.library.custom_op("megamoe::grouped_mm_per_group_wgrad", mutates_args=())
def grouped_mm_per_group_wgrad(a_MK: torch.Tensor, grad_MN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`grouped_mm_per_group` in ``b``: (E, K, N), ``a[group e]ᵀ @ grad[group e]``."""
    out_EKN = a_MK.new_zeros(offs.shape[0], a_MK.shape[1], grad_MN.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out_EKN[e] = a_MK[start:end].t() @ grad_MN[start:end]
        start = end
    return out_EKN


@grouped_mm_per_group.register_fake
def _(a_MK, b_EKN, offs):
    return a_MK.new_empty(a_MK.shape[0], b_EKN.shape[2])


@grouped_mm_per_group_wgrad.register_fake
def _(a_MK, grad_MN, offs):
    return a_MK.new_empty(offs.shape[0], a_MK.shape[1], grad_MN.shape[1])


def _grouped_mm_per_group_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_per_group_backward(ctx, grad_MN):
    a_MK, b_EKN, offs = ctx.saved_tensors
    grad_a = grouped_mm_per_group(grad_MN, b_EKN.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm_per_group_wgrad(a_MK, grad_MN, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm_per_group.register_autograd(_grouped_mm_per_group_backward, setup_context=_grouped_mm_per_group_setup)


def moe_loop(
    x_TD: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_EHD: torch.Tensor,
    w2_EDI: torch.Tensor,
    *,
    fp32: bool = False,
) -> torch.Tensor:
    """Per-expert loop (HF ``Qwen3MoeSparseMoeBlock``). Slow and host-synchronising; for truth only.

    ``w13_EHD`` is (E, 2I, D) with gate rows [0, I) and up rows [I, 2I); ``w2_EDI`` is (E, D, I).
    Computes in the dtype of ``x_TD`` (routing weights are cast to it, as HF does) unless ``fp32``.
    """
    x_TD, topk_weights_TK, w13_EHD, w2_EDI = _maybe_fp32(fp32, x_TD, topk_weights_TK, w13_EHD, w2_EDI)
    num_experts, two_i, _ = w13_EHD.shape
    inter = two_i // 2
    y_TD = torch.zeros_like(x_TD)
    weights_TK = topk_weights_TK.to(x_TD.dtype)
    for e in range(num_experts):
        token_idx, slot_idx = torch.where(topk_idx_TK == e)
        if token_idx.numel() == 0:
            continue
        x_rows = x_TD[token_idx]
        gate_up = x_rows @ w13_EHD[e].t()
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out = (h @ w2_EDI[e].t()) * weights_TK[token_idx, slot_idx, None]
        y_TD = y_TD.index_add(0, token_idx, out)
    return y_TD


def _permute_to_groups(
    x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int, align: int, m_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TorchTitan's token permutation: rows sorted by expert (stable), each expert's group padded with copies of
    an appended zero row to a multiple of ``align`` rows (at least ``align``, so no group is empty).

    Returns ``x_rows_MD`` (m_rows, D) in the dtype of ``x_TD``, the groups' int32 end offsets ``offs_E`` (E,),
    and for the un-permute the int64 (N,) tensors ``order_N`` (slot of each sorted row), ``sorted_key_N``
    (its expert, E for a dropped slot) and ``dest_N`` (its row in ``x_rows_MD``, ``m_rows`` when dropped).
    Rows from ``offs_E[-1]`` to ``m_rows`` are zero rows outside every group. ``m_rows`` must be at least
    ``T*K + E*align``.
    """
    num_tokens, top_k = topk_idx_TK.shape
    dim = x_TD.shape[1]
    n_rows = num_tokens * top_k
    device = x_TD.device

    idx_N = topk_idx_TK.reshape(-1).long()
    valid_N = idx_N >= 0
    key_N = torch.where(valid_N, idx_N, num_experts)  # dropped slots sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key_N, torch.ones_like(key_N))
    padded_E = torch.clamp_min((counts[:num_experts] + align - 1) // align * align, align)
    pad_end_E = torch.cumsum(padded_E, 0)
    pad_start_E1 = torch.cat([pad_end_E - padded_E, pad_end_E.new_full((1,), m_rows)])
    start_E1 = torch.cumsum(counts, 0) - counts

    order_N = torch.argsort(key_N, stable=True)
    sorted_key_N = key_N[order_N]
    rank_N = torch.arange(n_rows, device=device) - start_E1[sorted_key_N]
    # Dropped rows go to row m_rows, one past the grouped GEMM's rows (a trash row).
    dest_N = torch.where(sorted_key_N < num_experts, pad_start_E1[sorted_key_N] + rank_N, m_rows)
    row_token_M = torch.full((m_rows + 1,), num_tokens, dtype=torch.int64, device=device)
    row_token_M[dest_N] = order_N // top_k
    x_pad = torch.cat([x_TD, x_TD.new_zeros(1, dim)])
    x_rows_MD = x_pad[row_token_M[:m_rows]]
    return x_rows_MD, pad_end_E.to(torch.int32), order_N, sorted_key_N, dest_N


def _unpermute_and_combine(
    out_MD: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    num_experts: int,
    order_N: torch.Tensor,
    sorted_key_N: torch.Tensor,
    dest_N: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """TorchTitan's combine: (T, D) in ``dtype``, each token's K expert outputs (rows of ``out_MD`` (M, D),
    placed by :func:`_permute_to_groups`) weighted by their scores and summed."""
    num_tokens, top_k = topk_weights_TK.shape
    m_rows, dim = out_MD.shape
    # Scores are applied to the sorted rows in fp32 (TorchTitan, score_before_experts=False; fp64 stays fp64);
    # then the rows are un-permuted (rows past the last group are never read) and each token's K slots summed.
    score_dtype = torch.promote_types(dtype, torch.float32)
    score_N = topk_weights_TK.reshape(-1).to(score_dtype)[order_N]
    # Dropped rows read an arbitrary (possibly unwritten) row: mask it before it meets the score.
    out_ND = torch.where((sorted_key_N < num_experts)[:, None], out_MD[dest_N.clamp_max(m_rows - 1)], 0)
    routed_ND = (out_ND.to(score_dtype) * score_N[:, None]).to(dtype)
    # Advanced indexing, not index_select/index_copy: under torch.compile the latter measured 40% slower
    # forward+backward (13.2 vs 9.3 ms, 30B layer); the baseline is kept at its strongest.
    slots_ND = torch.empty_like(routed_ND)
    slots_ND[order_N] = routed_ND
    return slots_ND.view(num_tokens, top_k, dim).sum(dim=1)


def moe_grouped_mm(
    x_TD: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_EHD: torch.Tensor,
    w2_EDI: torch.Tensor,
) -> torch.Tensor:
    """TorchTitan-style grouped-GEMM experts. No host synchronisation; ``torch.compile``-able.

    Rows are sorted by expert with a stable sort, each expert's group is padded to a multiple of
    :data:`GROUP_ALIGN_M` rows (at least one block, as TorchTitan does) with copies of an appended zero
    row, so the permuted buffer has the static size ``M = T*K + E*GROUP_ALIGN_M``.
    """
    num_tokens, top_k = topk_idx_TK.shape
    num_experts, two_i, _ = w13_EHD.shape
    inter = two_i // 2
    m_rows = num_tokens * top_k + num_experts * GROUP_ALIGN_M
    x_rows_MD, offs_E, order_N, sorted_key_N, dest_N = _permute_to_groups(
        x_TD, topk_idx_TK, num_experts, GROUP_ALIGN_M, m_rows)

    grouped_mm = torch._grouped_mm if x_TD.device.type != "cpu" else grouped_mm_per_group
    gate_up_MH = grouped_mm(x_rows_MD, w13_EHD.transpose(-2, -1), offs=offs_E)
    h_MI = F.silu(gate_up_MH[:, :inter]) * gate_up_MH[:, inter:]
    out_MD = grouped_mm(h_MI, w2_EDI.transpose(-2, -1), offs=offs_E)
    return _unpermute_and_combine(out_MD, topk_weights_TK, num_experts, order_N, sorted_key_N, dest_N, x_TD.dtype)


# --- FP8 rowwise: torchao's MoE training recipe (Float8TrainingOpConfig / "fp8_rowwise") -------------------

# TorchTitan pads each expert's group to 16 rows for FP8 rowwise (set_token_group_alignment_size_m(16)): the
# weight-gradient GEMM is grouped along the token dimension of two FP8 operands, and CUTLASS's TMA needs each
# group to start on a 16-byte (16-element) boundary and be non-empty.
FP8_GROUP_ALIGN_M = 16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# torchao clamps amax from below before dividing (torchao.float8.float8_utils.EPS).
FP8_AMAX_EPS = 1e-12


def grouped_mm_fp8_supports(dim: int, inter: int) -> bool:
    """``torch._scaled_grouped_mm`` needs the contraction and output sizes (D, 2I; I, D) to be multiples of 16."""
    return dim % 16 == 0 and inter % 16 == 0


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """torchao's ``amax_to_scale(..., round_scales_to_power_of_2=True)``: the fp32 multiplier that maps
    ``amax`` onto the e4m3 range, ``448 / max(amax, 1e-12)`` computed in fp64 then rounded *down* to a power of
    two (so the largest element lands in [224, 448] and dequantising is exact). Same shape as ``amax``."""
    scale = (FP8_MAX / amax.double().clamp_min(FP8_AMAX_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale)))


def _to_fp8_saturated(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # torchao's to_fp8_saturated: PyTorch's cast to e4m3 does not saturate (it overflows to NaN).
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_quantize_axiswise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per slice along ``dim`` (the reduction dim of the GEMM the operand feeds).

    Returns the e4m3 data (same shape and, for a dense tensor, the same strides as ``x``) and the fp32
    scale multipliers with ``dim`` kept as size 1 (dequantised value = data / scale).
    """
    scale = fp8_scale_from_amax(x.abs().amax(dim=dim, keepdim=True))
    return _to_fp8_saturated(x, scale), scale


def fp8_quantize_token_groups(x_MC: torch.Tensor, offs_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group column-wise scaling along the token dimension, for the weight-gradient GEMM (torchao's
    ``triton_fp8_per_group_colwise_scales``): for every group g of rows ``[offs_E[g-1], offs_E[g])`` and column
    c, one scale from the amax of that group's entries of column c.

    ``x_MC`` (M, C) bf16/fp32, row-major; ``offs_E`` (E,) int32 group end offsets, each a multiple of
    :data:`FP8_GROUP_ALIGN_M` (which ``torch._scaled_grouped_mm`` demands of this GEMM anyway) and M too.
    Rows from ``offs_E[-1]`` on belong to no group: they do not reach any scale (they may hold garbage) and
    their data is undefined. Returns the e4m3 data (M, C) **column-major** (strides (1, M)), the layout the
    2d-2d grouped GEMM wants, and the fp32 scale multipliers (E, C).
    """
    m_rows, cols = x_MC.shape
    num_groups = offs_E.numel()
    align = FP8_GROUP_ALIGN_M
    blocks = m_rows // align
    # Group boundaries fall on multiples of 16 rows, so every 16-row block lies in one group: reduce each block
    # first, then take the max over a group's blocks (group id num_groups collects the rows past the last group).
    block_start_B = torch.arange(blocks, device=x_MC.device, dtype=offs_E.dtype) * align
    group_B = torch.searchsorted(offs_E, block_start_B, right=True)
    x_BAC = x_MC.reshape(blocks, align, cols)
    amax_BC = x_BAC.abs().amax(dim=1).float()
    amax_GC = amax_BC.new_zeros(num_groups + 1, cols).scatter_reduce_(
        0, group_B[:, None].expand(-1, cols), amax_BC, reduce="amax")
    scale_GC = fp8_scale_from_amax(amax_GC)
    data_MC = _to_fp8_saturated(x_BAC, scale_GC[group_B][:, None, :]).view(m_rows, cols)
    return data_MC.t().contiguous().t(), scale_GC[:num_groups]


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims column-major (a no-op when they already are)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


class _Fp8RowwiseGroupedMM(torch.autograd.Function):
    """``out = A @ B_t[g]`` for the rows of each group g, every GEMM of forward and backward in FP8 rowwise
    (torchao's ``_Float8GroupedMM``, as run by ``Float8TrainingOpConfig`` with groups already padded).

    Inputs: ``a_MK`` (M, K) bf16/fp32 row-major; ``b_t_EKN`` (E, K, N) bf16/fp32 column-major (a transposed
    weight); ``offs_E`` (E,) int32 group end offsets, multiples of 16 with no empty group (the weight-gradient
    GEMM's requirements). Output (M, N) bf16; rows from ``offs_E[-1]`` on are left unwritten. Gradients:
    (M, K) bf16 for ``a_MK``, (E, K, N) bf16 for ``b_t_EKN``.

    * forward: A scaled per row (over K), B_t per output column (over K, per expert);
    * grad A = grad_out @ B: grad_out per row (over N), B per output column (over N, per expert);
    * grad B = grad_outᵀ @ A per group: both per column over the group's tokens (:func:`fp8_quantize_token_groups`).

    Like torchao, the bf16 A and B_t are saved and requantised in backward, and every GEMM runs with
    ``use_fast_accum=True``.
    """

    @staticmethod
    def forward(ctx, a_MK: torch.Tensor, b_t_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        a_fp8, a_scale_M1 = fp8_quantize_axiswise(a_MK, -1)
        b_fp8, b_scale_E1N = fp8_quantize_axiswise(b_t_EKN, -2)
        ctx.save_for_backward(a_MK, b_t_EKN, offs_E)
        # The GEMM takes the dequantising factors (1 / multiplier): exact, the multipliers are powers of two.
        return torch._scaled_grouped_mm(
            a_fp8.contiguous(), _col_major(b_fp8), a_scale_M1.squeeze(-1).reciprocal(),
            b_scale_E1N.squeeze(-2).reciprocal(), offs=offs_E, out_dtype=torch.bfloat16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        a_MK, b_t_EKN, offs_E = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()

        # grad A (M, K) = grad_out (M, N) @ B (E, N, K): B's scales run over N, one per (expert, k); B is made
        # column-major by storing B_t row-major.
        g_fp8, g_scale_M1 = fp8_quantize_axiswise(grad_MN, -1)
        b_fp8, b_scale_EK1 = fp8_quantize_axiswise(b_t_EKN, -1)
        grad_a_MK = torch._scaled_grouped_mm(
            g_fp8, b_fp8.contiguous().transpose(-2, -1), g_scale_M1.squeeze(-1).reciprocal(),
            b_scale_EK1.squeeze(-1).reciprocal(), offs=offs_E, out_dtype=torch.bfloat16, use_fast_accum=True)

        # grad B (E, N, K) = grad_outᵀ (N, M) @ A (M, K), grouped along the token dim M: the 2d-2d GEMM takes
        # one scale per (group, row of grad_outᵀ) and per (group, column of A), group-major.
        g_col_MN, g_scale_EN = fp8_quantize_token_groups(grad_MN, offs_E)
        a_col_MK, a_scale_EK = fp8_quantize_token_groups(a_MK, offs_E)
        grad_b_ENK = torch._scaled_grouped_mm(
            g_col_MN.t(), a_col_MK, g_scale_EN.reciprocal().reshape(-1), a_scale_EK.reciprocal().reshape(-1),
            offs=offs_E, out_dtype=torch.bfloat16, use_fast_accum=True)
        return grad_a_MK, grad_b_ENK.transpose(-2, -1), None


def _check_fp8_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise NotImplementedError(
            f"moe_grouped_mm_fp8 needs a CUDA GPU of compute capability 9.0 or 10.0 (got a {device.type} "
            "tensor): torch._scaled_grouped_mm has no kernel for other devices")


def moe_grouped_mm_fp8(
    x_TD: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_EHD: torch.Tensor,
    w2_EDI: torch.Tensor,
) -> torch.Tensor:
    """TorchTitan's experts with torchao's FP8 rowwise MoE training recipe (``Float8TrainingOpConfig``,
    ``Float8TrainingRecipe.FP8_ROWWISE``; torchao 0.17, torch 2.11). Same layer and routing as
    :func:`moe_grouped_mm`; CUDA only (Hopper or Blackwell), no host synchronisation, ``torch.compile``-able.

    ``x_TD`` (T, D) bf16 (or fp32); ``topk_idx_TK`` (T, K) int, -1 = dropped slot; ``topk_weights_TK`` (T, K);
    ``w13_EHD`` (E, 2I, D); ``w2_EDI`` (E, D, I); D and I multiples of 16 (:func:`grouped_mm_fp8_supports`).
    Returns (T, D) in the dtype of ``x_TD``; the grouped GEMMs' outputs and gradients are bf16.

    What is reproduced from torchao (``torchao/prototype/moe_training/fp8_grouped_mm.py``):

    * Both grouped GEMMs (gate/up, down) go through :class:`_Fp8RowwiseGroupedMM`, torchao's
      ``_Float8GroupedMM`` for the "2d activations x 3d weights with offsets" case its weight wrapper tensor
      intercepts: three ``torch._scaled_grouped_mm`` calls each (forward, grad input, grad weight), e4m3 for
      every operand, bf16 outputs, ``use_fast_accum=True``.
    * Scales: dynamic, fp32, ``448 / amax`` with amax clamped at 1e-12, computed in fp64, rounded down to a power
      of two, saturating cast. Granularity: forward, activations per row and weights per (expert, output
      column), both over the contraction dim; grad input, grad_out per row and weights per (expert, output
      column) over the other axis; grad weight, grad_out and the saved activations per (group, column) over
      the group's tokens. There is no bf16 fallback: torchao computes the FP8 weight gradient for this recipe
      (its ``wgrad_with_hp`` option exists only for MXFP8).
    * Padding: torchao's FP8 config leaves ``pad_token_groups_for_grouped_mm`` False (its own padding path is not
      enabled for FP8) and relies on TorchTitan's permutation with ``TOKEN_GROUP_ALIGN_SIZE_M = 16``: each
      expert's group is padded with zero rows to a multiple of 16, at least 16 (an expert without tokens gets a
      group of 16 zero rows, which the weight-gradient GEMM needs: it rejects empty groups). Padded rows are
      zeros in every operand (forward activations, output gradients), so they change no per-group scale and
      contribute nothing to the weight gradients.

    Not reproduced: torchao's fused Triton quantisation kernels (here plain PyTorch ops, which
    ``torch.compile`` fuses); the numerics are the same formula. One deviation in shape only: the static
    permuted buffer is rounded up to a multiple of 16 rows (``round_up(T*K, 16) + 16*E``), because the
    weight-gradient GEMM needs its token dimension to be a multiple of 16; TorchTitan's ``T*K + 16*E`` is a
    multiple of 16 only when T*K is (the two agree then, as in the usual training shapes).
    """
    _check_fp8_device(x_TD.device)
    num_tokens, top_k = topk_idx_TK.shape
    num_experts, two_i, dim = w13_EHD.shape
    inter = two_i // 2
    if not grouped_mm_fp8_supports(dim, inter):
        raise ValueError(f"moe_grouped_mm_fp8 needs D and I to be multiples of 16 (got D={dim}, I={inter})")
    align = FP8_GROUP_ALIGN_M
    m_rows = (num_tokens * top_k + align - 1) // align * align + num_experts * align
    x_rows_MD, offs_E, order_N, sorted_key_N, dest_N = _permute_to_groups(
        x_TD, topk_idx_TK, num_experts, align, m_rows)

    gate_up_MH = _Fp8RowwiseGroupedMM.apply(x_rows_MD, w13_EHD.transpose(-2, -1), offs_E)
    h_MI = F.silu(gate_up_MH[:, :inter]) * gate_up_MH[:, inter:]
    out_MD = _Fp8RowwiseGroupedMM.apply(h_MI, w2_EDI.transpose(-2, -1), offs_E)
    return _unpermute_and_combine(out_MD, topk_weights_TK, num_experts, order_N, sorted_key_N, dest_N, x_TD.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Blockwise FP8 (the recipe of ``megamoe.kernels.quant``), in plain PyTorch: the quantisers bit for bit, and the
# layer computed the way the FP8 kernels compute it, with every product in fp32 on the dequantised operands.

E4M3_MAX, FP8_GROUP, AMAX_FLOOR = 448.0, 128, 1e-12


def quantize_groups(v: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` (..., G) fp32 -> (e4m3 (..., G), fp32 scales (...)): one group per last-dim row; with power-of-two
    scales (``env.set_fp8_scales``) amax / 448 rounded up to a power of two, and v times its exact inverse. ``amax``
    (...): each group's scale from it instead of from its values (which saturate past it)."""
    amax = (v.abs().amax(dim=-1) if amax is None else amax.float()).clamp_min(AMAX_FLOOR)
    # Tensor by tensor, both ways: ``448 / amax`` would be ``amax.reciprocal() * 448`` (torch's __rtruediv__), and
    # ``amax / 448`` a multiplication by the reciprocal on CUDA; the kernels divide with IEEE rounding.
    e4m3_max = torch.full_like(amax, E4M3_MAX)
    scale = amax / e4m3_max
    if fp8_pow2_scales():
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))
        inv = torch.ones_like(scale) / scale
    else:
        inv = e4m3_max / amax
    return (v * inv[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_rows(a_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (M, K) e4m3, s (K/128, M) fp32), as ``kernels.quant.quantize_rows``."""
    num_rows, k = a_MK.shape
    q, s = quantize_groups(a_MK.float().reshape(num_rows, k // FP8_GROUP, FP8_GROUP))
    return q.reshape(num_rows, k), s.t().contiguous()


def quantize_weight(w_ERC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, qt, st), as ``kernels.quant.quantize_weight``: 128x128 blocks of ``w`` (E, R, C) and of its transpose."""
    num_experts, r, c = w_ERC.shape
    g = FP8_GROUP
    blocks = w_ERC.float().reshape(num_experts, r // g, g, c // g, g).transpose(2, 3)  # (E, R/g, C/g, g, g)
    q, s = quantize_groups(blocks.reshape(num_experts, r // g, c // g, g * g))
    q = q.reshape(num_experts, r // g, c // g, g, g)
    return (q.transpose(2, 3).reshape(num_experts, r, c), s,
            q.permute(0, 2, 4, 1, 3).reshape(num_experts, c, r), s.transpose(1, 2).contiguous())


def _quantize_cols(a_RC: torch.Tensor, col_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's rows (R, C) in 128x1 groups from its first row: (q (C, G*128) e4m3, zeros past R; s (G, C) fp32),
    G = ceil(R / 128). ``col_amax`` (C,): every group's scale from its column's, as ``kernels.quant.quantize_tile_cols``
    takes it."""
    num_rows, c = a_RC.shape
    groups = -(-num_rows // FP8_GROUP)
    padded = a_RC.float().new_zeros(groups * FP8_GROUP, c)
    padded[:num_rows] = a_RC.float()
    amax = None if col_amax is None else col_amax.expand(groups, c)
    q, s = quantize_groups(padded.reshape(groups, FP8_GROUP, c).transpose(1, 2), amax)  # (G, C, 128), (G, C)
    return q.transpose(0, 1).reshape(c, groups * FP8_GROUP), s


def quantize_tile_cols(a_NC: torch.Tensor, offsets_E1: torch.Tensor,
                       col_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (C, G*128) e4m3, s (G, C) fp32), as ``kernels.quant.quantize_tile_cols`` for its busy tiles (G of them,
    expert by expert): each expert's sorted rows [offsets[e], offsets[e+1]) of ``a`` (N, C) in 128x1 groups;
    ``col_amax``: (C,) or (E, C), the groups' scales from it."""
    bounds = offsets_E1.tolist()
    amax = [None] * (len(bounds) - 1) if col_amax is None else col_amax.expand(len(bounds) - 1, a_NC.shape[1])
    parts = [_quantize_cols(a_NC[lo:hi], m) for (lo, hi), m in zip(itertools.pairwise(bounds), amax)]
    # float8 tensors have no cat on CPU: their bytes do
    q = torch.cat([p[0].view(torch.uint8) for p in parts], dim=1).view(torch.float8_e4m3fn)
    return q, torch.cat([p[1] for p in parts])


def dequantize_tile_cols(q_CL: torch.Tensor, s_TC: torch.Tensor, offsets_E1: torch.Tensor) -> list[torch.Tensor]:
    """Per expert, its rows of a tile-column operand (``quantize_tile_cols``'s format, the kernel's or this file's)
    dequantised in float64 (exact): (C, 128 * its tiles), zeros past its last row."""
    bounds = offsets_E1.tolist()
    tiles = [-(-(hi - lo) // FP8_GROUP) for lo, hi in itertools.pairwise(bounds)]
    busy = sum(tiles)
    deq = q_CL[:, :busy * FP8_GROUP].double().reshape(q_CL.shape[0], busy, FP8_GROUP) * s_TC[:busy].t().double()[..., None]
    return [part.reshape(q_CL.shape[0], -1) for part in deq.split(tiles, dim=1)]


def dequantize_rows(q_MK: torch.Tensor, s_KM: torch.Tensor) -> torch.Tensor:
    return q_MK.float() * s_KM.t().repeat_interleave(FP8_GROUP, dim=1)


def dequantize_weight(q_ERC: torch.Tensor, s_E: torch.Tensor) -> torch.Tensor:
    return q_ERC.float() * s_E.repeat_interleave(FP8_GROUP, dim=1).repeat_interleave(FP8_GROUP, dim=2)


def _fp8_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` (M, K) through 1x128 quantisation and back, fp32."""
    return dequantize_rows(*quantize_rows(a))


def _fp8_cols(a_RC: torch.Tensor, col_amax: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's rows (R, C) through 128x1 quantisation (groups from its first row; ``col_amax``: their scales
    from it) and back, fp32."""
    q, s = _quantize_cols(a_RC, col_amax)
    return (q.float() * s.repeat_interleave(FP8_GROUP, dim=0).t()).t()[:a_RC.shape[0]]


class _MoeLoopFP8(torch.autograd.Function):
    """The FP8 recipe of ``megamoe.moe(precision="fp8")``, per expert, in fp32 on dequantised operands.

    Forward: x 1x128, w13 and w2 128x128; h = silu(g) * u quantised 1x128 before the down GEMM. Backward: dy
    1x128; dh' = dy W2[e]; the SwiGLU backward from the recomputed g, u in fp32; dz = [dg | du] in x's dtype, 1x128
    for dx = dz W13[e]; the weight gradients from the unquantised operands (dW13 = dz^T x, dW2 = dy^T (h w)), as the
    kernels compute them (in the operands' dtype). ``fp8_wgrad``: the weight gradients in FP8 instead (DeepSeek-V3's
    recipe, ``autograd.FP8_WGRAD``): each operand's rows of an expert, as the kernels hold them (x's dtype), in 128x1
    groups from the expert's first row (sorted by slot: the plan's order); ``x_scales`` "layer": x's groups with one
    scale per channel over all of x's rows, "expert": over the expert's rows (``autograd.FP8_WGRAD_X_SCALES``)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w13, w2, fp8_wgrad=False, x_scales="tile"):
        inter = w13.shape[1] // 2
        xd = _fp8_rows(x)
        w13d, w2d = (dequantize_weight(*quantize_weight(w)[:2]) for w in (w13, w2))
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(w13.shape[0]):
            tok, slot = torch.where(topk_idx == e)
            gu = xd[tok] @ w13d[e].t()
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
            y.index_add_(0, tok, (_fp8_rows(h) @ w2d[e].t()) * topk_weights[tok, slot, None].float())
        ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2)
        ctx.fp8_wgrad = fp8_wgrad
        ctx.x_scales = x_scales
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, w13, w2 = ctx.saved_tensors
        inter = w13.shape[1] // 2
        xd, dyd = _fp8_rows(x), _fp8_rows(dy)
        w13d, w2d = (dequantize_weight(*quantize_weight(w)[:2]) for w in (w13, w2))
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        dweight = torch.zeros(topk_weights.shape, dtype=torch.float32, device=x.device)
        dw13, dw2 = torch.zeros_like(w13, dtype=torch.float32), torch.zeros_like(w2, dtype=torch.float32)
        x_amax = x.abs().amax(dim=0).float() if ctx.x_scales == "layer" and x.shape[0] else None
        for e in range(w13.shape[0]):
            tok, slot = torch.where(topk_idx == e)
            gu = xd[tok] @ w13d[e].t()
            g, u = gu[:, :inter], gu[:, inter:]
            sig = torch.sigmoid(g)
            h = g * sig * u
            dh = dyd[tok] @ w2d[e]
            wt = topk_weights[tok, slot, None].float()
            dweight[tok, slot] = (dh * h).sum(dim=1)
            dz = torch.cat([dh * wt * u * (sig + g * sig * (1 - sig)), dh * wt * g * sig], dim=1)
            dx.index_add_(0, tok, _fp8_rows(dz.to(x.dtype)) @ w13d[e])
            if ctx.fp8_wgrad:
                amax = x[tok].abs().amax(dim=0).float() if ctx.x_scales == "expert" and len(tok) else x_amax
                dw13[e] = _fp8_cols(dz.to(x.dtype)).t() @ _fp8_cols(x[tok], amax)
                dw2[e] = _fp8_cols(dy[tok]).t() @ _fp8_cols((h * wt).to(x.dtype))
            else:
                dw13[e] = dz.t() @ x[tok].float()
                dw2[e] = dy[tok].float().t() @ (h * wt)
        return (dx.to(x.dtype), None, dweight.to(topk_weights.dtype), dw13.to(w13.dtype), dw2.to(w2.dtype), None,
                None)


def moe_loop_fp8(x_TD, topk_idx_TK, topk_weights_TK, w13_EHD, w2_EDI, fp8_wgrad: bool | None = None,
                 x_scales: str | None = None) -> torch.Tensor:
    """The layer in megamoe's blockwise FP8 recipe (``_MoeLoopFP8``): the tests' measure of what FP8 itself costs
    against the fp32 reference, and the recipe the FP8 kernels must reproduce. D and I multiples of 128.
    ``fp8_wgrad``: with FP8 weight gradients (128x1 operands), as the kernels compute them with
    ``autograd.FP8_WGRAD``, or bf16 ones (False); None: as ``MEGAMOE_FP8_WGRAD`` sets that switch's default
    (``env.fp8_wgrad_requested``). ``x_scales``: x's scales in FP8 weight gradients, "tile", "layer" or "expert" as
    ``autograd.FP8_WGRAD_X_SCALES``; None: as ``MEGAMOE_FP8_WGRAD_X_SCALES`` sets its default."""
    if fp8_wgrad is None:
        fp8_wgrad = fp8_wgrad_requested()
    if x_scales is None:
        x_scales = fp8_wgrad_x_scales_requested()
    if x_scales not in FP8_WGRAD_X_SCALES:
        raise ValueError(f"x_scales must be one of {FP8_WGRAD_X_SCALES}, got {x_scales!r}")
    return _MoeLoopFP8.apply(x_TD, topk_idx_TK, topk_weights_TK, w13_EHD, w2_EDI, fp8_wgrad, x_scales)
