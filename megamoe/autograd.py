"""Autograd wiring of the fused kernels. Eagerly, a ``torch.autograd.Function``; under ``torch.compile``,
``torch.library`` custom ops, which the compiler sees as opaque ops with fake implementations (their
shapes depend only on T, K, E, D, I, never on the routing). Both run the same two bodies
(:func:`experts_forward`, :func:`experts_backward`); the custom ops' dispatch layers cost the host about
as much as the rest of the step's Python (docs/DESIGN.md, "Autograd and torch.compile"), which small
batches cannot hide.

Saved for backward: the inputs and the routing plan (a few int32 vectors) — no activations — or, in the
saved-activation mode, also the gate/up products (N, 2I in x's dtype), so the backward skips their GEMM.

The precision is chosen here, once: ``fp8`` runs the blockwise FP8 bodies (:func:`experts_forward_fp8`,
:func:`experts_backward_fp8`) behind the same autograd function and custom ops. Their weight gradients are FP8
GEMMs (bf16 outputs) too while :data:`FP8_WGRAD` is set (the default), else bf16 GEMMs on the unquantised rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megamoe.env import (
    custom_ops_forced,
    fp8_wgrad_requested,
    fp8_wgrad_x_scales_requested,
    low_peak_backward_requested,
)
from megamoe.kernels.backward_fp8 import backward_rows_fp8, preact_buffer
from megamoe.kernels.combine import combine
from megamoe.kernels.expert_bwd import (
    act_bwd,
    act_bwd_from_preact,
    dx_slots,
    expert_wgrad,
    expert_wgrad_and_combine,
    sorted_rows_and_dh,
)
from megamoe.kernels.expert_fwd import (
    down_fp8,
    down_fwd,
    up_swiglu_fp8,
    up_swiglu_fwd,
)
from megamoe.kernels.plan import Plan, build_plan, plan_op
from megamoe.kernels.quant import fp8_weight, quantize_rows

# The FP8 path's weight gradients in FP8 too (DeepSeek-V3's recipe: both operands re-quantised 128x1 along the
# tokens from their rows in x's dtype, ``quant.quantize_tile_cols``, then ``expert_bwd.wgrad_fp8``), or in bf16 from
# those rows (False). On by default: on the H200 as fast as the bf16 ones at the 30B layer and 9% faster at the 235B
# one, with less memory (no sorted bf16 copies of x and dy; ``python -m tools.fp8``, docs/PERFORMANCE.md).
# ``MEGAMOE_FP8_WGRAD=0`` clears it at import; the one-GPU backward reads it at every call, the expert-parallel
# layer (``megamoe.moe(group=...)``) when its forward runs.
FP8_WGRAD = fp8_wgrad_requested()
# With FP8 weight gradients, x's scales in dW13 = dzᵀ x: "tile" (the recipe's 128x1 groups, the default), "layer"
# (one per channel over the layer's tokens, ``quant.channel_amax``: each K-step then promoted by dz's scales alone,
# x's applied to the sum) or "expert" (one per channel over each expert's tokens, ``quant.expert_channel_amax``, the
# same GEMM; ``env.fp8_wgrad_x_scales_requested``). One GPU only (``megamoe.moe`` refuses all but "tile" with
# ``group``); the backward reads it at every call.
FP8_WGRAD_X_SCALES = fp8_wgrad_x_scales_requested()
# The one-GPU backward's order (bf16 weight gradients). True (low peak, the default): dW13 first (x's sorted rows freed
# after it), then dx's slot rows and their combine on its own, dz freed before the combine: the backward's peak holds
# one N x D block beside dz and the weight gradients, under SonicMoE's peak at the 30B layer. False: dx's slot rows
# computed before dW13, whose kernel sums them into dx beside its MMAs (the combine costs nothing), its peak holding
# x's sorted rows, dz, dx's slot rows and both weight gradients at once: on the H200 at the 30B layer 1.3-2.3% faster
# in the saved mode, its peak 512 MiB higher (2 689 MiB against 2 177 and SonicMoE's 2 178; docs/PERFORMANCE.md).
# Read when a forward runs (its backward follows that choice); ``MEGAMOE_LOW_PEAK_BACKWARD=0`` clears it at import.
LOW_PEAK_BACKWARD = low_peak_backward_requested()


def experts_forward(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                    offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor,
                    preact: Tensor | None = None) -> Tensor:
    """y (T, D) of the fused layer, given the routing plan's tensors. ``preact``: (N, 2I) in x's dtype, also
    written with each sorted row's gate and up products (the saved-activation mode)."""
    plan = Plan(offsets, row_slot, tile_expert, tile_row)
    top_k = topk_idx.shape[1]
    h_NI = up_swiglu_fwd(x, w13, plan, top_k, preact_NH=preact)
    slots_ND = down_fwd(h_NI, w2, topk_weights.contiguous(), plan)
    return combine(slots_ND, topk_idx, x.dtype)


