"""The fused expert-parallel protocol on the loopback workspace (R virtual ranks on one device): exact
data movement on index-derived payloads, forward results against the one-device reference, repeated
calls (epochs, counter resets) and capacity overflow. On CPU in the Triton interpreter; the same tests
run on a GPU (where the kernels really spin on their flags): ``-m loopback``, a part of the GPU checks of its own."""

import functools

import pytest
import torch

from megamoe import reference
from megamoe.kernels.expert_bwd import DX
from megamoe.kernels.expert_fwd import DOWN
from megamoe.kernels.plan import build_plan
from megamoe.parallel import loopback, protocol, senders
from megamoe.parallel.owner import DOWN_PEER, DX_PEER, rows_to_peer_slots
from megamoe.parallel.workspace import loopback_workspaces
from tests.helpers import make_problem, run_with_grads

pytestmark = pytest.mark.loopback

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (name, tokens per rank, experts per rank, K, routing)
CASES = [
    ("random, uneven tokens", [9, 4, 13, 6], 2, 3, "random"),
    ("a rank with no tokens", [7, 0, 5, 8], 2, 2, "random"),
    ("everything to rank 0's experts", [6, 5, 7, 4], 2, 2, "to-rank-0"),
    ("dropped slots", [8, 8, 8, 8], 3, 2, "dropped"),
    ("experts with no rows", [5, 6, 4, 7], 3, 1, "empty"),
]
DIM, INTER = 80, 16
# Enough slots for every sending program of the senders' tests to loop over several blocks, the last one
# partial, with dropped slots among them (one rank: 660 slots, over 2 or 3 senders in blocks of 64 forward and
# of 32 backward; senders.SEND_UP_ROWS / SEND_DH_ROWS).
SENDER_CASES = CASES + [("several blocks per sender", [220, 90, 70, 60], 2, 3, "dropped")]


def split_problem(case, num_ranks, seed=0, dim=DIM, inter=INTER):
    """Per-rank problems (x, topk_idx, topk_weights, w13 local, w2 local) and the gathered problem."""
    _, sizes, per_rank, top_k, routing = case
    sizes = sizes[:num_ranks]
    num_experts = per_rank * num_ranks
    top_k = min(top_k, num_experts)  # one rank has only per_rank experts
    kind = "random" if routing == "to-rank-0" else routing
    x, idx, w, w13, w2, dy = make_problem(sum(sizes), dim, inter, num_experts, top_k, kind, device=DEVICE,
                                         seed=seed)
    if routing == "to-rank-0":
        idx = torch.stack([(idx[:, 0] + k) % per_rank for k in range(top_k)], dim=1)
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    ranks = []
    for r in range(num_ranks):
        tok = slice(bounds[r], bounds[r + 1])
        exp = slice(r * per_rank, (r + 1) * per_rank)
        ranks.append((x[tok], idx[tok], w[tok], w13[exp].contiguous(), w2[exp].contiguous()))
    dys = [dy[bounds[r]:bounds[r + 1]] for r in range(num_ranks)]
    return ranks, (x, idx, w, w13, w2, dy), bounds, dys


