"""The fused expert-parallel layer for real ranks (one GPU each): the protocol's phases (protocol.py,
senders.py, owner.py) in order on this rank's stream, over a symmetric-memory workspace, wired into autograd. Saved
for the backward: the inputs and the routing plan, and in the saved mode (``save_preact``) the gate/up products of
the rows each owner received (:func:`preact_buffer`); the backward sends x and dy rows again and, keeping nothing,
recomputes those products on the owners.

Two wirings of the same bodies (:func:`ep_forward`, :func:`ep_backward`), as on one GPU (``megamoe.autograd``):
eagerly an ``autograd.Function``; under torch.compile, or inside a ``megamoe.checkpoint_context`` region, the
``torch.library`` custom ops ``megamoe::ep_fwd`` and ``megamoe::ep_fwd_saved`` (their backward ``megamoe::ep_bwd``)
over the routing plan's op (``megamoe::plan``, ``kernels/plan.py``), which the compiler sees as opaque and whose
outputs the checkpoint policy saves (the plan it recomputes), so that under full activation checkpointing the
layer's forward, its exchange included, runs once per step. A custom op cannot take the workspace object: the ops
take its number (``Workspace.number``, ``workspace.by_number``).

What ``megamoe.moe(group=...)`` runs wherever it can (CUDA tensors, sm90+, 16-byte rows; see
:func:`megamoe.api.ep_path`); ``MEGAMOE_EP=all_to_all`` selects the all-to-all baseline instead.

In blockwise FP8 (``fp8``) each rank quantises x once and sends its rows in e4m3 with their 1x128 scales
(``senders.dispatch_rows_fp8``), the owners run the one-GPU FP8 kernels once every row is in
(``owner.owner_experts_fp8``, ``owner.owner_experts_backward_fp8``) and the rows come back in x's dtype; the
rows are sent by a dispatch kernel of their own (``comm_sms`` 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from megamoe.env import custom_ops_forced, debug_checks_enabled, sm_count, warn_once
from megamoe.kernels.plan import Plan, build_plan, plan_op
from megamoe.parallel.owner import (
    owner_experts,
    owner_experts_backward,
    owner_experts_backward_fp8,
    owner_experts_fp8,
)
from megamoe.parallel.protocol import (
    combine_returned,
    combine_returned_backward,
    exchange_counts,
    first_non_finite,
)
from megamoe.parallel.senders import (
    check_fp8_comm_sms,
    dispatch_rows,
    dispatch_rows_fp8,
)
from megamoe.parallel.workspace import Workspace, by_number, symmetric_workspace

# Programs of the expert kernels' launches that send the rows (``comm_sms``). Measured on two H200s
# (benchmarks/results/*-per-rank-*-ep2.json, docs/PERFORMANCE.md): against 0 (a dispatch kernel of its own) 32
# shortens forward+backward by 4-9% on the 30B and 235B layers, random and skewed routing; 16 is slower than 0.
# On one GPU (loopback, R=1) 32 and 0 tie.
DEFAULT_COMM_SMS = 32

_WORKSPACES: dict[tuple, Workspace] = {}
_AGREED_MAX_TOKENS: dict[tuple, int] = {}


def comm_sms_ok(comm_sms) -> bool:
    """Whether ``comm_sms`` is valid: an int >= 0 (not a bool), or a pair (forward, backward) of them."""
    def count(n):
        return isinstance(n, int) and not isinstance(n, bool) and n >= 0

    return count(comm_sms) or (isinstance(comm_sms, tuple) and len(comm_sms) == 2 and all(map(count, comm_sms)))


def comm_sms_pair(comm_sms: int | tuple[int, int]) -> tuple[int, int]:
    """``comm_sms`` (already checked) as its (forward, backward) counts: an int serves both directions."""
    return (comm_sms, comm_sms) if isinstance(comm_sms, int) else tuple(comm_sms)


def default_comm_sms(device_index: int) -> int:
    """``comm_sms`` when the caller passes ``None``: :data:`DEFAULT_COMM_SMS`, or 0 (the rows sent by a kernel
    of their own) on a GPU with no more than twice as many SMs (a MIG slice, say), where that many senders
    would leave the GEMMs too few SMs. Not measured on such GPUs."""
    return DEFAULT_COMM_SMS if sm_count(device_index) > 2 * DEFAULT_COMM_SMS else 0


@torch._dynamo.assume_constant_result
def _workspace_number(group_name: str, num_local: int, max_tokens_per_rank: int, top_k: int, dim: int,
                      dtype: torch.dtype) -> int:
    """:func:`workspace_for`'s workspace number, the group by name. Under torch.compile the compiler calls it while
    tracing and keeps the number as a constant of the graph: the first call's allocation (symmetric memory, a
    collective) is not traceable. Every rank traces the same layer at the same point of its first step, so the
    collective still pairs up across ranks. By name: the compiler hands a traced function a stand-in for a process
    group, which cannot communicate."""
    group = _resolve_process_group(group_name)
    return workspace_for(group, num_local, max_tokens_per_rank, top_k, dim, dtype).number


@torch._dynamo.assume_constant_result
def _agreed_so_far(group_name: str, num_local: int, top_k: int, dim: int, dtype: torch.dtype) -> int:
    """The token capacity the ranks agreed on at the first call with these sizes, or 0 before it (a constant of a
    compiled graph: a guard on the dictionary would fail on the trace that fills it)."""
    return _AGREED_MAX_TOKENS.get((group_name, num_local, top_k, dim, dtype), 0)


@torch._dynamo.assume_constant_result
def _agreed_max_tokens(group_name: str, num_local: int, top_k: int, dim: int, dtype: torch.dtype, num_tokens: int,
                       device: torch.device) -> int:
    """The largest token count of any rank of the group at the first call with these sizes (one all-reduce on
    ``device`` and a host sync), kept in ``_AGREED_MAX_TOKENS`` for every later call; under torch.compile called
    while tracing, as :func:`_workspace_number`."""
    largest = torch.tensor([num_tokens], device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=_resolve_process_group(group_name))
    agreed = _AGREED_MAX_TOKENS[(group_name, num_local, top_k, dim, dtype)] = int(largest.item())
    return agreed


def workspace_for(group, num_local: int, max_tokens_per_rank: int, top_k: int, dim: int,
                  dtype: torch.dtype) -> Workspace:
    """The workspace for these sizes, allocated on first use (a collective) and reused by every layer
    and step with the same sizes. Receive capacity: every rank's rows could go to one owner, so
    ``R * max_tokens_per_rank * K`` rows; no call can overflow it."""
    num_ranks = dist.get_world_size(group)
    key = (group.group_name, num_local, max_tokens_per_rank, top_k, dim, dtype)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = symmetric_workspace(group, num_local, num_ranks * max_tokens_per_rank * top_k,
                                               max_tokens_per_rank, max_tokens_per_rank * top_k, dim, dtype)
    return _WORKSPACES[key]


def ep_forward(ws: Workspace, x, topk_idx, topk_weights, w13, w2, plan: Plan, comm_sms: int,
               preact: torch.Tensor | None = None, fp8: bool = False) -> torch.Tensor:
    """The fused layer's forward on this rank: counts, rows out (from ``comm_sms`` programs of the up kernel's
    launch, or with 0 a dispatch kernel of their own), this rank's experts on the rows it received, rows back, the
    combine; y (T, D). ``plan``: of ``topk_idx`` over all R * L experts. ``preact`` (capacity, 2I): also the gate
    and up products of the rows this rank received (the saved-activation mode, :func:`preact_buffer`). ``fp8``:
    blockwise FP8 (the module docstring), ``comm_sms`` 0."""
    check_fp8_comm_sms(fp8, comm_sms)
    ws.check_overflow()
    ws.check_error(now=debug_checks_enabled())
    exchange_counts(ws, plan)
    if fp8:
        dispatch_rows_fp8(ws, x, topk_idx, topk_weights, plan)
        owner_experts_fp8(ws, w13, w2, preact_C2I=preact)
    elif comm_sms:
        owner_experts(ws, w13, w2, send=(x, topk_idx, topk_weights, plan, comm_sms), preact_C2I=preact)
    else:
        dispatch_rows(ws, x, topk_idx, topk_weights, plan)
        owner_experts(ws, w13, w2, preact_C2I=preact)
    y = combine_returned(ws, topk_idx, x.dtype)
    _end_of_call(ws, topk_idx)
    return y


def ep_backward(ws: Workspace, dy, x, topk_idx, topk_weights, w13, w2, plan: Plan, comm_sms: int,
                preact: torch.Tensor | None = None, reuse_preact: bool = False, fp8: bool = False,
                fp8_wgrad: bool = True) -> tuple:
    """The fused layer's backward on this rank for the output gradient ``dy`` (contiguous): x and dy rows out
    again, the owners' recompute (or, given the forward's ``preact``, none) and gradients, dx rows and
    routing-weight gradients back; (dx, d topk_weights in their dtype, dw13, dw2). ``reuse_preact``: dz is written
    over ``preact`` (the caller will not read it again). ``fp8``: the backward of ``ep_forward(fp8=True)``, the x and
    dy rows sent in x's dtype (the FP8 weight gradients quantise them 128x1 from their values) and, without
    ``preact``, each token's FP8 row once per owner for the recompute; ``fp8_wgrad``: FP8 weight gradients (else
    bf16 ones from the unquantised rows); ``comm_sms`` 0."""
    check_fp8_comm_sms(fp8, comm_sms)
    ws.check_error(now=debug_checks_enabled())
    exchange_counts(ws, plan)
    if fp8:  # without saved products, each token's FP8 row too, once per owner, for the owners' recompute
        dispatch_rows_fp8(ws, x, topk_idx, topk_weights, plan, dy_TD=dy, token_rows=preact is None,
                          fp8_wgrad=fp8_wgrad)
        dw13, dw2 = owner_experts_backward_fp8(ws, w13, w2, fp8_wgrad, preact_C2I=preact, reuse_preact=reuse_preact)
    elif comm_sms:
        dw13, dw2 = owner_experts_backward(ws, w13, w2, send=(x, dy, topk_weights, plan, comm_sms), preact_C2I=preact,
                                           reuse_preact=reuse_preact)
    else:
        dispatch_rows(ws, x, topk_idx, topk_weights, plan, dy_TD=dy)
        dw13, dw2 = owner_experts_backward(ws, w13, w2, preact_C2I=preact, reuse_preact=reuse_preact)
    dx, dweight = combine_returned_backward(ws, topk_idx, x.dtype)
    _end_of_call(ws)
    return dx, dweight.to(topk_weights.dtype), dw13, dw2


def _end_of_call(ws: Workspace, topk_idx=None) -> None:
    """After a call's work: the error record's copy for the next call's check; in the debug mode the overflow and
    error checks now, and (given the forward's ``topk_idx``) a warning naming the first non-finite output row."""
    ws.snapshot_error()
    if debug_checks_enabled():
        ws.check_overflow(now=True)
        ws.check_error(now=True)
        if topk_idx is not None and (message := first_non_finite(ws, topk_idx)):
            warn_once(message)


def preact_buffer(ws: Workspace, w13: torch.Tensor) -> torch.Tensor:
    """The saved-activation mode's buffer of one layer on this rank: the gate and up products of every row it may
    receive, (capacity, 2I) in w13's dtype. The rows one rank receives are known only on the device, so it is sized
    for the most (every rank's rows to this one: R times what the one-GPU layer keeps, on average)."""
    return w13.new_empty(ws.capacity, w13.shape[1])


class FusedEP(torch.autograd.Function):
    """The eager wiring."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w13, w2, ws: Workspace, comm_sms: tuple[int, int], save_preact: bool,
                fp8: bool, fp8_wgrad: bool):
        plan = build_plan(topk_idx, ws.num_ranks * ws.num_local)
        preact = preact_buffer(ws, w13) if save_preact else None
        y = ep_forward(ws, x, topk_idx, topk_weights, w13, w2, plan, comm_sms[0], preact, fp8=fp8)
        ctx.save_for_backward(x, topk_idx, topk_weights, w13, w2, *plan.tensors(), *(() if preact is None else (preact,)))
        ctx.ws, ctx.comm_sms, ctx.save_preact, ctx.fp8, ctx.fp8_wgrad = ws, comm_sms[1], save_preact, fp8, fp8_wgrad
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_idx, topk_weights, w13, w2, *rest = ctx.saved_tensors
        plan_tensors, preact = (rest[:-1], rest[-1]) if ctx.save_preact else (rest, None)
        if preact is not None:  # dz takes the saved products' memory, as on one GPU (megamoe.autograd._FusedMoE)
            torch.autograd.graph.increment_version(preact)
        dx, dweight, dw13, dw2 = ep_backward(ctx.ws, dy.contiguous(), x, topk_idx, topk_weights, w13, w2,
                                             Plan(*plan_tensors), ctx.comm_sms, preact, reuse_preact=preact is not None,
                                             fp8=ctx.fp8, fp8_wgrad=ctx.fp8_wgrad)
        return dx, None, dweight, dw13, dw2, None, None, None, None, None


# ``fp8``: blockwise FP8 (``fp8_wgrad``: its weight gradients in FP8 too), carried by the forward ops to their
# autograd context; trailing arguments with defaults, so that bf16 callers name them nowhere.
@torch.library.custom_op("megamoe::ep_fwd", mutates_args=())
def _ep_fwd(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            offsets: torch.Tensor, row_slot: torch.Tensor, tile_expert: torch.Tensor, tile_row: torch.Tensor,
            workspace: int, comm_sms_fwd: int, comm_sms_bwd: int, fp8: bool = False,
            fp8_wgrad: bool = True) -> torch.Tensor:
    return ep_forward(by_number(workspace), x, topk_idx, topk_weights, w13, w2,
                      Plan(offsets, row_slot, tile_expert, tile_row), comm_sms_fwd, fp8=fp8)


@_ep_fwd.register_fake
def _(x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row, workspace, comm_sms_fwd,
      comm_sms_bwd, fp8=False, fp8_wgrad=True):
    return torch.empty_like(x)


@torch.library.custom_op("megamoe::ep_fwd_saved", mutates_args=())
def _ep_fwd_saved(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, offsets: torch.Tensor, row_slot: torch.Tensor, tile_expert: torch.Tensor,
                  tile_row: torch.Tensor, workspace: int, comm_sms_fwd: int, comm_sms_bwd: int, fp8: bool = False,
                  fp8_wgrad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    ws = by_number(workspace)
    preact = preact_buffer(ws, w13)
    return ep_forward(ws, x, topk_idx, topk_weights, w13, w2, Plan(offsets, row_slot, tile_expert, tile_row),
                      comm_sms_fwd, preact, fp8=fp8), preact


@_ep_fwd_saved.register_fake
def _(x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row, workspace, comm_sms_fwd,
      comm_sms_bwd, fp8=False, fp8_wgrad=True):
    return torch.empty_like(x), preact_buffer(by_number(workspace), w13)


@torch.library.custom_op("megamoe::ep_bwd", mutates_args=())
def _ep_bwd(dy: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, offsets: torch.Tensor, row_slot: torch.Tensor, tile_expert: torch.Tensor,
            tile_row: torch.Tensor, workspace: int, comm_sms: int, preact: torch.Tensor | None = None,
            fp8: bool = False, fp8_wgrad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return ep_backward(by_number(workspace), dy, x, topk_idx, topk_weights, w13, w2,
                       Plan(offsets, row_slot, tile_expert, tile_row), comm_sms, preact, fp8=fp8, fp8_wgrad=fp8_wgrad)


@_ep_bwd.register_fake
def _(dy, x, topk_idx, topk_weights, w13, w2, offsets, row_slot, tile_expert, tile_row, workspace, comm_sms,
      preact=None, fp8=False, fp8_wgrad=True):
    return torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w13), torch.empty_like(w2)


_NO_GRADS = (None,) * 9  # the plan's four tensors, the workspace, the two comm_sms, fp8 and fp8_wgrad


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9])
    ctx.workspace, ctx.comm_sms, ctx.fp8, ctx.fp8_wgrad = inputs[9], inputs[11], *inputs[12:14]


def _backward(ctx, dy):
    x, topk_idx, topk_weights, w13, w2, *plan = ctx.saved_tensors
    dx, dweight, dw13, dw2 = _ep_bwd(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, *plan, ctx.workspace,
                                     ctx.comm_sms, None, ctx.fp8, ctx.fp8_wgrad)
    return dx, None, dweight, dw13, dw2, *_NO_GRADS


def _setup_context_saved(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9], output[1])
    ctx.workspace, ctx.comm_sms, ctx.fp8, ctx.fp8_wgrad = inputs[9], inputs[11], *inputs[12:14]
    ctx.mark_non_differentiable(output[1])


def _backward_saved(ctx, dy, _):
    x, topk_idx, topk_weights, w13, w2, *plan, preact = ctx.saved_tensors
    dx, dweight, dw13, dw2 = _ep_bwd(dy.contiguous(), x, topk_idx, topk_weights, w13, w2, *plan, ctx.workspace,
                                     ctx.comm_sms, preact, ctx.fp8, ctx.fp8_wgrad)
    return dx, None, dweight, dw13, dw2, *_NO_GRADS


_ep_fwd.register_autograd(_backward, setup_context=_setup_context)
_ep_fwd_saved.register_autograd(_backward_saved, setup_context=_setup_context_saved)


def fused_ep(x, topk_idx, topk_weights, w13, w2, ws: Workspace, comm_sms: tuple[int, int],
             save_preact: bool = False, fp8: bool = False, fp8_wgrad: bool = True) -> torch.Tensor:
    """The fused layer over workspace ``ws`` (its checks done): eagerly through :class:`FusedEP`, under torch.compile
    or a checkpoint policy through the custom ops (see the module docstring). ``comm_sms``: (forward, backward).
    ``save_preact``: keep the gate and up products of the rows this rank receives (:func:`preact_buffer`) for the
    backward, instead of recomputing them there. ``fp8``: blockwise FP8 (``comm_sms`` (0, 0)), its weight gradients
    in FP8 if ``fp8_wgrad``, else in bf16 from the unquantised rows."""
    return _fused_ep_by_number(x, topk_idx, topk_weights, w13, w2, ws.number, ws.num_ranks * ws.num_local, comm_sms,
                               save_preact, fp8, fp8_wgrad)


def _fused_ep_by_number(x, topk_idx, topk_weights, w13, w2, number: int, num_experts: int,
                        comm_sms: tuple[int, int], save_preact: bool, fp8: bool, fp8_wgrad: bool) -> torch.Tensor:
    """:func:`fused_ep` over the workspace numbered ``number`` (``Workspace.number``), of ``num_experts`` experts
    over all ranks: what a compiled region can trace (the object itself is looked up only in the eager wiring)."""
    topk_idx, topk_weights = topk_idx.contiguous(), topk_weights.contiguous()
    if not (torch.compiler.is_compiling() or custom_ops_forced()):
        return FusedEP.apply(x, topk_idx, topk_weights, w13, w2, by_number(number), comm_sms, save_preact, fp8,
                             fp8_wgrad)
    plan = plan_op(topk_idx, num_experts)
    if save_preact:
        return _ep_fwd_saved(x, topk_idx, topk_weights, w13, w2, *plan, number, *comm_sms, fp8, fp8_wgrad)[0]
    return _ep_fwd(x, topk_idx, topk_weights, w13, w2, *plan, number, *comm_sms, fp8, fp8_wgrad)


def reset_workspaces(group) -> None:
    """After an expert-parallel wait gave up (the ``RuntimeError`` of ``Workspace.check_error``): every workspace of
    ``group`` back to its first call's state. A collective: call it on every rank of the group (the ranks that
    raised and the others alike), before the next step."""
    workspaces = [ws for key, ws in _WORKSPACES.items() if key[0] == group.group_name]
    for ws in workspaces:
        ws.reset()
    if any(ws.control.is_cuda for ws in workspaces):
        torch.cuda.synchronize()
    dist.barrier(group)


def moe_fused_ep(x, topk_idx, topk_weights, w13, w2, group, max_tokens_per_rank: int | None = None,
                 comm_sms: int | tuple[int, int] | None = 0, save_preact: bool = False, fp8: bool = False,
                 fp8_wgrad: bool = True):
    """The MoE layer over the experts of ``group`` with the fused protocol (arguments as for
    :func:`megamoe.parallel.all_to_all.moe_all_to_all`). ``max_tokens_per_rank`` sizes the workspace
    and must be the same on every rank; ``None`` agrees on the largest T of any rank at the first call
    (one collective and host sync, then never again for these sizes). ``comm_sms``: 0 sends the rows
    in a kernel of their own before the expert kernels; N > 0 sends them from N programs of the up
    (forward) and dh' (backward) kernels' launches, overlapping their GEMMs; a pair (forward,
    backward) sets the two directions apart; ``None``: :func:`default_comm_sms` (see :func:`megamoe.moe`).
    ``save_preact``: the saved-activation mode (:func:`fused_ep`). ``fp8``, ``fp8_wgrad``: blockwise FP8
    (:func:`fused_ep`); ``comm_sms`` must then be 0, and ``None`` means 0."""
    # Under torch.compile the set-up below reads these sizes through constant functions, which dynamo refuses a
    # dynamic size ("assume_constant_result argument conversion failed" in torch 2.13, "SymNodeVariable() is not a
    # constant" in 2.11): the layer's sizes must be static
    # (compile without dynamic=True), and so must the first call's token count unless max_tokens_per_rank is
    # given. No check of our own: none found tells a traced SymInt from an int under both torch 2.13 (isinstance and
    # type() read a SymInt as int) and 2.11 (a static size's __class__ reads as neither int nor SymInt).
    if comm_sms is None:
        comm_sms = 0 if fp8 else default_comm_sms(x.device.index)
    comm_sms = comm_sms_pair(comm_sms)
    check_fp8_comm_sms(fp8, max(comm_sms))
    if max(comm_sms) and max(comm_sms) >= (num_sms := sm_count(x.device.index)):
        raise ValueError(f"comm_sms={max(comm_sms)} leaves none of this GPU's {num_sms} SMs to the expert GEMMs")
    num_tokens, top_k = topk_idx.shape
    num_local, dim = w13.shape[0], x.shape[1]
    if max_tokens_per_rank is None:
        key = (group.group_name, num_local, top_k, dim, x.dtype)
        max_tokens_per_rank = _agreed_so_far(*key)
        if not max_tokens_per_rank:  # the first call agrees on its token count
            max_tokens_per_rank = _agreed_max_tokens(*key, num_tokens, x.device)
    if num_tokens > max_tokens_per_rank:
        raise ValueError(f"{num_tokens} tokens on this rank exceed max_tokens_per_rank={max_tokens_per_rank} "
                         "(pass a larger max_tokens_per_rank to megamoe.moe / MegaMoE)")
    number = _workspace_number(group.group_name, num_local, max_tokens_per_rank, top_k, dim, x.dtype)
    return _fused_ep_by_number(x, topk_idx, topk_weights, w13, w2, number, dist.get_world_size(group) * num_local,
                               comm_sms, save_preact, fp8, fp8_wgrad)
