"""The fused expert-parallel protocol as a harness: R virtual ranks on one device (their workspaces from
``workspace.loopback_workspaces``), run phase by phase so that every wait's producer has already run — the
protocol's tests and the EP machinery's one-GPU benchmark — and the forward's communication alone, rows out
and back with no experts (:func:`round_trip`, the communication-only half of the EP benchmark's overlap figure).

Problems are ``(x, topk_idx, topk_weights, w13, w2)`` per rank, with global expert ids and that rank's experts.
"""

from __future__ import annotations

import torch

from megamoe.kernels.plan import Plan, build_plan
from megamoe.parallel.owner import (
    owner_experts,
    owner_experts_backward,
    owner_experts_backward_fp8,
    owner_experts_fp8,
    rows_to_sources,
    send_and_dh,
    send_and_up,
)
from megamoe.parallel.protocol import (
    combine_returned,
    combine_returned_backward,
    exchange_counts,
    received_plan,
    reset_arrivals,
    wait_returned,
)
from megamoe.parallel.senders import (
    check_fp8_comm_sms,
    dispatch_rows,
    dispatch_rows_fp8,
)
from megamoe.parallel.workspace import Workspace


def return_rows(ws: Workspace) -> None:
    """Phases 3 and 4 with no experts: wait for my rows, then send each back, unchanged, into its source's
    ``y_slots`` and signal."""
    plan, counts = received_plan(ws)
    reset_arrivals(ws, counts)  # returns once every row is in
    rows_to_sources(ws, plan, ws.recv_tokens, row_map=ws.recv_token_row)


def round_trip(ws: Workspace, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
               plan: Plan) -> torch.Tensor:
    """The forward's communication alone, on one rank: counts, my rows out, every owner's rows back
    (:func:`return_rows`), my wait for them; returns ``y_slots`` (N, D): slot t*K + k holds x[t] again.
    Timed against the fused forward (the overlap figure); on a real group every rank must call it."""
    exchange_counts(ws, plan)
    dispatch_rows(ws, x_TD, topk_idx_TK, topk_weights_TK, plan)
    return_rows(ws)
    wait_returned(ws)
    return ws.y_slots[: topk_idx_TK.numel()]


def _start(workspaces: list[Workspace], problems: list[tuple]) -> list[Plan]:
    """Plans and phase 1 of a loopback call."""
    num_experts = workspaces[0].num_ranks * workspaces[0].num_local
    for ws, (_, topk_idx, *_rest) in zip(workspaces, problems):
        if topk_idx.numel() > ws.max_slots:
            raise ValueError(f"rank {ws.rank}: {topk_idx.numel()} slots exceed the workspace's {ws.max_slots}")
    plans = [build_plan(p[1], num_experts) for p in problems]
    for ws, plan in zip(workspaces, plans):
        exchange_counts(ws, plan)
    return plans


def loopback_forward(workspaces: list[Workspace], problems: list[tuple], comm_sms: int = 0,
                     preacts: list[torch.Tensor] | None = None, fp8: bool = False) -> list[torch.Tensor]:
    """The forward of R virtual ranks on one device. Each phase runs for every rank before the next,
    so every wait's producer has already run (one device executes the launches in order).
    ``comm_sms > 0``: the rows are sent by ``comm_sms`` programs of the up kernel's launch (``owner.send_and_up``)
    — with one virtual rank in the same launch as its GEMM tiles; with more, each rank's senders run in a
    launch of their own first (a rank's tiles would otherwise wait for rows that a later launch sends).
    ``preacts``: per rank a (capacity, 2I) buffer for its received rows' gate and up products (the saved-activation
    mode; :func:`loopback_backward` takes them back). ``fp8``: blockwise FP8, the rows sent in e4m3 with their
    scales (each rank's x quantised once) and the owners' FP8 kernels run once every row is in
    (``owner.owner_experts_fp8``); with a dispatch kernel of their own only (``comm_sms`` 0)."""
    check_fp8_comm_sms(fp8, comm_sms)
    plans = _start(workspaces, problems)
    preacts = preacts or [None] * len(workspaces)
    if fp8:
        for ws, plan, (x, idx, weights, _, _) in zip(workspaces, plans, problems):
            dispatch_rows_fp8(ws, x, idx, weights, plan)
        for ws, p, preact in zip(workspaces, problems, preacts):
            owner_experts_fp8(ws, p[3], p[4], preact_C2I=preact)
    elif comm_sms and len(workspaces) == 1:
        (ws,), (plan,), ((x, idx, weights, w13, w2),) = workspaces, plans, problems
        owner_experts(ws, w13, w2, send=(x, idx, weights, plan, comm_sms), preact_C2I=preacts[0])
    elif comm_sms:
        for ws, plan, (x, idx, weights, w13, _) in zip(workspaces, plans, problems):
            send_and_up(ws, w13, *received_plan(ws), send=(x, idx, weights, plan, comm_sms), compute=False)
        for ws, p, preact in zip(workspaces, problems, preacts):
            owner_experts(ws, p[3], p[4], preact_C2I=preact)
    else:
        for ws, plan, (x, idx, weights, _, _) in zip(workspaces, plans, problems):
            dispatch_rows(ws, x, idx, weights, plan)
        for ws, p, preact in zip(workspaces, problems, preacts):
            owner_experts(ws, p[3], p[4], preact_C2I=preact)
    return [combine_returned(ws, p[1], p[0].dtype) for ws, p in zip(workspaces, problems)]


