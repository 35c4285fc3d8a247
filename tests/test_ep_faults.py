"""The fused expert-parallel protocol when a peer misbehaves, on the loopback workspace (virtual ranks of one
device; on CPU in the Triton interpreter, on a GPU with ``-m loopback``): every wait is bounded, so a rank that
never sends its counts, sends fewer rows than it announced, never writes back or starts the backward after the
bound ends each waiting rank's call
within the bound, with a ``RuntimeError`` that names the stage and the peer; after a reset of every workspace the
next call is exact again."""

import time

import pytest
import torch

from megamoe import reference
from megamoe.kernels.plan import build_plan
from megamoe.parallel import loopback
from megamoe.parallel.owner import owner_experts, owner_experts_backward
from megamoe.parallel.protocol import (
    combine_returned,
    combine_returned_backward,
    exchange_counts,
    first_non_finite,
)
from megamoe.parallel.senders import dispatch_rows
from megamoe.parallel.workspace import CONTROL
from tests.helpers import run_with_grads
from tests.test_dispatch import (
    CASES,
    assert_counters_after_forward,
    split_problem,
    workspaces_for,
)

pytestmark = pytest.mark.loopback

TIMEOUT_S = "0.05"  # MEGAMOE_EP_TIMEOUT_S for these tests: no wait of a healthy loopback call waits at all
CASE, NUM_RANKS = CASES[0], 4


@pytest.fixture
def problem(monkeypatch):
    monkeypatch.setenv("MEGAMOE_EP_TIMEOUT_S", TIMEOUT_S)
    ranks, full, bounds, _ = split_problem(CASE, NUM_RANKS)
    return ranks, full, bounds, workspaces_for(ranks, CASE[2])


def forward_with_fault(workspaces, ranks, skip_counts=(), skip_owner=(), before_dispatch=None):
    """The loopback forward, phase by phase, with ranks ``skip_counts`` never sending their counts (nor anything
    after: dead from the start) and ranks ``skip_owner`` never running their expert kernels (never writing
    back); ``before_dispatch(plans)`` may tamper with the announced counts."""
    num_experts = NUM_RANKS * CASE[2]
    live = [r for r in range(NUM_RANKS) if r not in skip_counts]
    plans = {r: build_plan(ranks[r][1], num_experts) for r in live}
    for r in live:
        exchange_counts(workspaces[r], plans[r])
    if before_dispatch:
        before_dispatch(plans)
    for r in live:
        x, idx, weights, _, _ = ranks[r]
        dispatch_rows(workspaces[r], x, idx, weights, plans[r])
    for r in live:
        if r not in skip_owner:
            owner_experts(workspaces[r], ranks[r][3], ranks[r][4])
    ys = {r: combine_returned(workspaces[r], ranks[r][1], ranks[r][0].dtype) for r in live}
    end_of_call(workspaces)
    return ys


def end_of_call(workspaces):
    """What the fused layer does at the end of a call (``Workspace.snapshot_error``), and a host that then waits for
    the device (a loss read back): the next call's ``check_error`` sees this call's record."""
    for ws in workspaces:
        ws.snapshot_error()
    if workspaces[0].control.is_cuda:
        torch.cuda.synchronize()


def assert_recovers(workspaces, ranks, full, bounds):
    """Reset every rank's workspace: the next call is exact again."""
    for ws in workspaces:
        ws.reset()
        assert ws.error() is None
    ys = loopback.loopback_forward(workspaces, ranks)
    x, idx, w, w13, w2, _ = full
    expected = reference.moe_loop(x, idx, w, w13, w2, fp32=True)
    for r, y in enumerate(ys):
        torch.testing.assert_close(y, expected[bounds[r]:bounds[r + 1]], rtol=1e-5, atol=1e-5)
    for ws in workspaces:
        assert ws.error() is None
        assert_counters_after_forward(ws)


def test_a_rank_that_never_sends_its_counts(problem):
    ranks, full, bounds, workspaces = problem
    forward_with_fault(workspaces, ranks, skip_counts=(1,))
    for r in (0, 2, 3):
        with pytest.raises(RuntimeError, match=rf"on rank {r} .*every source's counts at an owner.*peer rank 1\b"):
            workspaces[r].check_error()
    assert_recovers(workspaces, ranks, full, bounds)


def test_a_rank_that_sends_fewer_rows_than_it_announced(problem):
    """Source 3 announces one row more to owner 2's last expert than it sends: owner 2's tile of that expert
    gives up (naming source 3 and the expert, expected against seen); the other ranks' calls complete."""
    ranks, full, bounds, workspaces = problem
    owner, source, last = 2, 3, CASE[2] - 1

    def announce_one_more(_plans):
        ws = workspaces[owner]
        parity = int(ws.epoch[0]) % 2
        ws.counts[parity, source, last] += 1

    forward_with_fault(workspaces, ranks, before_dispatch=announce_one_more)
    message = workspaces[owner].error()
    assert message and "rows of one of my experts" in message and "peer rank 3, index 1" in message
    expected = int(workspaces[owner].counts[int(workspaces[owner].epoch[0]) % 2, source, last])
    assert f"expected {expected}, seen {expected - 1}" in message, message
    for r in (0, 1, 3):
        assert workspaces[r].error() is None
    assert_recovers(workspaces, ranks, full, bounds)


