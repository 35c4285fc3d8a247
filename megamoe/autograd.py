"""Autograd wiring of the fused kernels. Eagerly, a ``torch.autograd.Function``; under ``torch.compile``,
``torch.library`` custom ops, which the compiler sees as opaque ops with fake implementations (their
shapes depend only on T, K, E, D, I, never on the routing). Both run the same two bodies
(:func:`experts_forward`, :func:`experts_backward`); the custom ops' dispatch layers cost the host about
as much as the rest of the step's Python (docs/DESIGN.md, "Autograd and torch.compile"), which small
batches cannot hide.

Saved for backward: the inputs and the routing plan (a few int32 vectors) — no activations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megamoe.kernels.combine import combine
from megamoe.kernels.expert_bwd import (
    act_bwd,
    dx_slots,
    expert_wgrad,
    expert_wgrad_and_combine,
    sorted_rows_and_dh,
)
from megamoe.kernels.expert_fwd import down_fwd, up_swiglu_fwd
from megamoe.kernels.plan import Plan, build_plan, num_tiles


def experts_forward(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                    offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor) -> Tensor:
    """y (T, D) of the fused layer, given the routing plan's tensors."""
    plan = Plan(offsets, row_slot, tile_expert, tile_row)
    top_k = topk_idx.shape[1]
    h_NI = up_swiglu_fwd(x, w13, plan, top_k)
    slots_ND = down_fwd(h_NI, w2, topk_weights.contiguous(), plan)
    return combine(slots_ND, topk_idx, x.dtype)


def experts_backward(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                     offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d topk_weights, dw13, dw2), recomputing what the forward did not keep."""
    plan = Plan(offsets, row_slot, tile_expert, tile_row)
    top_k = topk_idx.shape[1]
    x_sorted, dy_sorted, dh_NI = sorted_rows_and_dh(x, dy, w2, plan, top_k)
    dz_NH, hw_NI, dweight_TK = act_bwd(x_sorted, dh_NI, w13, topk_weights.contiguous(), plan, top_k)
    dw13, dx = expert_wgrad_and_combine(dz_NH, x_sorted, plan, w13.dtype, dx_slots(dz_NH, w13, plan), topk_idx,
                                        x.dtype)
    dw2 = expert_wgrad(dy_sorted, hw_NI, plan, w2.dtype)
    return dx, dweight_TK.to(topk_weights.dtype), dw13, dw2


class _FusedMoE(torch.autograd.Function):
    """The eager path."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w13, w2):
        plan = build_plan(topk_idx, w13.shape[0]).tensors()
        ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, *plan)
        return experts_forward(x, topk_idx, topk_weights, w13, w2, *plan)

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, w13, w2, *plan = ctx.saved_tensors
        dx, dweight, dw13, dw2 = experts_backward(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, *plan)
        return dx, None, dweight, dw13, dw2


@torch.library.custom_op("megamoe::plan", mutates_args=())
def _plan_op(topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return build_plan(topk_idx, num_experts).tensors()


@_plan_op.register_fake
def _(topk_idx, num_experts):
    n = topk_idx.numel()
    nt = num_tiles(n, num_experts)
    i32 = {"dtype": torch.int32}
    return (topk_idx.new_empty(num_experts + 1, **i32), topk_idx.new_empty(n, **i32),
            topk_idx.new_empty(nt, **i32), topk_idx.new_empty(nt, **i32))


@torch.library.custom_op("megamoe::experts_fwd", mutates_args=())
def _experts_fwd(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                 offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor) -> Tensor:
    return experts_forward(x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row)


@_experts_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row):
    return torch.empty_like(x)


@torch.library.custom_op("megamoe::experts_bwd", mutates_args=())
def _experts_bwd(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                 offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return experts_backward(dy, x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row)


@_experts_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row):
    return torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, topk_idx, topk_weights, w13, w2, *plan = ctx.saved_tensors
    dx, dweight, dw13, dw2 = _experts_bwd(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, *plan)
    return dx, None, dweight, dw13, dw2, None, None, None, None


_experts_fwd.register_autograd(_backward, setup_context=_setup_context)


def fused_moe(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The fused path of :func:`megamoe.moe` (arguments already validated)."""
    topk_idx = topk_idx.contiguous()
    if not torch.compiler.is_compiling():
        return _FusedMoE.apply(x, topk_idx, topk_weights, w13, w2)
    plan = _plan_op(topk_idx, w13.shape[0])
    return _experts_fwd(x, topk_idx, topk_weights, w13, w2, *plan)
