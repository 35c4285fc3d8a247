"""Plain-PyTorch MoE experts: the ground truth every kernel is checked against, and the baseline.

Shape legend: T tokens, K experts per token (slots), E experts, D hidden size, I expert intermediate
size, N = T*K routed rows, M padded rows of the grouped GEMM.

The layer computed by every function here (and by ``megamoe.moe``)::

    y[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),  e = topk_idx[t, k]

Slots with ``topk_idx == -1`` are dropped (contribute nothing, get zero weight gradient).

* :func:`moe_loop` — the per-expert loop of Hugging Face's ``Qwen3MoeSparseMoeBlock``: simplest truth.
* :func:`moe_grouped_mm` — the TorchTitan path (stable sort by expert, per-expert groups padded to a
  multiple of 8 rows, gather, ``torch._grouped_mm`` for gate/up and down, scores applied after the
  experts in fp32, deterministic un-permute). This is what users run today; it is kept faithful.

Both are differentiable in ``x``, ``topk_weights``, ``w13`` and ``w2``. ``fp32=True`` upcasts every
input and returns fp32: that is the reference the tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# TorchTitan pads each expert's group of rows to this multiple for bf16 grouped GEMMs (the weight
# gradient is grouped along the row dimension, which needs 16-byte aligned group boundaries).
GROUP_ALIGN_M = 8


def _maybe_fp32(fp32: bool, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors] if fp32 else list(tensors)


def grouped_mm_supports(dim: int, inter: int, dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` needs every row stride to be a multiple of 16 bytes."""
    size = dtype.itemsize
    return (dim * size) % 16 == 0 and (inter * size) % 16 == 0


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


def moe_grouped_mm(
    x_TD: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_EHD: torch.Tensor,
    w2_EDI: torch.Tensor,
    *,
    fp32: bool = False,
) -> torch.Tensor:
    """TorchTitan-style grouped-GEMM experts. No host synchronisation; ``torch.compile``-able.

    Rows are sorted by expert with a stable sort, each expert's group is padded to a multiple of
    :data:`GROUP_ALIGN_M` rows (at least one block, as TorchTitan does) with copies of an appended zero
    row, so the permuted buffer has the static size ``M = T*K + E*GROUP_ALIGN_M``.
    """
    x_TD, topk_weights_TK, w13_EHD, w2_EDI = _maybe_fp32(fp32, x_TD, topk_weights_TK, w13_EHD, w2_EDI)
    num_tokens, top_k = topk_idx_TK.shape
    num_experts, two_i, dim = w13_EHD.shape
    inter = two_i // 2
    n_rows = num_tokens * top_k
    m_rows = n_rows + num_experts * GROUP_ALIGN_M
    device = x_TD.device

    idx_N = topk_idx_TK.reshape(-1).long()
    valid_N = idx_N >= 0
    key_N = torch.where(valid_N, idx_N, num_experts)  # dropped slots sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key_N, torch.ones_like(key_N))
    padded_E = torch.clamp_min((counts[:num_experts] + GROUP_ALIGN_M - 1) // GROUP_ALIGN_M * GROUP_ALIGN_M,
                               GROUP_ALIGN_M)
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

    offs_E = pad_end_E.to(torch.int32)
    gate_up_MH = torch._grouped_mm(x_rows_MD, w13_EHD.transpose(-2, -1), offs=offs_E)
    h_MI = F.silu(gate_up_MH[:, :inter]) * gate_up_MH[:, inter:]
    out_MD = torch._grouped_mm(h_MI, w2_EDI.transpose(-2, -1), offs=offs_E)

    # Scores are applied to the sorted rows in fp32 (TorchTitan, score_before_experts=False); then the
    # rows are un-permuted (rows past the last group are never read) and each token's K slots summed.
    score_N = topk_weights_TK.reshape(-1).float()[order_N]
    # Dropped rows read an arbitrary (possibly unwritten) row: mask it before it meets the score.
    out_ND = torch.where((sorted_key_N < num_experts)[:, None], out_MD[dest_N.clamp_max(m_rows - 1)], 0)
    routed_ND = (out_ND.float() * score_N[:, None]).to(x_TD.dtype)
    # Advanced indexing, not index_select/index_copy: under torch.compile the latter measured 40% slower
    # forward+backward (13.2 vs 9.3 ms, 30B layer); the baseline is kept at its strongest.
    slots_ND = torch.empty_like(routed_ND)
    slots_ND[order_N] = routed_ND
    return slots_ND.view(num_tokens, top_k, dim).sum(dim=1)


