"""The fused expert-parallel protocol's signalling: counts, flags, waits, the receive plan, and the combine of
the rows the owners send back. The senders (senders.py) and the owners' expert kernels (owner.py) build on it.

Shape legend as in workspace.py; E = R*L global experts; T, K this rank's tokens and slots; N = T*K.

Phases (each rank runs them in this order on its own stream; loopback.py runs each phase for every virtual
rank before the next phase, so that on one device no wait can precede its producer):

1. :func:`exchange_counts` — a new epoch, then my per-expert row counts into each owner's
   ``counts[epoch % 2, me, :]``, then ``counts_flag[epoch % 2, me] = epoch`` (release).
2. The senders (:mod:`megamoe.parallel.senders`) — wait for every source's counts at every owner
   (:func:`wait_all_counts`, acquire; every sending program waits, even one with no rows, which keeps every
   rank within one call of the others), compute where my rows of each expert land at the owner
   (:func:`dest_bases`: expert-major, then source rank — a fixed order, so results are deterministic), copy
   the rows and count them into the owner's ``arrived[me, l]`` (release). Rows past the owner's capacity are
   not written; they are counted in ``overflow`` (the owner's and mine) and reported by
   ``Workspace.check_overflow``, and counted as arrived so that no wait hangs on them.
3. and 4. The owner (:mod:`megamoe.parallel.owner`) — :func:`received_plan` (wait for every source's counts,
   the plan of the rows on their way), the expert kernels whose tiles wait for their rows
   (:func:`wait_rows`, :func:`wait_rows_upto`), :func:`reset_arrivals`, the output GEMM writing each row into
   its source's ``y_slots``, then :func:`signal_returned` (release).
5. :func:`combine_returned` — wait until every owner has signalled ``returned`` (acquire), reset it, and
   reduce each token's K slots in slot order (fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from megamoe.env import ep_unbounded_waits, interpreting
from megamoe.kernels.combine import combine
from megamoe.kernels.plan import Plan, plan_from_counts
from megamoe.kernels.quant import FP8, GROUP
from megamoe.parallel import workspace
from megamoe.parallel.workspace import BUFFER_INDEX, CONTROL, Workspace

# Most ranks the wait loops handle, as a constant the kernels can read.
MAX_EP_RANKS = tl.constexpr(workspace.MAX_EP_RANKS)
# Rows of the peer table (``Workspace.peers``), by buffer: the kernels' names for the buffers they reach.
COUNTS = tl.constexpr(BUFFER_INDEX["counts"])
COUNTS_FLAG = tl.constexpr(BUFFER_INDEX["counts_flag"])
ARRIVED = tl.constexpr(BUFFER_INDEX["arrived"])
RECV_TOKENS = tl.constexpr(BUFFER_INDEX["recv_tokens"])
RECV_TOKEN_ROW = tl.constexpr(BUFFER_INDEX["recv_token_row"])
RECV_X = tl.constexpr(BUFFER_INDEX["recv_x"])
RECV_META = tl.constexpr(BUFFER_INDEX["recv_meta"])
RECV_WEIGHT = tl.constexpr(BUFFER_INDEX["recv_weight"])
RECV_DY = tl.constexpr(BUFFER_INDEX["recv_dy"])
Y_SLOTS = tl.constexpr(BUFFER_INDEX["y_slots"])
SLOT_SCALAR = tl.constexpr(BUFFER_INDEX["slot_scalar"])
RETURNED = tl.constexpr(BUFFER_INDEX["returned"])
OVERFLOW = tl.constexpr(BUFFER_INDEX["overflow"])


# The control block's words (``epoch_ptr`` points at the block: its first word is the epoch).
ERR_STAGE = tl.constexpr(CONTROL["err_stage"])
ERR_PEER = tl.constexpr(CONTROL["err_peer"])
ERR_INDEX = tl.constexpr(CONTROL["err_index"])
ERR_EXPECTED = tl.constexpr(CONTROL["err_expected"])
ERR_SEEN = tl.constexpr(CONTROL["err_seen"])
ERR_EPOCH = tl.constexpr(CONTROL["err_epoch"])
TIMEOUT_US = tl.constexpr(CONTROL["timeout_us"])
POLL_LIMIT = tl.constexpr(CONTROL["poll_limit"])
# Stages of the error record (workspace.STAGES says what each waits for).
STAGE_COUNTS, STAGE_COUNTS_AT_OWNERS, STAGE_ROWS, STAGE_RESET, STAGE_RETURNED = (
    tl.constexpr(1), tl.constexpr(2), tl.constexpr(3), tl.constexpr(4), tl.constexpr(5))
# Bounded waits measure time with the GPU's global timer; Triton's interpreter has none, and counts polls.
CLOCK = tl.constexpr(not interpreting())
# Whether the waits are bounded at all: only MEGAMOE_EP_UNBOUNDED_WAITS=1 (measuring the bound's cost) compiles the
# bound out (part of every kernel's cache key, as a global constexpr).
BOUNDED = tl.constexpr(not ep_unbounded_waits())


@triton.jit
def wait_start():
    """The start of a bounded wait (ns on the global timer; 0 in the interpreter)."""
    if CLOCK:
        return globaltimer()
    else:
        return tl.zeros((), dtype=tl.int64)


@triton.jit
def gave_up(ctl_ptr, start, polls):
    """Whether a wait that started at ``start`` and has polled ``polls`` times stops: past the workspace's bound
    (``MEGAMOE_EP_TIMEOUT_S``), or another wait of this rank has given up already (then every wait of the rank
    returns at once, so one missing peer costs each rank one bound, not one per wait)."""
    if CLOCK:
        over = globaltimer() - start > tl.load(ctl_ptr + TIMEOUT_US).to(tl.int64) * 1000
    else:
        over = polls > tl.load(ctl_ptr + POLL_LIMIT)
    return over | (tl.load(ctl_ptr + ERR_STAGE, volatile=True) != 0)


@triton.jit
def record_give_up(ctl_ptr, stage, peer_rank, index, expected, seen):
    """The error record of this rank, if no wait has written one yet (the first one to give up wins)."""
    if tl.atomic_cas(ctl_ptr + ERR_STAGE, 0, stage, sem="relaxed", scope="gpu") == 0:
        tl.store(ctl_ptr + ERR_PEER, peer_rank)
        tl.store(ctl_ptr + ERR_INDEX, index)
        tl.store(ctl_ptr + ERR_EXPECTED, expected.to(tl.int32))
        tl.store(ctl_ptr + ERR_SEEN, seen.to(tl.int32))
        tl.store(ctl_ptr + ERR_EPOCH, tl.load(ctl_ptr))


@triton.jit
def wait_flags(flags, want, mask, ctl_ptr, stage, at_index, IDX, PER: tl.constexpr = 1):
    """Spin until ``flags[i] == want[i]`` wherever ``mask`` (acquire), or give up (:func:`gave_up`) and record
    the first flag that was not there: at position p of ``IDX`` (a vector of indices), peer p // PER and index
    ``at_index`` (or p % PER where ``at_index`` < 0). Returns whether every flag was there."""
    seen = tl.atomic_add(flags, 0, mask=mask, sem="acquire", scope="sys")
    missing = (seen != want) & mask
    start = wait_start()
    polls = 0
    go = tl.sum(missing.to(tl.int32), axis=0) > 0
    while go:
        seen = tl.atomic_add(flags, 0, mask=mask, sem="acquire", scope="sys")
        missing = (seen != want) & mask
        polls += 1
        go = tl.sum(missing.to(tl.int32), axis=0) > 0
        if BOUNDED:
            go = go & ~gave_up(ctl_ptr, start, polls)
    first = tl.min(tl.where(missing, IDX, 2147483647), axis=0)
    done = first == 2147483647
    if not done:
        at = IDX == first
        record_give_up(ctl_ptr, stage, first // PER, tl.where(at_index >= 0, at_index, first % PER),
                       tl.sum(tl.where(at, want, 0), axis=0), tl.sum(tl.where(at, seen, 0), axis=0))
    return done


@triton.jit
def peer(peers_ptr, buf: tl.constexpr, rank, R, ty: tl.constexpr):
    """Base pointer of buffer ``buf`` (a row index of the peer table) on ``rank`` (a scalar or a tensor of ranks)."""
    return tl.load(peers_ptr + buf * R + rank).to(tl.pointer_type(ty))


@triton.jit
def wait_rows(arrived_ptr, counts_ptr, ctl_ptr, first, e, E, R, EB: tl.constexpr):
    """Spin until every source's rows of my experts ``first`` to ``e`` (at most EB of them) are in my receive
    buffers (``arrived[s, l] == counts[s, l]`` for every source s; acquire). The backward's dh' tiles wait for
    their own expert (``first = e``, EB 1); the forward up tiles for every expert up to their own
    (:func:`wait_rows_upto`), since a token row they read was sent with the token's first slot at this owner,
    whose expert may be a lower one (``senders.send_rows``). The senders go expert by expert, so a tile whose
    rows are here starts at once either way. Bounded (:func:`gave_up`); the record names the source and the
    first expert whose rows were missing. Returns whether they all arrived."""
    srcs = tl.arange(0, MAX_EP_RANKS)[:, None]
    ls = first + tl.arange(0, EB)[None, :]
    m = (srcs < R) & (ls <= e)
    want = tl.load(counts_ptr + srcs * E + ls, mask=m, other=0)
    flat = srcs * EB + (ls - first)  # the (source, expert) pairs as one index, source-major
    seen = tl.atomic_add(arrived_ptr + srcs * E + ls, 0, mask=m, sem="acquire", scope="sys")
    missing = (seen != want) & m
    start = wait_start()
    polls = 0
    go = tl.sum(tl.sum(missing.to(tl.int32), axis=1), axis=0) > 0
    while go:
        seen = tl.atomic_add(arrived_ptr + srcs * E + ls, 0, mask=m, sem="acquire", scope="sys")
        missing = (seen != want) & m
        polls += 1
        go = tl.sum(tl.sum(missing.to(tl.int32), axis=1), axis=0) > 0
        if BOUNDED:
            go = go & ~gave_up(ctl_ptr, start, polls)
    first_missing = tl.min(tl.min(tl.where(missing, flat, 2147483647), axis=1), axis=0)
    done = first_missing == 2147483647
    if not done:
        at = flat == first_missing
        record_give_up(ctl_ptr, STAGE_ROWS, first_missing // EB, first + first_missing % EB,
                       tl.sum(tl.sum(tl.where(at, want, 0), axis=1), axis=0),
                       tl.sum(tl.sum(tl.where(at, seen, 0), axis=1), axis=0))
    return done


@triton.jit
def wait_rows_upto(arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, e, E, R, EB: tl.constexpr):
    """The forward up tile's wait (:func:`wait_rows` for experts 0..e), skipped when ``ready`` says another tile
    of this call has already seen them all in. ``ready`` (int64) holds epoch * (E + 1) + n once a tile of
    the call with that epoch has seen experts 0..n-1 in: only ever raised (atomic max), so it needs no reset,
    and an earlier call's value is below this call's base. Its release and acquire pass the senders'
    releases, which that tile acquired, on to this one. The full wait costs ~2 µs per tile whose rows are long
    in (docs/DESIGN.md, "Expert parallelism", the ready mark); this check, one atomic."""
    base = tl.load(epoch_ptr).to(tl.int64) * (E + 1)
    # Nested: the wait must run only where the mark says so (a Triton condition does not short-circuit).
    if tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu") <= base + e:  # noqa: SIM102
        if wait_rows(arrived_ptr, counts_ptr, epoch_ptr, 0, e, E, R, EB):  # a wait that gave up marks nothing
            tl.atomic_max(ready_ptr, base + e + 1, sem="release", scope="gpu")


@triton.jit
def wait_all_counts(peers_ptr, epoch_ptr, R, CB: tl.constexpr):
    """Spin until every owner has every source's counts of this call (acquire). Every sending program
    waits, even one with no rows to send: that wait is what keeps a rank from running two calls ahead
    of another (see workspace.py: the counts are double-buffered by the epoch's parity)."""
    epoch = tl.load(epoch_ptr)
    srcs = tl.arange(0, CB)
    for owner in range(R):
        flags = peer(peers_ptr, COUNTS_FLAG, owner, R, tl.int32) + (epoch % 2) * R + srcs
        wait_flags(flags, epoch + srcs * 0, srcs < R, epoch_ptr, STAGE_COUNTS_AT_OWNERS, owner, srcs)


@triton.jit
def dest_bases(es, peers_ptr, epoch_ptr, rank, R, L, CB: tl.constexpr):
    """Where my rows of each global expert of ``es`` start in its owner's receive buffer (0 past R*L
    experts): after the rows of the owner's lower local experts from every source, then those of this
    expert from lower source ranks. The counts at the owner are [src, l], flattened c = src * L + l."""
    parity = tl.load(epoch_ptr) % 2
    owner = es // L
    local = es % L
    cs = tl.arange(0, CB)
    counts = tl.load(peer(peers_ptr, COUNTS, owner, R, tl.int32)[:, None] + parity * R * L + cs[None, :],
                     mask=(es < R * L)[:, None] & (cs < R * L)[None, :], other=0)
    c_src = cs // L
    c_l = cs % L
    before = (c_l[None, :] < local[:, None]) | ((c_l[None, :] == local[:, None]) & (c_src[None, :] < rank))
    return tl.sum(tl.where(before, counts, 0), axis=1)


@triton.jit
def _exchange_counts_kernel(offsets_ptr, peers_ptr, epoch_ptr, rank, R, L, LB: tl.constexpr):
    owner = tl.program_id(0)
    ls = tl.arange(0, LB)
    e = owner * L + ls
    lmask = ls < L
    n = tl.load(offsets_ptr + e + 1, mask=lmask, other=0) - tl.load(offsets_ptr + e, mask=lmask, other=0)
    epoch = tl.load(epoch_ptr)
    parity = epoch % 2
    tl.store(peer(peers_ptr, COUNTS, owner, R, tl.int32) + (parity * R + rank) * L + ls, n, mask=lmask)
    tl.debug_barrier()  # every thread's counts before the one thread's (cumulative) release: see senders.send_rows
    tl.atomic_xchg(peer(peers_ptr, COUNTS_FLAG, owner, R, tl.int32) + parity * R + rank, epoch, sem="release",
                   scope="sys")


@triton.jit
def _wait_epoch_kernel(counts_flag_ptr, epoch_ptr, R, RB: tl.constexpr):
    """Spin until every source's counts of this call are in my ``counts`` (acquire; bounded)."""
    epoch = tl.load(epoch_ptr)
    srcs = tl.arange(0, RB)
    flags = counts_flag_ptr + (epoch % 2) * R + srcs
    wait_flags(flags, epoch + srcs * 0, srcs < R, epoch_ptr, STAGE_COUNTS, -1, srcs)


@triton.jit
def _wait_and_reset_kernel(counter_ptr, expected_ptr, n, epoch_ptr, STAGE: tl.constexpr, PER: tl.constexpr,
                           NB: tl.constexpr):
    """Spin until ``counter[i] == expected[i]`` for every i < n (acquire; bounded: the record's peer is i // PER,
    its index i % PER), then zero the counters."""
    i = tl.arange(0, NB)
    m = i < n
    want = tl.load(expected_ptr + i, mask=m, other=0)
    wait_flags(counter_ptr + i, want, m, epoch_ptr, STAGE, -1, i, PER)
    tl.store(counter_ptr + i, tl.zeros_like(want), mask=m)


@triton.jit
def _signal_returned_kernel(peers_ptr, rank, R, RB: tl.constexpr):
    """After my output GEMM (the previous kernel on this stream) has finished: 1 into every source's
    ``returned[me]`` (release, system scope: the GEMM's stores to the sources, peers' memory included,
    are visible before the flag)."""
    srcs = tl.arange(0, RB)
    tl.atomic_add(peer(peers_ptr, RETURNED, srcs, R, tl.int64) + rank, 1, mask=srcs < R, sem="release", scope="sys")

# The kernels without a tile config, for the ahead-of-time compile check (``tools.resources``).
KERNELS = (_exchange_counts_kernel, _wait_epoch_kernel, _wait_and_reset_kernel, _signal_returned_kernel)


def exchange_counts(ws: Workspace, plan: Plan) -> None:
    """Phase 1, which starts a call: a new epoch (on the device), then my counts to every owner."""
    ws.epoch.add_(1)
    _exchange_counts_kernel[(ws.num_ranks,)](
        offsets_ptr=plan.offsets_E1, peers_ptr=ws.peers, epoch_ptr=ws.epoch, rank=ws.rank, R=ws.num_ranks,
        L=ws.num_local, LB=triton.next_power_of_2(ws.num_local))


def current_counts(ws: Workspace) -> torch.Tensor:
    """(R, L) rows each source sends to each of my experts in the current call (the copy of the epoch's
    parity, picked on the device: no sync)."""
    return torch.where(ws.epoch % 2 == 0, ws.counts[0], ws.counts[1])


def received_plan(ws: Workspace) -> tuple[Plan, torch.Tensor]:
    """Wait for every source's counts (not its rows: the expert kernels wait for those, per expert), then
    the plan of the rows I am receiving — already expert-major, so built from the counts, with no sort;
    rows past the capacity, lost to an overflow, are not in it — and the current (R, L) counts."""
    _wait_epoch_kernel[(1,)](counts_flag_ptr=ws.counts_flag, epoch_ptr=ws.epoch, R=ws.num_ranks,
                             RB=triton.next_power_of_2(ws.num_ranks))
    counts = current_counts(ws)
    return plan_from_counts(counts.sum(dim=0, dtype=torch.int32), ws.capacity), counts


def reset_arrivals(ws: Workspace, counts: torch.Tensor) -> None:
    """Zero the arrival counters once every row has arrived (the expert kernel that waited for them has
    run, so this returns at once)."""
    _wait_and_reset_kernel[(1,)](counter_ptr=ws.arrived, expected_ptr=counts, n=counts.numel(), epoch_ptr=ws.control,
                                 STAGE=STAGE_RESET, PER=ws.num_local, NB=triton.next_power_of_2(counts.numel()))


def signal_returned(ws: Workspace) -> None:
    """After my output kernel: every source's ``returned[me]`` = 1 (release)."""
    _signal_returned_kernel[(1,)](peers_ptr=ws.peers, rank=ws.rank, R=ws.num_ranks,
                                  RB=triton.next_power_of_2(ws.num_ranks))


def wait_returned(ws: Workspace) -> None:
    """Until every owner has signalled that my rows are back (acquire); then reset the signals."""
    _wait_and_reset_kernel[(1,)](counter_ptr=ws.returned, expected_ptr=ws.one_per_rank, n=ws.num_ranks,
                                 epoch_ptr=ws.control, STAGE=STAGE_RETURNED, PER=1,
                                 NB=triton.next_power_of_2(ws.num_ranks))


def recv_tokens_fp8(ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """My received token rows when they travel in FP8 (``senders.dispatch_rows`` given x's scales): (q (R*T, D) e4m3,
    s (D/128, R*T) fp32, ``kernels.quant.quantize_rows``' layout), in ``recv_tokens``' memory: D + D/32 bytes per
    row, where it holds 2D (bf16) or 4D (fp32)."""
    rows, dim = ws.recv_tokens.shape
    raw = ws.recv_tokens.view(-1).view(torch.uint8)
    return (raw[: rows * dim].view(FP8).view(rows, dim),
            raw[rows * dim: rows * dim + rows * dim // 32].view(torch.float32).view(dim // GROUP, rows))


def combine_returned(ws: Workspace, topk_idx_TK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Phase 5: wait until every owner has written back every row I sent it (its signal, acquire), then
    each token's sum over its K slots."""
    wait_returned(ws)
    return combine(ws.y_slots[: topk_idx_TK.numel()], topk_idx_TK, out_dtype)


def first_non_finite(ws: Workspace, topk_idx_TK: torch.Tensor) -> str | None:
    """The first of my slots whose returned row (an expert's output, weighted; in the backward its dx part) holds
    a NaN or an infinity, as a message naming the token, the slot and the expert's owner; None if there is none.
    Reads back to the host (the debug mode, ``MEGAMOE_DEBUG=1``)."""
    experts = topk_idx_TK.reshape(-1)
    bad = ~torch.isfinite(ws.y_slots[: experts.numel()]).all(dim=1) & (experts >= 0)
    if not bool(bad.any()):
        return None
    slot = int(bad.nonzero()[0, 0])
    top_k, expert = topk_idx_TK.shape[1], int(experts[slot])
    return (f"megamoe (MEGAMOE_DEBUG): a non-finite expert output on rank {ws.rank}: token {slot // top_k}, slot "
            f"{slot % top_k}, from expert {expert} on rank {expert // ws.num_local} (the first such slot)")


def combine_returned_backward(ws: Workspace, topk_idx_TK: torch.Tensor, out_dtype: torch.dtype):
    """Phase 5 of the backward: dx (T, D) from the returned rows, and d(routing weight) (T, K) fp32 from the
    returned scalars (exact zero for a dropped slot)."""
    dx = combine_returned(ws, topk_idx_TK, out_dtype)
    returned = ws.slot_scalar[: topk_idx_TK.numel()].view(topk_idx_TK.shape)
    return dx, torch.where(topk_idx_TK >= 0, returned, 0.0)


# Bytes of the fixed-size fields a slot carries to its owner (senders.send_rows): forward its token's row index, slot
# id and routing weight (int32, int32, fp32); backward the slot id and weight; and back from the owner in the
# backward, d(routing weight) (fp32, ``slot_scalar``).
FWD_SLOT_FIELD_BYTES, BWD_SLOT_FIELD_BYTES, BWD_RETURN_FIELD_BYTES = 12, 8, 4


def bytes_between_ranks(topk_idx_TK: torch.Tensor, rank: int, experts_per_rank: int, dim: int,
                        itemsize: int, fp8_rows: bool = False) -> dict[str, int]:
    """What one call of the fused protocol moves between rank ``rank`` and the other ranks, in bytes, by the rules of
    ``senders.send_rows`` and the owners' output GEMMs (a rank's rows for its own experts stay on it and are not
    counted; nor are the counts and arrival counters, a few bytes per expert): ``fwd_out``, each token's row once
    per other rank whose experts it picked, and each such slot's fields; ``fwd_back``, each such slot's output row;
    ``bwd_out``, each such slot's x and dy rows and fields; ``bwd_back``, its dx row and d(routing weight).
    ``topk_idx_TK``: the rank's routing (-1: dropped); rows of ``dim`` elements of ``itemsize`` bytes. ``fp8_rows``:
    the FP8 layer's (keeping nothing, FP8 weight gradients): the forward's rows out in e4m3 with a 4-byte scale per
    128 elements, the backward's x and dy rows once per token and owner with the token's e4m3 row beside them, and
    each slot's token row index. Reads the routing on the host: for benchmarks and tests (tests/test_dispatch.py
    checks ``fwd_out``, and with ``fp8_rows`` ``bwd_out``, against what the owners received; the others follow from
    how the senders and output GEMMs write)."""
    owner = torch.div(topk_idx_TK, experts_per_rank, rounding_mode="floor")
    owner = torch.where((topk_idx_TK >= 0) & (owner != rank), owner, -1).sort(dim=1).values
    slots = int((owner >= 0).sum())
    token_rows = int(((owner[:, 1:] != owner[:, :-1]) & (owner[:, 1:] >= 0)).sum() + (owner[:, 0] >= 0).sum()) \
        if owner.numel() else 0
    row = dim * itemsize
    row_out = dim + 4 * (dim // GROUP) if fp8_rows else row
    bwd_out = (token_rows * (2 * row + row_out) + slots * FWD_SLOT_FIELD_BYTES if fp8_rows
               else slots * (2 * row + BWD_SLOT_FIELD_BYTES))
    return {"fwd_out": token_rows * row_out + slots * FWD_SLOT_FIELD_BYTES, "fwd_back": slots * row,
            "bwd_out": bwd_out, "bwd_back": slots * (row + BWD_RETURN_FIELD_BYTES)}