def workspaces_for(ranks, per_rank, capacity=None, dim=DIM):
    num_ranks = len(ranks)
    total = sum(int((p[1] >= 0).sum()) for p in ranks)
    max_slots = max(1, max(p[1].numel() for p in ranks))
    max_tokens = max(1, max(p[0].shape[0] for p in ranks))
    workspaces = loopback_workspaces(num_ranks, per_rank, capacity or max(1, total), max_tokens, max_slots, dim,
                                     torch.float32, DEVICE)
    for ws in workspaces:  # receive rows that nobody sends stay NaN: a kernel that reads one shows it
        ws.recv_tokens.fill_(float("nan"))
        ws.recv_x.fill_(float("nan"))
        ws.recv_dy.fill_(float("nan"))
    return workspaces


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dispatch_and_write_back_move_rows_exactly(case, num_ranks):
    ranks, _, _, _ = split_problem(case, num_ranks)
    per_rank = case[2]
    num_experts = per_rank * num_ranks
    # Payload: row t of rank r is filled with 1000*r + t (exact in fp32), so every received row names
    # its origin.
    ranks = [(torch.full_like(x, 0) + (1000 * r + torch.arange(x.shape[0], device=DEVICE))[:, None].float(), *rest)
             for r, (x, *rest) in enumerate(ranks)]
    workspaces = workspaces_for(ranks, per_rank)
    plans = [build_plan(p[1], num_experts) for p in ranks]
    for ws, plan in zip(workspaces, plans):
        protocol.exchange_counts(ws, plan)
    for ws, plan, (x, idx, w, _, _) in zip(workspaces, plans, ranks):
        senders.dispatch_rows(ws, x, idx, w, plan)

    received = [0] * num_ranks  # bytes each source sent to the other ranks' receive buffers
    for owner, ws in enumerate(workspaces):
        # Expected layout: local expert l, then source rank s, then the source's slots in order; each
        # received row points at its token's row, which arrived once per (source, token) with a slot here.
        token_rows, meta, weights = [], [], []
        for l in range(per_rank):
            for s, (x, idx, w, _, _) in enumerate(ranks):
                slots = (idx.reshape(-1) == owner * per_rank + l).nonzero().flatten()
                token_rows.append(s * ws.max_tokens + slots // idx.shape[1])
                meta.append(s * ws.max_slots + slots)
                weights.append(w.reshape(-1)[slots].float())
        token_rows, meta, weights = torch.cat(token_rows), torch.cat(meta), torch.cat(weights)
        n = meta.shape[0]
        assert int(protocol.current_counts(ws).sum()) == n
        assert torch.equal(ws.recv_token_row[:n], token_rows.to(torch.int32)), f"owner {owner}: token rows"
        assert torch.equal(ws.recv_meta[:n], meta.to(torch.int32)), f"owner {owner}: row metadata"
        assert torch.equal(ws.recv_weight[:n], weights), f"owner {owner}: routing weights"
        expected = torch.full_like(ws.recv_tokens, float("nan"))
        for s, (x, idx, *_) in enumerate(ranks):
            here = ((idx >= owner * per_rank) & (idx < (owner + 1) * per_rank)).any(dim=1)
            expected[s * ws.max_tokens + here.nonzero().flatten()] = x[here]
        assert torch.equal(ws.recv_tokens.nan_to_num(-1.0), expected.nan_to_num(-1.0)), \
            f"owner {owner}: token rows received (each once, none for a token without a slot here)"
        assert int(ws.overflow[0]) == 0
        # What came from the other ranks, as protocol.bytes_between_ranks counts it
        for s, (_, idx, *_) in enumerate(ranks):
            if s != owner:
                rows_in = int((~ws.recv_tokens[s * ws.max_tokens:(s + 1) * ws.max_tokens].isnan()).all(dim=1).sum())
                slots_in = int(((idx >= owner * per_rank) & (idx < (owner + 1) * per_rank)).sum())
                received[s] += rows_in * DIM * 4 + slots_in * protocol.FWD_SLOT_FIELD_BYTES
    for s, (_, idx, *_) in enumerate(ranks):
        assert protocol.bytes_between_ranks(idx, s, per_rank, DIM, 4)["fwd_out"] == received[s], f"rank {s}: bytes"

    # Write the received rows back through the owners' output GEMM with identity experts (exact in fp32:
    # every product is x * 1 or x * 0) and a per-row scalar: every routed slot gets its own token's row,
    # and the source's wait sees every owner's signal.
    eye = torch.eye(DIM, device=DEVICE).expand(per_rank, DIM, DIM).contiguous()
    for ws in workspaces:
        plan, counts = protocol.received_plan(ws)
        protocol.reset_arrivals(ws, counts)
        rows_to_peer_slots(ws, DX_PEER, ws.recv_tokens[ws.recv_token_row.long()], eye, plan, DIM,
                                    scalar_C=ws.recv_meta.float())
    for ws, (x, idx, _, _, _) in zip(workspaces, ranks):
        protocol.combine_returned(ws, idx, x.dtype)  # returns only once every row is whole
        routed = (idx.reshape(-1) >= 0).nonzero().flatten()
        assert torch.equal(ws.y_slots[routed], x[routed // idx.shape[1]]), f"rank {ws.rank}: returned rows"
        assert torch.equal(ws.slot_scalar[routed], (ws.rank * ws.max_slots + routed).float()), "returned scalars"


def fp8_ranks(num_ranks, dim=256, seed=5):
    """:func:`split_problem` at FP8's dims (multiples of 128; two experts per rank, top-3, dropped slots), fewer than
    128 rows per expert (one tile each), with its workspaces: (ranks, workspaces, gathered problem, bounds, dys)."""
    case = ("fp8", [9, 0, 13] if num_ranks > 1 else [11], 2, 3, "dropped")
    ranks, problem, bounds, dys = split_problem(case, num_ranks, seed, dim=dim, inter=128)
    return ranks, workspaces_for(ranks, case[2], dim=dim), problem, bounds, dys


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_fp8_rows_travel_as_bytes_and_scales(num_ranks):
    """The forward's rows in FP8 (``dispatch_rows`` given x's 1x128 scales): every owner receives each token's e4m3
    row and its scales bit for bit where ``protocol.recv_tokens_fp8`` reads them, once per (token, owner) with a slot
    there, and nothing else; what came from the other ranks is what ``bytes_between_ranks(fp8_rows=True)`` counts,
    at most 55% of the same rows' bytes in bf16. The backward's: the same e4m3 rows, and x and dy once per (token,
    owner) at the token's row of ``recv_x`` / ``recv_dy`` (``xy_per_token``), what ``bwd_out`` counts."""
    from megamoe.kernels.quant import quantize_rows

    dim, per_rank = 384, 2  # three 1x128 groups per row (four scale lanes, one masked)
    ranks, workspaces, _, _, _ = fp8_ranks(num_ranks, dim=dim, seed=3)
    num_experts = per_rank * num_ranks
    ranks = [p[:3] for p in ranks]
    quantised = [quantize_rows(xr) for xr, _, _ in ranks]
    for ws in workspaces:  # bytes nobody sends stay 0x7f (an e4m3 NaN): a stray write or read shows
        ws.recv_tokens.view(torch.uint8).fill_(0x7F)
    plans = [build_plan(i, num_experts) for _, i, _ in ranks]
    for ws, plan in zip(workspaces, plans):
        protocol.exchange_counts(ws, plan)
    for ws, plan, (_, i, wr), (q, sc) in zip(workspaces, plans, ranks, quantised):
        senders.dispatch_rows(ws, q, i, wr, plan, x_s=sc)
    received = [0] * num_ranks  # bytes each source sent to the other ranks
    expected = []
    for owner, ws in enumerate(workspaces):
        q_in, s_in = protocol.recv_tokens_fp8(ws)
        expected_q = torch.full_like(q_in.view(torch.uint8), 0x7F)
        expected_s = torch.full_like(s_in.view(torch.uint8), 0x7F).view(torch.float32)
        for src, ((_, i, _), (q, sc)) in enumerate(zip(ranks, quantised)):
            here = ((i >= owner * per_rank) & (i < (owner + 1) * per_rank)).any(dim=1).nonzero().flatten()
            expected_q[src * ws.max_tokens + here] = q[here].view(torch.uint8)
            expected_s[:, src * ws.max_tokens + here] = sc[:, here]
            if src != owner:  # what crossed: the rows (e4m3 and scales) and their slots' fields
                slots_in = int(((i >= owner * per_rank) & (i < (owner + 1) * per_rank)).sum())
                received[src] += here.numel() * (dim + 4 * dim // 128) + slots_in * protocol.FWD_SLOT_FIELD_BYTES
        assert torch.equal(q_in.view(torch.uint8), expected_q), f"owner {owner}: e4m3 rows"
        assert torch.equal(s_in.view(torch.int32), expected_s.view(torch.int32)), f"owner {owner}: scales"
        expected.append((expected_q, expected_s))
    # The backward's dispatch given x in e4m3 beside x and dy (the keep-nothing recompute's input), x and dy once per
    # token and owner: the same token rows and scales land in the same places, x and dy at the tokens' rows.
    for ws in workspaces:
        ws.recv_tokens.view(torch.uint8).fill_(0x7F)
    for ws, plan in zip(workspaces, plans):
        protocol.exchange_counts(ws, plan)
    for ws, plan, (x, i, wr), (q, sc) in zip(workspaces, plans, ranks, quantised):
        senders.dispatch_rows(ws, x, i, wr, plan, dy_TD=-2 * x, x_s=sc, x_q=q, xy_per_token=True)
    received_bwd = [0] * num_ranks
    for owner, (ws, (expected_q, expected_s)) in enumerate(zip(workspaces, expected)):
        q_in, s_in = protocol.recv_tokens_fp8(ws)
        assert torch.equal(q_in.view(torch.uint8), expected_q), f"owner {owner}: backward's e4m3 rows"
        assert torch.equal(s_in.view(torch.int32), expected_s.view(torch.int32)), f"owner {owner}: backward's scales"
        expected_x = torch.full_like(ws.recv_x, float("nan"))
        for src, (x, i, _) in enumerate(ranks):
            here = ((i >= owner * per_rank) & (i < (owner + 1) * per_rank)).any(dim=1).nonzero().flatten()
            expected_x[src * ws.max_tokens + here] = x[here]
            if src != owner:  # x and dy rows (fp32 here), the e4m3 row and scales, the slots' fields
                slots_in = int(((i >= owner * per_rank) & (i < (owner + 1) * per_rank)).sum())
                received_bwd[src] += (here.numel() * (2 * 4 * dim + dim + 4 * dim // 128)
                                      + slots_in * protocol.FWD_SLOT_FIELD_BYTES)
        for name, got, want in (("x", ws.recv_x, expected_x), ("dy", ws.recv_dy, -2 * expected_x)):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), f"owner {owner}: backward's {name} rows"
    for src, (_, i, _) in enumerate(ranks):
        fp8 = protocol.bytes_between_ranks(i, src, per_rank, dim, 2, fp8_rows=True)["fwd_out"]
        bf16 = protocol.bytes_between_ranks(i, src, per_rank, dim, 2)["fwd_out"]
        assert fp8 == received[src] and fp8 <= 0.55 * bf16, (src, fp8, received[src], bf16)
        assert protocol.bytes_between_ranks(i, src, per_rank, dim, 4, fp8_rows=True)["bwd_out"] == received_bwd[src]
    assert num_ranks == 1 or sum(received) > 0
    (q, sc), (x0, i, wr) = quantised[0], ranks[0]
    # e4m3 rows with their scales: the forward's x, or the backward's x_q beside x and dy
    for bad in ({"dy_TD": x0, "x_s": sc}, {"x_s": sc[:, :1]}, {"x_q": q, "x_s": sc}, {"dy_TD": x0, "x_q": q}):
        with pytest.raises(ValueError, match="FP8 token rows are x in e4m3"):
            senders.dispatch_rows(workspaces[0], q, i, wr, plans[0], **bad)
    # x and dy once per token: the backward's, into buffers of R * T rows or more
    with pytest.raises(ValueError, match="xy_per_token"):
        senders.dispatch_rows(workspaces[0], x0, i, wr, plans[0], xy_per_token=True)
    small = loopback_workspaces(num_ranks, per_rank, num_ranks * workspaces[0].max_tokens - 1,
                                workspaces[0].max_tokens, workspaces[0].max_slots, dim, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="receive capacity of R \\* T"):
        senders.dispatch_rows(small[0], x0, i, wr, plans[0], dy_TD=x0, xy_per_token=True)


@pytest.mark.parametrize("mode", ["none", "preact"])
@pytest.mark.parametrize("num_ranks", [1, 3])
def test_fp8_loopback_forward_matches_the_one_device_fp8_layer(num_ranks, mode):
    """The forward in blockwise FP8 through the workspace (``loopback_forward(fp8=True)``: each rank's x quantised
    once, e4m3 rows and scales out, the owners' FP8 kernels once every row is in, bf16-or-wider rows back): every
    rank's y bit for bit its rows of the one-device FP8 layer's (each row's GEMMs do not depend on the rows beside
    it), also with the owners writing their received rows' gate and up products (the saved mode); the arrival and
    return counters reset after."""
    import megamoe

    ranks, workspaces, (x, idx, w, w13, w2, _), bounds, _ = fp8_ranks(num_ranks)
    rows = workspaces[0].capacity
    preacts = [torch.full((rows, w13.shape[1]), float("nan"), device=DEVICE) for _ in ranks] if mode == "preact" \
        else None
    ys = loopback.loopback_forward(workspaces, ranks, preacts=preacts, fp8=True)
    with torch.no_grad():
        expected = megamoe.moe(x, idx, w, w13, w2, precision="fp8")
    for r, y in enumerate(ys):
        assert torch.equal(y, expected[bounds[r]:bounds[r + 1]]), f"rank {r}"
    for ws in workspaces:
        ws.check_overflow()
        assert int(ws.arrived.abs().sum()) == 0 and int(ws.returned.abs().sum()) == 0, "counters not reset"
    if mode == "preact":  # each owner's received rows' products written, nothing past them
        for ws, preact in zip(workspaces, preacts):
            routed = int(protocol.current_counts(ws).sum())
            assert preact[:routed].isfinite().all() and preact[routed:].isnan().all()
    with pytest.raises(ValueError, match="comm_sms must be 0"):
        loopback.loopback_forward(workspaces, ranks, comm_sms=2, fp8=True)


@pytest.mark.parametrize("fp8_wgrad", [True, False])
@pytest.mark.parametrize("mode", ["none", "preact"])
@pytest.mark.parametrize("num_ranks", [1, 3])
def test_fp8_loopback_backward_matches_the_one_device_fp8_layer(num_ranks, mode, fp8_wgrad, monkeypatch):
    """The backward in blockwise FP8 through the workspace (``loopback_backward(fp8=True)``: x and dy rows out in
    x's dtype, the owners' FP8 backward once every row is in, dx rows and d(routing weight) back): dx and d(routing
    weight) bit for bit the one-device FP8 layer's (each row's own GEMMs), dw13 and dw2 its own to the order of
    fp32 sums (an owner's rows of an expert come source by source; one tile per expert here, so the 128x1 groups
    hold the same rows), with FP8 or bf16 weight gradients, from the forward's saved products or recomputed (from
    the FP8 token rows the backward's dispatch sends)."""
    import megamoe
    import megamoe.autograd

    monkeypatch.setattr(megamoe.autograd, "FP8_WGRAD", fp8_wgrad)
    ranks, workspaces, problem, bounds, dys = fp8_ranks(num_ranks)
    rows = workspaces[0].capacity
    preacts = [torch.full((rows, problem[3].shape[1]), float("nan"), device=DEVICE) for _ in ranks] \
        if mode == "preact" else None
    loopback.loopback_forward(workspaces, ranks, preacts=preacts, fp8=True)
    for ws in workspaces:  # the recompute reads the token rows the backward sends, not the forward's left behind
        ws.recv_tokens.view(torch.uint8).fill_(0x7F)
    results = loopback.loopback_backward(workspaces, ranks, dys, preacts=preacts, fp8=True, fp8_wgrad=fp8_wgrad)
    _, dx, dweight, dw13, dw2 = run_with_grads(
        lambda *a: megamoe.moe(*a, precision="fp8", save_for_backward=mode), *problem)
    for r, (dx_r, dweight_r, dw13_r, dw2_r) in enumerate(results):
        tok, exp = slice(bounds[r], bounds[r + 1]), slice(2 * r, 2 * r + 2)
        assert torch.equal(dx_r, dx[tok]), f"rank {r}: dx"
        assert torch.equal(dweight_r, dweight[tok]), f"rank {r}: d(routing weight)"
        for name, a, b in (("dw13", dw13_r, dw13[exp]), ("dw2", dw2_r, dw2[exp])):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"rank {r}: {name}"
    for ws in workspaces:
        assert int(ws.arrived.abs().sum()) == 0 and int(ws.returned.abs().sum()) == 0, "counters not reset"
    with pytest.raises(ValueError, match="comm_sms must be 0"):
        loopback.loopback_backward(workspaces, ranks, dys, comm_sms=2, fp8=True)


@pytest.mark.parametrize("fp8_wgrad", [True, False])
@pytest.mark.parametrize("mode", ["none", "preact"])
@pytest.mark.parametrize("custom_ops", [False, True], ids=["eager", "custom ops"])
def test_fused_layer_in_fp8_is_the_one_device_fp8_layer(custom_ops, mode, fp8_wgrad, monkeypatch):
    """The fused expert-parallel layer in blockwise FP8 (``fused.fused_ep(fp8=True)``, what ``megamoe.moe(group=...,
    precision="fp8")`` runs) on one virtual rank, through its eager wiring and its custom ops: y, dx and d(routing
    weight) bit for bit the one-device FP8 layer's, dw13 and dw2 to the order of fp32 sums, in both memory modes,
    with FP8 or bf16 weight gradients; senders in the expert kernels' launch (``comm_sms`` > 0) refused."""
    import contextlib

    import megamoe
    import megamoe.autograd
    from megamoe.env import forcing_custom_ops
    from megamoe.parallel import fused

    monkeypatch.setattr(megamoe.autograd, "FP8_WGRAD", fp8_wgrad)
    _, (ws,), problem, _, _ = fp8_ranks(1)
    save = mode == "preact"

    def layer(*args, comm_sms=(0, 0)):
        with forcing_custom_ops(contextlib.nullcontext()) if custom_ops else contextlib.nullcontext():
            return fused.fused_ep(*args, ws, comm_sms, save, fp8=True, fp8_wgrad=fp8_wgrad)

    got = run_with_grads(layer, *problem)
    expected = run_with_grads(lambda *a: megamoe.moe(*a, precision="fp8", save_for_backward=mode), *problem)
    for name, a, b in zip(["y", "dx", "d(routing weight)"], got, expected):
        assert torch.equal(a, b), name
    for name, a, b in zip(["dw13", "dw2"], got[3:], expected[3:]):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name
    assert int(ws.arrived.abs().sum()) == 0 and int(ws.returned.abs().sum()) == 0, "counters not reset"
    for comm_sms in ((2, 0), (0, 2)):
        with pytest.raises(ValueError, match="comm_sms must be 0"):
            run_with_grads(functools.partial(layer, comm_sms=comm_sms), *problem)


@pytest.mark.parametrize("mode", ["none", "preact"])
def test_fused_layer_in_fp8_holds_no_weight_copy_under_the_call_policy(mode):
    """``megamoe.set_fp8_weight_cache("call")`` on the fused expert-parallel FP8 layer: the owner makes the copies
    each of its calls reads and none is held after the step; the same results as the one-device FP8 layer's on
    cached copies (y, dx and d(routing weight) bit for bit, dw13 and dw2 to the order of fp32 sums)."""
    import megamoe
    from megamoe.kernels import quant
    from megamoe.parallel import fused

    _, (ws,), problem, _, _ = fp8_ranks(1)
    expected = run_with_grads(lambda *a: megamoe.moe(*a, precision="fp8", save_for_backward=mode), *problem)
    megamoe.set_fp8_weight_cache("call")
    try:
        got = run_with_grads(lambda *a: fused.fused_ep(*a, ws, (0, 0), mode == "preact", fp8=True, fp8_wgrad=True),
                             *problem)
        assert not quant._weight_cache
    finally:
        megamoe.set_fp8_weight_cache("step")
    for name, a, b in zip(["y", "dx", "d(routing weight)"], got, expected):
        assert torch.equal(a, b), name
    for name, a, b in zip(["dw13", "dw2"], got[3:], expected[3:]):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name


def test_fp8_loopback_with_several_tiles_per_expert_matches_the_one_device_fp8_layer():
    """The FP8 loopback forward and backward with several plan tiles per expert, so that an owner's 128-row groups
    of an expert (the FP8 weight gradients' 128x1 operands) hold rows of several sources: y, dx and d(routing weight)
    bit for bit the one-device FP8 layer's, dw13 and dw2 to the order of fp32 sums (an owner's rows of an expert come
    source by source, in the sources' token order, as the one-device layer sorts them)."""
    import megamoe

    case = ("fp8, several tiles", [150, 40, 130], 2, 3, "random")
    ranks, problem, bounds, dys = split_problem(case, 3, seed=7, dim=128, inter=128)
    workspaces = workspaces_for(ranks, case[2], dim=128)
    ys = loopback.loopback_forward(workspaces, ranks, fp8=True)
    results = loopback.loopback_backward(workspaces, ranks, dys, fp8=True)
    expected = run_with_grads(lambda *a: megamoe.moe(*a, precision="fp8"), *problem)
    assert min(int(c) for c in torch.bincount(problem[1].flatten())) > 128  # every expert two tiles or more
    for r, (y, (dx, dweight, dw13, dw2)) in enumerate(zip(ys, results)):
        tok, exp = slice(bounds[r], bounds[r + 1]), slice(2 * r, 2 * r + 2)
        assert torch.equal(y, expected[0][tok]), f"rank {r}: y"
        assert torch.equal(dx, expected[1][tok]) and torch.equal(dweight, expected[2][tok]), f"rank {r}: dx, dweight"
        for name, a, b in (("dw13", dw13, expected[3][exp]), ("dw2", dw2, expected[4][exp])):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"rank {r}: {name}"


@pytest.mark.parametrize("num_ranks", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_round_trip_returns_every_row_exactly(case, num_ranks):
    """The communication-only path of the EP benchmark: each routed slot gets its own token's row back,
    bit for bit, and the counters are reset for the next call (run twice)."""
    ranks = split_problem(case, num_ranks)[0]
    workspaces = workspaces_for(ranks, case[2])
    for _ in range(2):
        for ws, slots, (x, idx, *_) in zip(workspaces, loopback.loopback_round_trip(workspaces, ranks), ranks):
            routed = (idx.reshape(-1) >= 0).nonzero().flatten()
            assert torch.equal(slots[routed], x[routed // idx.shape[1]]), f"rank {ws.rank}: returned rows"
            assert int(ws.arrived.abs().sum()) == 0 and int(ws.returned.abs().sum()) == 0, "counters not reset"


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loopback_forward_matches_one_device_reference(case, num_ranks):
    check_loopback_forward(case, num_ranks)


def check_loopback_forward(case, num_ranks):
    """Each rank's y against the fp32 one-device layer; the overflow and arrival/return counters clear after."""
    ranks, (x, idx, w, w13, w2, _), bounds, _ = split_problem(case, num_ranks)
    workspaces = workspaces_for(ranks, case[2])
    ys = loopback.loopback_forward(workspaces, ranks)
    ref = reference.moe_loop(x, idx, w, w13, w2, fp32=True)
    for r, y in enumerate(ys):
        expected = ref[bounds[r]:bounds[r + 1]]
        assert y.shape == expected.shape
        err = (y - expected).abs().max().item() if y.numel() else 0.0
        assert err <= 1e-5 * max(1.0, expected.abs().max().item() if y.numel() else 0.0), f"rank {r}: {err:.2e}"
    for ws in workspaces:
        ws.check_overflow()
        assert_counters_after_forward(ws)


def assert_counters_after_forward(ws):
    """After a forward: the arrival and return counters reset, and the up tiles' shortcut
    (``protocol.wait_rows_upto``) at this call's base, epoch * (L + 1), plus one past my last local expert with
    received rows (the first of its tiles always waits in full and records it); below the base if I received none."""
    assert int(ws.arrived.abs().sum()) == 0 and int(ws.returned.abs().sum()) == 0, "counters not reset"
    epoch, num_local = int(ws.epoch[0]), ws.num_local
    busy = torch.nonzero(ws.counts[epoch % 2].sum(0)).flatten()
    base = epoch * (num_local + 1)
    if busy.numel():
        assert int(ws.ready[0]) == base + int(busy[-1]) + 1, f"rank {ws.rank}: ready {int(ws.ready[0])}"
    else:
        assert int(ws.ready[0]) < base, f"rank {ws.rank}: ready {int(ws.ready[0])} with no rows received"


@pytest.mark.parametrize("num_ranks, comm_sms", [(1, 1), (1, 3), (3, 2), (4, 1)])
@pytest.mark.parametrize("case", SENDER_CASES, ids=[c[0] for c in SENDER_CASES])
def test_rows_sent_from_the_up_kernels_launch_match_the_reference(case, num_ranks, comm_sms):
    """Phase 2 on ``comm_sms`` programs of the up kernel's launch, in the senders' order (local expert, then
    owner), twice on one workspace; outputs against the fp32 reference. One virtual rank: its senders
    feed its own GEMM tiles in one launch; more: each rank's senders run first, in launches of their own."""
    ranks, problem, bounds, _ = split_problem(case, num_ranks)
    workspaces = workspaces_for(ranks, case[2])
    ref = reference.moe_loop(*problem[:5], fp32=True)
    for _ in range(2):
        for r, y in enumerate(loopback.loopback_forward(workspaces, ranks, comm_sms=comm_sms)):
            torch.testing.assert_close(y, ref[bounds[r]:bounds[r + 1]], rtol=1e-5, atol=1e-5)
        for ws in workspaces:
            assert_counters_after_forward(ws)


@pytest.mark.parametrize("persistent", [False, True])
def test_output_gemms_take_their_twins_tile_and_launch_mode(persistent, monkeypatch):
    """DOWN_PEER / DX_PEER launch with the config DOWN / DX chose (autotuning), the launch mode (PERSISTENT)
    included — checked on the configs, since the CPU tests never autotune — and each mode writes every routed
    slot: forward and backward on three loopback ranks against the fp32 reference, at 16 output columns per
    block, so that the persistent programs (4 in the interpreter) stride over several busy tiles, with dropped
    slots and experts with no rows (idle tiles)."""
    for twin, follower in ((DOWN, DOWN_PEER), (DX, DX_PEER)):
        chosen = {**twin.default, "BN": 128, "PERSISTENT": persistent}
        assert follower._own(chosen) == chosen
        assert follower.default == twin.default
        monkeypatch.setattr(follower, "default", {**twin.default, "BN": 16, "PERSISTENT": persistent})
    for case in (CASES[3], CASES[4]):
        check_loopback_forward(case, 3)
        check_loopback_backward(case, 3, 0)


@pytest.mark.parametrize("idx, num_ranks, num_local", [
    ([[0, 5], [1, 2], [4, 3], [5, 0], [2, 3]], 3, 2),  # every expert has rows
    ([[0, 5], [1, 2], [1, 3], [5, 0], [2, 3]], 3, 2),  # expert 4 (owner 2's local expert 0) has none
    ([[0, -1], [-1, 2], [4, 3], [5, 0], [-1, -1]], 3, 2),  # dropped slots: after the routed rows, as none
    ("5 000 rows per expert", 2, 1),  # more blocks than programs per expert (senders.SEND_LIST_SPLIT)
    ("half of them dropped", 2, 1),  # as many dropped slots, expert 1 empty
])
def test_send_list_is_local_expert_major(idx, num_ranks, num_local):
    """Segment l * R + k of the senders' order is my rows of owner k's local expert l, in sorted order,
    each as (slot, global expert, index among my rows of that expert, whether it carries its token's row
    there: given the routing, its first slot at that owner); then the dropped slots, as none."""
    num_experts = num_ranks * num_local
    long = {"5 000 rows per expert": torch.arange(10_000) % 2, "half of them dropped": torch.arange(10_000) % 2 - 1}
    idx = (torch.tensor(idx) if isinstance(idx, list) else long[idx][:, None]).to(DEVICE)
    plan = build_plan(idx, num_experts)
    offsets = plan.offsets_E1.tolist()
    want = [[], [], []]
    for local in range(num_local):
        for owner in range(num_ranks):
            e = owner * num_local + local
            want[0] += plan.row_slot_N[offsets[e]:offsets[e + 1]].tolist()
            want[1] += [e] * (offsets[e + 1] - offsets[e])
            want[2] += list(range(offsets[e + 1] - offsets[e]))
    dropped = idx.numel() - offsets[-1]
    want = [want[0] + [-1] * dropped, want[1] + [0] * dropped, want[2] + list(range(dropped))]
    # carries: the token's first slot at the owner, lowest local expert first, then lowest slot
    picks, top_k = idx.tolist(), idx.shape[1]
    carries = [int(slot >= 0 and not any(
        p >= 0 and p // num_local == e // num_local and (p % num_local, k) < (e % num_local, slot % top_k)
        for k, p in enumerate(picks[slot // top_k]))) for slot, e in zip(want[0], want[1])]
    assert senders.send_list(plan, num_ranks, num_local).tolist() == [*want, [0] * len(carries)]
    assert senders.send_list(plan, num_ranks, num_local, idx).tolist() == [*want, carries]


@pytest.mark.parametrize("num_ranks, comm_sms", [(2, 0), (4, 0), (1, 2), (3, 2)])
@pytest.mark.parametrize("case", SENDER_CASES, ids=[c[0] for c in SENDER_CASES])
def test_loopback_backward_matches_one_device_reference(case, num_ranks, comm_sms):
    """The backward on loopback ranks (:func:`check_loopback_backward`). With ``comm_sms``, the x and dy rows are
    sent from the dh' kernel's launch (one virtual rank)."""
    check_loopback_backward(case, num_ranks, comm_sms)


@pytest.mark.parametrize("num_ranks, comm_sms", [(2, 0), (4, 0), (1, 2), (3, 2)])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_saved_products_backward_matches_one_device_reference(case, num_ranks, comm_sms):
    """The saved-activation mode: the forward keeps each owner's received rows' gate and up products, and the
    backward's act step reads them, in the same received-row order, instead of recomputing them; the forward's
    outputs and every gradient as without it."""
    check_loopback_backward(case, num_ranks, comm_sms, saved=True)


def check_loopback_backward(case, num_ranks, comm_sms, saved=False):
    """dx and d(routing weight) of each rank's tokens, dw13/dw2 of each rank's experts (rows of every
    rank), against the fp32 one-device layer; experts that receive no rows get exact zeros. ``saved``: after a
    forward that saved the gate and up products (checked too), the backward on them, which writes dz over the
    received rows' products and nothing past them."""
    ranks, problem, bounds, dys = split_problem(case, num_ranks)
    workspaces = workspaces_for(ranks, case[2])
    preacts = None
    if saved:
        preacts = [torch.full((ws.capacity, 2 * INTER), float("nan"), device=DEVICE) for ws in workspaces]
        ys = loopback.loopback_forward(workspaces, ranks, comm_sms=comm_sms, preacts=preacts)
        ref = reference.moe_loop(*problem[:5], fp32=True)
        for r, y in enumerate(ys):
            torch.testing.assert_close(y, ref[bounds[r]:bounds[r + 1]], rtol=1e-5, atol=1e-5)
        received = [int(protocol.current_counts(ws).sum()) for ws in workspaces]
        for preact, n in zip(preacts, received):  # every received row's products written, no other row's
            assert torch.isfinite(preact[:n]).all() and torch.isnan(preact[n:]).all()
        products = [preact.clone() for preact in preacts]
    grads = loopback.loopback_backward(workspaces, ranks, dys, comm_sms=comm_sms, preacts=preacts)
    if saved:
        for preact, before, n in zip(preacts, products, received):
            assert torch.isnan(preact[n:]).all() and (n == 0 or not torch.equal(preact[:n], before[:n]))
    _, dx, dw, dw13, dw2 = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    per_rank = case[2]
    for r, got in enumerate(grads):
        tok, exp = slice(bounds[r], bounds[r + 1]), slice(r * per_rank, (r + 1) * per_rank)
        for name, g, ref in zip(["dx", "dtopk_weights", "dw13", "dw2"], got, [dx[tok], dw[tok], dw13[exp], dw2[exp]]):
            assert g.shape == ref.shape, f"rank {r}: {name} shape"
            err = (g.float() - ref).abs().max().item() if g.numel() else 0.0
            bound = 1e-5 * max(1.0, ref.abs().max().item() if g.numel() else 0.0)
            assert err <= bound, f"rank {r}: {name} max err {err:.2e} > {bound:.2e}"
            if name.startswith("dw"):
                empty = (ref.flatten(1).abs().amax(1) == 0)
                assert torch.equal(g[empty], torch.zeros_like(g[empty])), f"rank {r}: {name} of an empty expert"


def test_consecutive_calls_reuse_the_workspace():
    """Epochs and counter resets: three calls with different routing through one set of workspaces."""
    case = CASES[0]
    ranks0, _, _, _ = split_problem(case, 4, seed=0)
    workspaces = workspaces_for(ranks0, case[2], capacity=4 * 64)
    for seed in range(3):
        ranks, (x, idx, w, w13, w2, _), bounds, _ = split_problem(case, 4, seed=seed)
        ys = loopback.loopback_forward(workspaces, ranks)
        ref = reference.moe_loop(x, idx, w, w13, w2, fp32=True)
        for r, y in enumerate(ys):
            torch.testing.assert_close(y, ref[bounds[r]:bounds[r + 1]], rtol=1e-5, atol=1e-5)
        for ws in workspaces:
            assert_counters_after_forward(ws)
    assert all(int(ws.epoch[0]) == 3 for ws in workspaces)


@pytest.mark.parametrize("fp8,capacity", [(False, 10), (True, 10), (True, 28)],
                         ids=["bf16", "fp8, x and dy per slot", "fp8, x and dy per token"])
def test_capacity_overflow_is_reported_and_nothing_hangs(fp8, capacity):
    """Rows past an owner's receive capacity are counted (by the owner and by their source), never waited for; in
    FP8 too, forward and backward (the token rows cross beside the slots, into ``recv_tokens``, which always fits;
    the backward's x and dy once per token where the capacity holds R * T = 28 rows, else per slot)."""
    case = CASES[2]  # every row goes to rank 0's experts
    dim = 128 if fp8 else DIM  # FP8's 128-column groups
    ranks, _, _, dys = split_problem(case, 4, dim=dim, inter=128 if fp8 else INTER)
    workspaces = workspaces_for(ranks, case[2], capacity=capacity, dim=dim)
    assert senders.fp8_xy_per_token(workspaces[0], True) == (capacity == 28)
    loopback.loopback_forward(workspaces, ranks, fp8=fp8)  # returns: a lost row is counted, never waited for
    if fp8:  # the backward too, its own rows lost and counted again
        loopback.loopback_backward(workspaces, ranks, dys, fp8=True)
    # Owner 0's layout: local expert, then source rank; rows from position `capacity` on are lost.
    sent = [[int((p[1] == l).sum()) for p in ranks] for l in range(case[2])]
    lost, position = [0] * 4, 0
    for l in range(case[2]):
        for s in range(4):
            lost[s] += max(0, position + sent[l][s] - max(position, capacity))
            position += sent[l][s]
    assert sum(lost) == position - capacity > 0
    # Rank 0 counts every lost row as the owner, plus its own as a source; the others their own (in each direction).
    calls = 2 if fp8 else 1
    assert [int(ws.overflow[0]) for ws in workspaces] == [calls * (sum(lost) + lost[0]), *(calls * n for n in lost[1:])]
    for ws in workspaces:  # the debug mode's immediate check (the default one is a device assert)
        if int(ws.overflow[0]):
            with pytest.raises(RuntimeError, match=f"receive capacity {capacity} rows exceeded"):
                ws.check_overflow(now=True)
        else:
            ws.check_overflow(now=True)
    if DEVICE == "cpu":  # on a GPU a failed device assert takes the CUDA context down with it
        with pytest.raises(RuntimeError, match="receive capacity"):
            workspaces[0].check_overflow()


def test_loopback_benchmark_checks_the_protocol():
    """``python -m megamoe.bench --ep --loopback R``; on a GPU it also times it, on CPU it checks."""
    from megamoe.bench.ep import loopback_case

    info = loopback_case("tiny", 8, "skewed", 4, seed=0, timed=False)
    assert info["loopback_fwd_max_rel_err"] <= 2 * info["plain_fwd_max_rel_err"] + 1e-4  # fp32 on CPU, bf16 on GPUs
    moved = info["bytes_between_ranks"]  # 4 ranks of skewed routing: rows cross both ways
    assert moved["fwd_out"] > 0 and moved["bwd_back"] > moved["fwd_back"] > 0


def test_unbounded_waits_compile_the_bound_out_and_keep_the_protocol_exact(monkeypatch):
    """``MEGAMOE_EP_UNBOUNDED_WAITS=1`` (measuring the bound's cost: ``gpu-check.sh ep-waits``) is read at import; the
    protocol's kernels compiled without the bound still compute the layer; a bad value is refused."""
    import os
    import subprocess
    import sys

    from megamoe.env import ep_unbounded_waits

    script = ("from megamoe.parallel import protocol; from megamoe.bench.ep import loopback_case; "
              "info = loopback_case('tiny', 8, 'skewed', 2, seed=0, timed=False); "
              "print(protocol.BOUNDED.value, info['bounded_waits'], "
              "info['loopback_fwd_max_rel_err'] <= 2 * info['plain_fwd_max_rel_err'] + 1e-4)")
    env = {**os.environ, "MEGAMOE_EP_UNBOUNDED_WAITS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["False", "False", "True"], out.stdout
    monkeypatch.setenv("MEGAMOE_EP_UNBOUNDED_WAITS", "yes")
    with pytest.raises(ValueError, match="MEGAMOE_EP_UNBOUNDED_WAITS"):
        ep_unbounded_waits()


def test_loopback_benchmark_timed_path_runs(monkeypatch):
    """The GPU-only part of ``--ep --loopback 1 --comm-sms 2 --profile`` (timings, costs, per-kernel tables)
    on CPU, with the timer and the CUDA queries stubbed: what it records, not how fast."""
    import triton.testing

    from megamoe.bench.ep import loopback_case

    if DEVICE == "cpu":
        monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 2.0)[1])
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stub")
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    info = loopback_case("tiny", 8, "random", 1, seed=0, timed=True, comm_sms=(2,), profile=True)
    for key in ("loopback_fwd_ms", "loopback_fwd_bwd_ms", "plain_fwd_bwd_ms", "machinery_cost_fwd_bwd",
                "loopback_fwd_ms_sms2", "machinery_cost_fwd_bwd_sms2", "loopback_fwd_max_rel_err_sms2",
                "bytes_between_ranks"):
        assert key in info, key
    assert info["loopback_fwd_max_rel_err_sms2"] <= 2 * info["plain_fwd_max_rel_err"] + 1e-4
    assert "===== loopback backward, comm_sms=2" in info["_profile"]
    windows = info["timed_utc"]  # one window per timed variant, each ending after it starts
    assert {"plain forward", "loopback forward", "loopback backward, comm_sms=2"} <= windows.keys()
    assert all(start < end for start, end in windows.values())
    if DEVICE == "cpu":
        assert info["loopback_fwd_bwd_ms"] == 4.0 and info["machinery_cost_fwd_bwd_sms2"] == 1.0
    assert not info["fp8"] and "loopback_fp8_fwd_ms" not in info  # D 64: not on FP8's 128 grid
    # At dims on the 128 grid the FP8 loopback too: its error against the plain FP8 layer's, its rows' bytes, its time
    from megamoe.bench import ep

    monkeypatch.setitem(ep.PRESETS, "tiny-fp8", (128, 128, 4, 2))
    info = loopback_case("tiny-fp8", 8, "random", 2, seed=0, timed=True)
    assert info["fp8"] and info["loopback_fp8_fwd_max_rel_err"] <= 2 * info["plain_fp8_fwd_max_rel_err"] + 1e-4
    assert info["bytes_between_ranks_fp8"]["fwd_out"] <= 0.55 * info["bytes_between_ranks"]["fwd_out"]
    assert info["bytes_between_ranks_fp8"]["bwd_out"] > 0
    if DEVICE == "cpu":
        assert info["loopback_fp8_fwd_bwd_ms"] == 4.0 and info["fp8_speedup_fwd_bwd"] == 1.0
        assert info["plain_fp8_fwd_bwd_ms"] == 2.0 and info["machinery_cost_fp8_fwd_bwd"] == 1.0


# ----------------------------------------------------------------------------------------------- GPU

STEPS_SCRIPT = """
import torch
from megamoe import reference
from megamoe.parallel import loopback
from megamoe.parallel.workspace import loopback_workspaces
from tests.helpers import make_problem

R, COMM_SMS = {ranks}, {comm_sms}
L, T, K, D, I = 32 // R, 256, 4, 256, 128
workspaces = loopback_workspaces(R, L, R * T * K, T, T * K, D, torch.bfloat16, "cuda")
for step in range(200):
    x, idx, w, w13, w2, dy = make_problem(R * T, D, I, R * L, K, "random", dtype=torch.bfloat16, device="cuda",
                                          seed=step)
    ranks = [(x[r * T:(r + 1) * T], idx[r * T:(r + 1) * T], w[r * T:(r + 1) * T], w13[r * L:(r + 1) * L],
              w2[r * L:(r + 1) * L]) for r in range(R)]
    if step % 2:
        loopback.loopback_backward(workspaces, ranks, [dy[r * T:(r + 1) * T] for r in range(R)], comm_sms=COMM_SMS)
    else:
        loopback.loopback_forward(workspaces, ranks, comm_sms=COMM_SMS)
ys = torch.cat(loopback.loopback_forward(workspaces, ranks, comm_sms=COMM_SMS)).float()
ref32 = reference.moe_loop(x, idx, w, w13, w2, fp32=True)
ref_lp = reference.moe_loop(x, idx, w, w13, w2).float()
err, bound = (ys - ref32).abs().max().item(), 2 * (ref_lp - ref32).abs().max().item() + 1e-5 * ref32.abs().max().item()
print("done", int(workspaces[0].epoch[0]), "max err", err, "bound", bound, "ok" if err <= bound else "WRONG")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("ranks, comm_sms", [(8, 0), (1, 16)])
def test_two_hundred_loopback_steps_without_a_hang(ranks, comm_sms):
    """R virtual ranks, forward and backward alternating, new routing every step, then a forward checked
    against the reference; in a subprocess with a timeout, so that a hang fails the test instead of
    stalling the run. Autotuning on, as users run it: the first step tunes the waiting expert kernels,
    and the kernels with peer side effects must run once per launch, not once per config tried. With
    ``comm_sms`` (one rank), the rows are sent from the expert kernels' own launches."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "MEGAMOE_AUTOTUNE": "1"}
    script = STEPS_SCRIPT.format(ranks=ranks, comm_sms=comm_sms)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=300, check=False)
    assert out.returncode == 0 and "done 201" in out.stdout and out.stdout.rstrip().endswith("ok"), \
        out.stdout + out.stderr


@pytest.mark.gpu
def test_loopback_step_replays_in_a_cuda_graph_with_new_routing():
    case = CASES[0]
    ranks = split_problem(case, 4)[0]
    static = [tuple(t.clone() for t in p) for p in ranks]
    workspaces = workspaces_for(ranks, case[2], capacity=4 * 64)
    loopback.loopback_forward(workspaces, static)  # compile and load every kernel before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = loopback.loopback_forward(workspaces, static)
    for seed in (1, 2):
        ranks, (x, idx, w, w13, w2, _), bounds, _ = split_problem(case, 4, seed=seed)
        for dst, src in zip(static, ranks):
            for d, s in zip(dst, src):
                d.copy_(s)
        graph.replay()
        ref = reference.moe_loop(x, idx, w, w13, w2, fp32=True)
        for r, y in enumerate(ys):
            torch.testing.assert_close(y, ref[bounds[r]:bounds[r + 1]], rtol=1e-5, atol=1e-5)