def experts_backward(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                     offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor,
                     preact: Tensor | None = None, low_peak: bool = False,
                     reuse_preact: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d topk_weights, dw13, dw2): from the forward's saved gate and up products ``preact`` if given, else
    recomputing them (the gate/up GEMM) from x; ``low_peak``: the order of :data:`LOW_PEAK_BACKWARD`;
    ``reuse_preact``: the caller hands ``preact`` over, and dz is written over it (one (N, 2I) block less at the
    backward's peak; the caller must not read it again)."""
    plan = Plan(offsets, row_slot, tile_expert, tile_row)
    top_k = topk_idx.shape[1]
    x_sorted, dy_sorted, dh_NI = sorted_rows_and_dh(x, dy, w2, plan, top_k)
    if preact is None:
        dz_NH, hw_NI, dweight_TK = act_bwd(x_sorted, dh_NI, w13, topk_weights.contiguous(), plan, top_k)
    else:
        dz_NH, hw_NI, dweight_TK = act_bwd_from_preact(preact, dh_NI, topk_weights.contiguous(), plan, top_k,
                                                       dz_over_preact=reuse_preact)
    del dh_NI
    # dW2 first, so that dy's rows and h·w are freed before dx's slot rows and dW13 take their memory (the
    # backward's peak: docs/PERFORMANCE.md).
    dw2 = expert_wgrad(dy_sorted, hw_NI, plan, w2.dtype, gemm="dw2")
    del dy_sorted, hw_NI
    if low_peak:
        dw13 = expert_wgrad(dz_NH, x_sorted, plan, w13.dtype, gemm="dw13")
        del x_sorted
        dx_slots_ND = dx_slots(dz_NH, w13, plan)
        del dz_NH
        dx = combine(dx_slots_ND, topk_idx, x.dtype)
    else:
        dw13, dx = expert_wgrad_and_combine(dz_NH, x_sorted, plan, w13.dtype, dx_slots(dz_NH, w13, plan), topk_idx,
                                            x.dtype)
    return dx, dweight_TK.to(topk_weights.dtype), dw13, dw2


def experts_forward_fp8(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                        offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor,
                        preact: Tensor | None = None) -> Tensor:
    """:func:`experts_forward` in blockwise FP8 (``kernels.quant``): x quantised 1x128, the weights' straight FP8
    copies (``quant.fp8_weight``: cached, or made here under the "call" policy), h quantised 1x128 in the up
    kernel's epilogue; y in x's dtype, summed in fp32."""
    plan = Plan(offsets, row_slot, tile_expert, tile_row)
    w13q, w13s, _, _ = fp8_weight(w13, transposed=False)
    w2q, w2s, _, _ = fp8_weight(w2, transposed=False)
    hq, hs = up_swiglu_fp8(*quantize_rows(x), w13q, w13s, plan, topk_idx.shape[1], preact_NH=preact)
    slots_ND = down_fp8(hq, hs, w2q, w2s, topk_weights.contiguous(), plan, x.dtype)
    return combine(slots_ND, topk_idx, x.dtype)


def experts_backward_fp8(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                         offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor,
                         preact: Tensor | None = None, low_peak: bool = False,
                         reuse_preact: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`experts_backward` in blockwise FP8 (``kernels.backward_fp8.backward_rows_fp8`` on the tokens' rows,
    dx combined per token), FP8 weight gradients as :data:`FP8_WGRAD` and :data:`FP8_WGRAD_X_SCALES` say."""
    plan = Plan(offsets, row_slot, tile_expert, tile_row)
    dx, dweight_TK, dw13, dw2 = backward_rows_fp8(
        dy, x, topk_weights.contiguous(), w13, w2, plan, topk_idx.shape[1],
        lambda dx_slots_ND, _: combine(dx_slots_ND, topk_idx, x.dtype), fp8_wgrad=FP8_WGRAD,
        x_scales=FP8_WGRAD_X_SCALES, preact=preact,
        reuse_preact=reuse_preact, combine_in_dw13=None if low_peak else topk_idx)
    return dx, dweight_TK.to(topk_weights.dtype), dw13, dw2


def _forward_body(fp8: bool):
    return experts_forward_fp8 if fp8 else experts_forward


def _backward_body(fp8: bool):
    return experts_backward_fp8 if fp8 else experts_backward


class _FusedMoE(torch.autograd.Function):
    """The eager path."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w13, w2, save_preact: bool, fp8: bool, low_peak: bool):
        plan = build_plan(topk_idx, w13.shape[0]).tensors()
        preact = preact_buffer(x, topk_idx.numel(), w13) if save_preact else None
        y = _forward_body(fp8)(x, topk_idx, topk_weights, w13, w2, *plan, preact=preact)
        ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, *plan, *(() if preact is None else (preact,)))
        ctx.save_preact, ctx.fp8, ctx.low_peak = save_preact, fp8, low_peak
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, w13, w2, *rest = ctx.saved_tensors
        plan, preact = (rest[:-1], rest[-1]) if ctx.save_preact else (rest, None)
        # The saved products are this layer's own: dz takes their memory (on the FP8 path with FP8 weight gradients,
        # which writes no dz in x's dtype, x's tile columns do). Marked as modified, so that a second backward through
        # a retained graph fails at unpacking them instead of reading something else as g and u.
        overwrite = preact is not None
        if overwrite:
            torch.autograd.graph.increment_version(preact)
        dx, dweight, dw13, dw2 = _backward_body(ctx.fp8)(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, *plan,
                                                         preact=preact, low_peak=ctx.low_peak, reuse_preact=overwrite)
        return dx, None, dweight, dw13, dw2, None, None, None


# ``fp8``: the blockwise FP8 bodies; ``low_peak``: the backward's order (:data:`LOW_PEAK_BACKWARD`), carried by the
# forward ops to their autograd context; trailing arguments with defaults, so that other callers name them nowhere.
@torch.library.custom_op("megamoe::experts_fwd", mutates_args=())
def _experts_fwd(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                 offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor, fp8: bool = False,
                 low_peak: bool = False) -> Tensor:
    return _forward_body(fp8)(x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row)


@_experts_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row, fp8=False, low_peak=False):
    return torch.empty_like(x)