# ---------------------------------------------------------------------------------------------------------------
# Blockwise FP8 (the recipe of ``megamoe.kernels.quant``), in plain PyTorch: the quantisers bit for bit, and the
# layer computed the way the FP8 kernels compute it, with every product in fp32 on the dequantised operands.

E4M3_MAX, FP8_GROUP, AMAX_FLOOR = 448.0, 128, 1e-12


def _quantize_groups(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` (..., G) fp32 -> (e4m3 (..., G), fp32 scales (...)): one group per last-dim row."""
    amax = v.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    q = (v * (E4M3_MAX / amax)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, amax / E4M3_MAX


def quantize_rows(a_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (M, K) e4m3, s (K/128, M) fp32), as ``kernels.quant.quantize_rows``."""
    num_rows, k = a_MK.shape
    q, s = _quantize_groups(a_MK.float().reshape(num_rows, k // FP8_GROUP, FP8_GROUP))
    return q.reshape(num_rows, k), s.t().contiguous()


def quantize_weight(w_ERC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, qt, st), as ``kernels.quant.quantize_weight``: 128x128 blocks of ``w`` (E, R, C) and of its transpose."""
    num_experts, r, c = w_ERC.shape
    g = FP8_GROUP
    blocks = w_ERC.float().reshape(num_experts, r // g, g, c // g, g).transpose(2, 3)  # (E, R/g, C/g, g, g)
    q, s = _quantize_groups(blocks.reshape(num_experts, r // g, c // g, g * g))
    q = q.reshape(num_experts, r // g, c // g, g, g)
    return (q.transpose(2, 3).reshape(num_experts, r, c), s,
            q.permute(0, 2, 4, 1, 3).reshape(num_experts, c, r), s.transpose(1, 2).contiguous())


def dequantize_rows(q_MK: torch.Tensor, s_KM: torch.Tensor) -> torch.Tensor:
    return q_MK.float() * s_KM.t().repeat_interleave(FP8_GROUP, dim=1)


def dequantize_weight(q_ERC: torch.Tensor, s_E: torch.Tensor) -> torch.Tensor:
    return q_ERC.float() * s_E.repeat_interleave(FP8_GROUP, dim=1).repeat_interleave(FP8_GROUP, dim=2)


def _fp8_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` (M, K) through 1x128 quantisation and back, fp32."""
    return dequantize_rows(*quantize_rows(a))


class _MoeLoopFP8(torch.autograd.Function):
    """The FP8 recipe of ``megamoe.moe(precision="fp8")``, per expert, in fp32 on dequantised operands.

    Forward: x 1x128, w13 and w2 128x128; h = silu(g) * u quantised 1x128 before the down GEMM. Backward: dy
    1x128; dh' = dy W2[e]; the SwiGLU backward from the recomputed g, u in fp32; dz = [dg | du] 1x128 for
    dx = dz W13[e]; the weight gradients from the unquantised operands (dW13 = dz^T x, dW2 = dy^T (h w)), as the
    kernels compute them (in the operands' dtype)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w13, w2):
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
            dx.index_add_(0, tok, _fp8_rows(dz) @ w13d[e])
            dw13[e] = dz.t() @ x[tok].float()
            dw2[e] = dy[tok].float().t() @ (h * wt)
        return (dx.to(x.dtype), None, dweight.to(topk_weights.dtype), dw13.to(w13.dtype), dw2.to(w2.dtype))


def moe_loop_fp8(x_TD, topk_idx_TK, topk_weights_TK, w13_EHD, w2_EDI) -> torch.Tensor:
    """The layer in megamoe's blockwise FP8 recipe (``_MoeLoopFP8``): the tests' measure of what FP8 itself costs
    against the fp32 reference, and the recipe the FP8 kernels must reproduce. D and I multiples of 128."""
    return _MoeLoopFP8.apply(x_TD, topk_idx_TK, topk_weights_TK, w13_EHD, w2_EDI)