def test_an_owner_that_never_writes_back(problem):
    ranks, full, bounds, workspaces = problem
    forward_with_fault(workspaces, ranks, skip_owner=(2,))
    for r in range(NUM_RANKS):
        with pytest.raises(RuntimeError, match=r"an owner writing back my rows.*peer rank 2\b"):
            workspaces[r].check_error(now=True)
    assert_recovers(workspaces, ranks, full, bounds)


@pytest.mark.timeout(120)  # a rank whose waits still spun after the record would take many minutes here
def test_the_record_stops_every_later_wait_of_the_rank(problem):
    """After one wait gave up, the rank's other waits return at once: a second call with the dead rank still away,
    under a bound raised a thousandfold (which a wait that still spun would take minutes to reach here), ends at
    once, and the record stays the first one."""
    ranks, _, _, workspaces = problem
    forward_with_fault(workspaces, ranks, skip_counts=(1,))
    first = workspaces[0].error()
    record = workspaces[0].control[CONTROL["err_stage"]:CONTROL["timeout_us"]].clone()
    for ws in workspaces:
        ws.control[CONTROL["poll_limit"]] *= 1000
        ws.control[CONTROL["timeout_us"]] *= 1000
    start = time.monotonic()
    forward_with_fault(workspaces, ranks, skip_counts=(1,))
    assert time.monotonic() - start < 20
    assert torch.equal(workspaces[0].control[CONTROL["err_stage"]:CONTROL["timeout_us"]], record)
    assert "in call 1," in first


def test_a_nan_reaches_only_the_outputs_of_the_tokens_it_touches(problem):
    """NaN in one token's x (rank 0) and in one expert's weights (expert 5, on rank 2): the forward's non-finite
    output rows are exactly that token's and those of the tokens routed to that expert."""
    ranks, full, bounds, workspaces = problem
    poisoned_token, poisoned_expert = 3, 5
    ranks = [list(p) for p in ranks]
    ranks[0][0] = ranks[0][0].clone()
    ranks[0][0][poisoned_token, 7] = float("nan")
    owner, local = divmod(poisoned_expert, CASE[2])
    ranks[owner][3] = ranks[owner][3].clone()
    ranks[owner][3][local, 0, 0] = float("nan")
    ys = loopback.loopback_forward(workspaces, [tuple(p) for p in ranks])
    idx = full[1]
    for r, y in enumerate(ys):
        touched = (idx[bounds[r]:bounds[r + 1]] == poisoned_expert).any(dim=1)
        if r == 0:
            touched[poisoned_token] = True
        assert torch.equal(~torch.isfinite(y).all(dim=1), touched), f"rank {r}"
    assert any(bool((idx[bounds[r]:bounds[r + 1]] == poisoned_expert).any()) for r in range(1, NUM_RANKS))
    # The debug mode's report names the first non-finite slot's expert and its owner.
    for r in range(1, NUM_RANKS):
        local_idx = idx[bounds[r]:bounds[r + 1]]
        message = first_non_finite(workspaces[r], local_idx)
        if bool((local_idx == poisoned_expert).any()):
            token, slot = (local_idx == poisoned_expert).nonzero()[0].tolist()
            assert message.endswith(f"token {token}, slot {slot}, from expert {poisoned_expert} on rank {owner} "
                                    "(the first such slot)"), message
        else:
            assert message is None


def test_a_rank_that_starts_the_backward_after_the_others_gave_up(problem):
    """Rank 1 reaches the backward only after the bound: the others' backward calls end with the error naming it
    (each waited for its counts); rank 1's late call ends too (it may find rows that the others, having given up,
    sent to the wrong places, so its record is not checked). After a reset every rank's backward is exact."""
    ranks, full, bounds, workspaces = problem
    dys = split_problem(CASE, NUM_RANKS)[3]
    num_experts, late = NUM_RANKS * CASE[2], 1
    plans = [build_plan(p[1], num_experts) for p in ranks]

    def backward_of(group):
        for r in group:
            exchange_counts(workspaces[r], plans[r])
        for r in group:
            x, idx, weights, _, _ = ranks[r]
            dispatch_rows(workspaces[r], x, idx, weights, plans[r], dy_TD=dys[r])
        for r in group:
            owner_experts_backward(workspaces[r], ranks[r][3], ranks[r][4])
        for r in group:
            combine_returned_backward(workspaces[r], ranks[r][1], ranks[r][0].dtype)

    backward_of([r for r in range(NUM_RANKS) if r != late])
    backward_of([late])
    end_of_call(workspaces)
    for r in range(NUM_RANKS):
        if r != late:
            with pytest.raises(RuntimeError, match=rf"on rank {r} .*peer rank {late}\b"):
                workspaces[r].check_error()
    for ws in workspaces:
        ws.reset()
    check = loopback.loopback_backward(workspaces, ranks, dys)
    _, dx, dweights, dw13, dw2 = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *full)
    num_local = CASE[2]
    for r, got in enumerate(check):
        tok, exp = slice(bounds[r], bounds[r + 1]), slice(r * num_local, (r + 1) * num_local)
        for name, a, b in zip(("dx", "d(routing weight)", "dw13", "dw2"), got, (dx[tok], dweights[tok], dw13[exp],
                                                                                    dw2[exp])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, r=r, n=name: f"rank {r}, {n}: {m}")
    assert all(ws.error() is None for ws in workspaces)
