"""The expert-parallel baseline: TorchTitan's all-to-all dispatcher around local experts.

Shape legend: R ranks in the group, L local experts per rank, E = R*L global experts (rank r owns
experts [r*L, (r+1)*L)), T tokens on this rank, K slots per token, D hidden, I intermediate,
S rows this rank sends (its routed slots), V rows it receives.

One step, as TorchTitan's ``ExpertParallel`` runs it:

1. sort this rank's slots by global expert (stable; dropped slots ``-1`` last, never sent);
2. exchange the per-expert counts (``all_to_all_single``) and copy the splits to the host — the
   host synchronisation the fused path exists to remove;
3. ``all_to_all_single`` the token rows to the experts' owners;
4. run the local experts on the received rows (routing weight 1: the owner never sees the weights);
5. ``all_to_all_single`` the expert outputs back, apply the routing weights in fp32 on the token
   owner, and sum each token's K slots.

The backward is the same exchange in reverse (autograd through :class:`AllToAll`). Differentiable in
``x``, ``topk_weights`` and the local ``w13``/``w2``; the weight gradients of rank r's experts collect
the rows of every rank. Works with any backend that has ``all_to_all_single`` (NCCL on GPUs; gloo
on CPU, which the tests use).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megamoe import reference

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; the backward sends the gradients back along the same splits."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def exchange_splits(topk_idx_TK: torch.Tensor, num_local: int, group):
    """Steps 1–2: this rank's slots in send order and the counts exchange. Returns the slot order
    (N,) (by global expert, stable; the first ``sum(send_splits)`` are the routed slots), the rows each
    source sends to each of my experts (R*L,) flattened (source, local expert), and the row splits per
    rank to send and to receive — Python ints: the host round trip of the baseline."""
    num_ranks = dist.get_world_size(group)
    num_experts = num_ranks * num_local
    idx_N = topk_idx_TK.reshape(-1).long()
    key_N = torch.where(idx_N >= 0, idx_N, num_experts)  # dropped slots sort last and are not sent
    order_N = torch.argsort(key_N, stable=True)
    send_counts_E = torch.bincount(key_N, minlength=num_experts + 1)[:num_experts]
    recv_counts_E = torch.empty_like(send_counts_E)
    dist.all_to_all_single(recv_counts_E, send_counts_E, group=group)
    send_splits = send_counts_E.view(num_ranks, num_local).sum(1).tolist()
    recv_splits = recv_counts_E.view(num_ranks, num_local).sum(1).tolist()
    return order_N, recv_counts_E, send_splits, recv_splits


def moe_all_to_all(
    x_TD: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_LHD: torch.Tensor,
    w2_LDI: torch.Tensor,
    group,
    experts: Experts = reference.moe_grouped_mm,
) -> torch.Tensor:
    """The MoE layer over the experts of ``group``, exchanging rows with ``all_to_all_single``.

    Args:
        x_TD: this rank's tokens (T, D); T may differ between ranks (and be 0).
        topk_idx_TK: (T, K) *global* expert ids in [0, R*L); -1 drops a slot.
        topk_weights_TK: (T, K) routing weights, applied on this rank in fp32 after the experts.
        w13_LHD, w2_LDI: this rank's L experts, (L, 2I, D) and (L, D, I).
        group: the expert-parallel process group (every rank calls this with the same L, D, I).
        experts: runs the local experts on the received rows, called as ``experts(rows, local_idx (V, 1),
            ones (V, 1), w13, w2)``; the TorchTitan baseline's ``torch._grouped_mm`` path by default
            (wrap it in ``torch.compile`` for the compiled baseline, or pass :func:`megamoe.moe`).

    Returns:
        y: (T, D) in the dtype of ``x``.
    """
    num_ranks = dist.get_world_size(group)
    num_local, _, dim = w13_LHD.shape
    num_tokens, top_k = topk_idx_TK.shape
    device = x_TD.device

    order_N, recv_counts_E, send_splits, recv_splits = exchange_splits(topk_idx_TK, num_local, group)
    num_sent, num_recv = sum(send_splits), sum(recv_splits)

    sent_slots_S = order_N[:num_sent]  # grouped by destination rank, then by local expert
    recv_rows_VD = AllToAll.apply(x_TD[sent_slots_S // top_k], recv_splits, send_splits, group)
    local_idx_V = torch.repeat_interleave(torch.arange(num_local, device=device).repeat(num_ranks), recv_counts_E,
                                          output_size=num_recv)
    ones_V1 = torch.ones(num_recv, 1, device=device, dtype=x_TD.dtype)
    out_VD = experts(recv_rows_VD, local_idx_V[:, None], ones_V1, w13_LHD, w2_LDI)
    back_SD = AllToAll.apply(out_VD, send_splits, recv_splits, group)

    score_S = topk_weights_TK.reshape(-1).float()[sent_slots_S]
    routed_SD = (back_SD.float() * score_S[:, None]).to(x_TD.dtype)
    slots_ND = routed_SD.new_zeros(num_tokens * top_k, dim)  # dropped slots stay zero
    slots_ND = slots_ND.index_put((sent_slots_S,), routed_SD)
    return slots_ND.view(num_tokens, top_k, dim).sum(dim=1)
