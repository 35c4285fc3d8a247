"""Deterministic reduction of the K slot rows of each token: ``out[t] = sum_k rows[t*K + k]`` over the
slots that are not dropped, in slot order, accumulated in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(
    rows_ptr,  # (T*K, D) slot rows, token-major
    topk_idx_ptr,  # (T, K) int32/int64; -1 = dropped (its row was never written)
    out_ptr,  # (T, D)
    D,
    K: tl.constexpr, BD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # int64: T*K*D overflows int32 at real sizes
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < D
    acc = tl.zeros((BD,), dtype=tl.float32)
    for k in tl.static_range(K):
        e = tl.load(topk_idx_ptr + t * K + k)
        v = tl.load(rows_ptr + (t * K + k) * D + cols, mask=cmask & (e >= 0), other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def combine(rows_ND: torch.Tensor, topk_idx_TK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    num_tokens, top_k = topk_idx_TK.shape
    dim = rows_ND.shape[1]
    out_TD = torch.empty(num_tokens, dim, device=rows_ND.device, dtype=out_dtype)
    if num_tokens == 0:
        return out_TD
    bd = min(1024, triton.next_power_of_2(dim))
    _combine_kernel[(num_tokens, triton.cdiv(dim, bd))](rows_ptr=rows_ND, topk_idx_ptr=topk_idx_TK, out_ptr=out_TD,
                                                       D=dim, K=top_k, BD=bd, num_warps=4)
    return out_TD
