"""The blockwise FP8 backward over a routing plan's rows: below the autograd wiring, so that the one-GPU layer
(``megamoe.autograd.experts_backward_fp8``, which combines dx per token) and an expert-parallel owner
(``parallel.owner.owner_experts_backward_fp8``, which sends dx's rows back to their sources) run the same steps."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from megamoe.env import FP8_WGRAD_X_SCALES
from megamoe.kernels.expert_bwd import (
    act_bwd_from_preact,
    act_bwd_tile_cols,
    dh_fp8,
    dh_fp8_from_rows,
    dx_slots_fp8,
    expert_wgrad,
    expert_wgrad_and_combine,
    gather_rows,
    wgrad_fp8,
)
from megamoe.kernels.expert_fwd import up_products_fp8
from megamoe.kernels.plan import Plan
from megamoe.kernels.quant import (
    fp8_weight,
    quantize_rows,
    quantize_tile_cols,
    x_scales_amax,
)


def preact_buffer(x: Tensor, num_rows: int, w13: Tensor) -> Tensor:
    """The saved-activation mode's (num_rows, 2I) buffer of gate and up products, in x's dtype (rows past the routed
    count are never written or read)."""
    return x.new_empty(num_rows, w13.shape[1])


def backward_rows_fp8(dy: Tensor, x: Tensor, weights_TK: Tensor, w13: Tensor, w2: Tensor, plan: Plan, top_k: int,
                      dx_rows: Callable[[Tensor, Tensor], object], *, fp8_wgrad: bool, x_scales: str = "tile",
                      preact: Tensor | None = None,
                      reuse_preact: bool = False, combine_in_dw13: Tensor | None = None,
                      recompute_from: tuple | None = None, dx_dest: tuple[Tensor, Tensor] | None = None,
                      rows_from: tuple[Plan, int] | None = None) -> tuple[object, Tensor, Tensor, Tensor]:
    """dy quantised 1x128 (once per row: in the pass that sorts it, or with ``fp8_wgrad`` per token row, dh' reading it
    through the row map, ``expert_bwd.dh_fp8_from_rows``); dh' and dx on the weights' transposed FP8 copies; g and
    u, unless saved (``preact``), recomputed by the forward's up kernel (the FP8 GEMM the forward ran, so both
    memory modes compute the same gradients; without its h output) and the act step run on them; the weight
    gradients from the unquantised rows in x's dtype (exact products, fp32 accumulation), or with ``fp8_wgrad`` from
    those rows quantised 128x1: x's and dy's read from their rows (no sorted copies), dz's and h·w's by the act step
    (``expert_bwd.act_bwd_tile_cols``: on sm90 neither is written in x's dtype), and dx before dW13, x's tile
    columns made just before it (over handed-over products); ``x_scales`` (``autograd.FP8_WGRAD_X_SCALES``): x's
    scales in them, "tile" (the recipe's 128x1 groups), "layer" (one per channel over ``x``'s rows, which dW13 then
    applies to its sums) or "expert" (one per channel over each expert's rows, likewise).

    ``dy``, ``x``: rows in x's dtype, each sorted row read from row ``row_slot[r] // top_k`` (the tokens' rows, or
    with ``top_k`` 1 and the identity row map rows already sorted: an owner's received rows); ``weights_TK``: the
    routing weights, ``row_slot``'s flat slots, contiguous. ``dx_rows(dx's unweighted slot rows (N, D) in x's dtype,
    d(routing weight) (T, K) fp32)``: what becomes of dx (a combine per token, rows sent back), called once those
    rows exist; its result is returned. ``reuse_preact``: the caller hands ``preact`` over (it is written over).
    ``combine_in_dw13``: with bf16 weight gradients, the routing (T, K) whose dx the dW13 kernel sums beside its MMAs
    from slot rows made before it (the dx-first order); ``dx_rows`` is then not called and dx is returned.
    ``recompute_from``: the recompute's input, (x in e4m3, its (D/128, rows) scales, a plan over those rows, its
    top_k), instead of ``x`` quantised here (an owner's received token rows, each quantised once on its source).
    ``dx_dest`` = (base, row_dest): dx's slot rows written where ``expert_fwd.sorted_rows_gemm``'s ``dest`` says (an
    owner's rows straight into their sources' slots; ``dx_rows`` is then given ``base``). ``rows_from`` (with
    ``fp8_wgrad``): (a plan over the rows of ``x`` and ``dy``, its top_k) to read them through instead, the same
    tiles as ``plan`` but sorted rows that may share a row (an owner's token rows, each received once per token).
    Returns (dx_rows' result, d(routing weight) (T, K) fp32, dw13, dw2)."""
    if x_scales not in FP8_WGRAD_X_SCALES:
        raise ValueError(f"x_scales must be one of {FP8_WGRAD_X_SCALES}, got {x_scales!r}")
    w13q, w13s, w13tq, w13ts = fp8_weight(w13, straight=preact is None)  # the recompute's operand
    _, _, w2tq, w2ts = fp8_weight(w2, straight=False)
    assert rows_from is None or fp8_wgrad, "rows_from: the FP8 weight gradients' reads only"
    read_plan, read_top_k = rows_from or (plan, top_k)
    if fp8_wgrad:  # the weight gradients read x and dy from their rows: no sorted bf16 copies
        dy_t = quantize_tile_cols(dy, read_plan, read_top_k)
        dh_NI = dh_fp8_from_rows(dy, w2tq, w2ts, plan, read_plan, read_top_k, x.dtype, gather=rows_from is not None)
    else:
        x_sorted, dy_sorted, dyq, dys = gather_rows(x, dy, plan, top_k, quantize_dy=True)
        dh_NI = dh_fp8(dyq, dys, w2tq, w2ts, plan, x.dtype)
        del dyq, dys
    # Saved products handed over (the eager saved mode): with FP8 weight gradients x's tile columns take their memory
    # once the act step has read them (the products outlive the backward in the autograd context, so that this
    # block is off the peak; recomputed ones are freed after the act step instead).
    products_over = preact if reuse_preact else None
    if preact is None:  # recomputed into a buffer of its own (which dz then takes over, where it is written)
        preact = preact_buffer(x, plan.row_slot_N.numel(), w13)
        xq, xs, up_plan, up_top_k = recompute_from or (*quantize_rows(x), read_plan, read_top_k)
        up_products_fp8(xq, xs, w13q, w13s, up_plan, up_top_k, preact)
        del xq, xs
        reuse_preact = True
    if fp8_wgrad:  # dz and h·w straight into their FP8 copies
        dweight_TK, dzq, dzs, dz_t, hw_t = act_bwd_tile_cols(preact, dh_NI, weights_TK, plan, top_k)
        del dh_NI, preact
        dw2 = wgrad_fp8(*dy_t, *hw_t, plan, w2.dtype)
        del dy_t, hw_t
        # dx before dW13, dz's 1x128 rows and dx's slot rows freed before dW13's output exists: the backward's
        # peak (at dW13) holds dz's and x's tile columns beside the weight gradients and dx, nothing more.
        dx_slots_ND = dx_slots_fp8(dzq, dzs, w13tq, w13ts, plan, x.dtype, dest=dx_dest)
        del dzq, dzs
        dx = dx_rows(dx_slots_ND, dweight_TK)
        del dx_slots_ND
        x_amax = x_scales_amax(x_scales, x, read_plan, read_top_k)
        x_t = quantize_tile_cols(x, read_plan, read_top_k, over=products_over, col_amax=x_amax)
        dw13 = wgrad_fp8(*dz_t, *x_t, plan, w13.dtype, b_const=x_amax is not None)
        return dx, dweight_TK, dw13, dw2
    dz_NH, hw_NI, dweight_TK, dzq, dzs = act_bwd_from_preact(preact, dh_NI, weights_TK, plan, top_k, quant_dz=True,
                                                             dz_over_preact=reuse_preact)
    del dh_NI, preact  # (saved products not handed over stay alive in the autograd context)
    # dW2 first (the backward's peak memory: docs/PERFORMANCE.md).
    dw2 = expert_wgrad(dy_sorted, hw_NI, plan, w2.dtype, gemm="dw2")
    del dy_sorted, hw_NI
    if combine_in_dw13 is None:  # dW13 before dx's slot rows exist (the low-peak order)
        dw13 = expert_wgrad(dz_NH, x_sorted, plan, w13.dtype, gemm="dw13")
        del x_sorted, dz_NH
    dx_slots_ND = dx_slots_fp8(dzq, dzs, w13tq, w13ts, plan, x.dtype, dest=dx_dest)
    del dzq, dzs
    if combine_in_dw13 is None:
        return dx_rows(dx_slots_ND, dweight_TK), dweight_TK, dw13, dw2
    dw13, dx = expert_wgrad_and_combine(dz_NH, x_sorted, plan, w13.dtype, dx_slots_ND, combine_in_dw13, x.dtype)
    return dx, dweight_TK, dw13, dw2