def loopback_round_trip(workspaces: list[Workspace], problems: list[tuple]) -> list[torch.Tensor]:
    """:func:`round_trip` for R virtual ranks on one device, phase by phase; per rank its ``y_slots``."""
    plans = _start(workspaces, problems)
    for ws, plan, (x, idx, weights, _, _) in zip(workspaces, plans, problems):
        dispatch_rows(ws, x, idx, weights, plan)
    for ws in workspaces:
        return_rows(ws)
    for ws in workspaces:
        wait_returned(ws)
    return [ws.y_slots[: p[1].numel()] for ws, p in zip(workspaces, problems)]


def loopback_backward(workspaces: list[Workspace], problems: list[tuple], dys: list[torch.Tensor],
                      comm_sms: int = 0, preacts: list[torch.Tensor] | None = None, fp8: bool = False,
                      fp8_wgrad: bool = True) -> list[tuple]:
    """The backward of :func:`loopback_forward` for output gradients ``dys``: per rank (dx, d topk_weights
    (fp32), dw13, dw2). Nothing from the forward is used: x and dy rows travel again (the workspace is
    shared by every layer, so the forward's received rows are gone by then). ``comm_sms``: as for
    :func:`loopback_forward`; ``preacts``: the gate and up products :func:`loopback_forward` saved, per rank, for
    the act step instead of its GEMM, which writes dz over them (as the eager layer's backward does). ``fp8``: the
    backward of ``loopback_forward(fp8=True)``, x and dy rows sent in x's dtype (without ``preacts`` also each token's
    FP8 row once per owner, for the recompute) and the owners' FP8 backward run once every row is in
    (``owner.owner_experts_backward_fp8``; ``fp8_wgrad``: FP8 weight gradients); ``comm_sms`` 0."""
    check_fp8_comm_sms(fp8, comm_sms)
    plans = _start(workspaces, problems)
    preacts = preacts or [None] * len(workspaces)
    if fp8:  # without saved products, each token's FP8 row too, once per owner, for the owners' recompute
        for ws, plan, (x, idx, weights, _, _), dy, preact in zip(workspaces, plans, problems, dys, preacts):
            dispatch_rows_fp8(ws, x, idx, weights, plan, dy_TD=dy, token_rows=preact is None,
                              fp8_wgrad=fp8_wgrad)
        weight_grads = [owner_experts_backward_fp8(ws, p[3], p[4], fp8_wgrad, preact_C2I=preact, reuse_preact=True)
                        for ws, p, preact in zip(workspaces, problems, preacts)]
    elif comm_sms and len(workspaces) == 1:
        (ws,), (plan,), ((x, _, weights, w13, w2),), (dy,) = workspaces, plans, problems, dys
        weight_grads = [owner_experts_backward(ws, w13, w2, send=(x, dy, weights, plan, comm_sms),
                                               preact_C2I=preacts[0], reuse_preact=True)]
    elif comm_sms:
        for ws, plan, (x, _, weights, w13, w2), dy in zip(workspaces, plans, problems, dys):
            send_and_dh(ws, w2, *received_plan(ws), send=(x, dy, weights, plan, comm_sms), compute=False)
        weight_grads = [owner_experts_backward(ws, p[3], p[4], preact_C2I=preact, reuse_preact=True)
                        for ws, p, preact in zip(workspaces, problems, preacts)]
    else:
        for ws, plan, (x, idx, weights, _, _), dy in zip(workspaces, plans, problems, dys):
            dispatch_rows(ws, x, idx, weights, plan, dy_TD=dy)
        weight_grads = [owner_experts_backward(ws, p[3], p[4], preact_C2I=preact, reuse_preact=True)
                        for ws, p, preact in zip(workspaces, problems, preacts)]
    results = []
    for ws, (x, topk_idx, _, _, _), (dw13, dw2) in zip(workspaces, problems, weight_grads):
        results.append((*combine_returned_backward(ws, topk_idx, x.dtype), dw13, dw2))
    return results