@torch.library.custom_op("megamoe::experts_fwd_saved", mutates_args=())
def _experts_fwd_saved(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                       offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor, fp8: bool = False,
                       low_peak: bool = False) -> tuple[Tensor, Tensor]:
    preact = preact_buffer(x, topk_idx.numel(), w13)
    return _forward_body(fp8)(x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row,
                              preact=preact), preact


@_experts_fwd_saved.register_fake
def _(x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row, fp8=False, low_peak=False):
    return torch.empty_like(x), preact_buffer(x, topk_idx.numel(), w13)


# The op mutates nothing: unlike the eager path, it leaves saved products as they were (dz gets a block of its own).
# Declaring that it writes over them fails opcheck of ``_experts_fwd_saved``, whose output they are.
@torch.library.custom_op("megamoe::experts_bwd", mutates_args=())
def _experts_bwd(dy: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                 offsets: Tensor, row_slot: Tensor, tile_expert: Tensor, tile_row: Tensor, preact: Tensor | None,
                 fp8: bool = False, low_peak: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward_body(fp8)(dy, x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row,
                               preact=preact, low_peak=low_peak)


@_experts_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row, preact, fp8=False,
      low_peak=False):
    return torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2)


_NO_GRADS = (None,) * 6  # the plan's four tensors, ``fp8`` and ``low_peak``


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9])
    ctx.fp8, ctx.low_peak = inputs[9], inputs[10]


def _backward(ctx, dy):
    x, topk_idx, topk_weights, w13, w2, *plan = ctx.saved_tensors
    dx, dweight, dw13, dw2 = _experts_bwd(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, *plan, None, ctx.fp8,
                                          ctx.low_peak)
    return dx, None, dweight, dw13, dw2, *_NO_GRADS


def _setup_context_saved(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9], output[1])
    ctx.fp8, ctx.low_peak = inputs[9], inputs[10]
    ctx.mark_non_differentiable(output[1])


def _backward_saved(ctx, dy, _):
    x, topk_idx, topk_weights, w13, w2, *plan, preact = ctx.saved_tensors
    dx, dweight, dw13, dw2 = _experts_bwd(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, *plan, preact, ctx.fp8,
                                          ctx.low_peak)
    return dx, None, dweight, dw13, dw2, *_NO_GRADS


_experts_fwd.register_autograd(_backward, setup_context=_setup_context)
_experts_fwd_saved.register_autograd(_backward_saved, setup_context=_setup_context_saved)


def fused_moe(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
              save_preact: bool = False, fp8: bool = False) -> Tensor:
    """The fused path of :func:`megamoe.moe` (arguments already validated). ``save_preact``: keep the gate/up
    products (N, 2I) for the backward instead of recomputing them there. ``fp8``: blockwise FP8 GEMMs (D and I
    multiples of 128)."""
    topk_idx = topk_idx.contiguous()
    if not (torch.compiler.is_compiling() or custom_ops_forced()):
        return _FusedMoE.apply(x, topk_idx, topk_weights, w13, w2, save_preact, fp8, LOW_PEAK_BACKWARD)
    plan = plan_op(topk_idx, w13.shape[0])
    if save_preact:
        return _experts_fwd_saved(x, topk_idx, topk_weights, w13, w2, *plan, fp8, LOW_PEAK_BACKWARD)[0]
    return _experts_fwd(x, topk_idx, topk_weights, w13, w2, *plan, fp8, LOW_PEAK_BACKWARD)
