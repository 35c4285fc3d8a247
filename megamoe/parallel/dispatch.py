"""The fused expert-parallel protocol, forward and backward: device-side counts exchange, dispatch of rows
into their owner's buffer, the owner's expert kernels writing their output rows straight into the
source's slots, and the source's deterministic combine. No host synchronisation anywhere; every wait is a spin on a flag in
device memory that a kernel of an *earlier* phase releases.

Shape legend as in workspace.py; E = R*L global experts; T, K this rank's tokens and slots; N = T*K.

Phases (each rank runs them in this order on its own stream; :func:`loopback_forward` runs each phase for
every virtual rank before the next phase, so that on one device no wait can precede its producer):

1. :func:`exchange_counts` — a new epoch, then my per-expert row counts into each owner's
   ``counts[epoch % 2, me, :]``, then ``counts_flag[epoch % 2, me] = epoch`` (release).
2. :func:`dispatch_rows` — wait for every source's counts at every owner (acquire; every program waits,
   even one with no rows, which keeps every rank within one call of the others), compute where my rows
   of each expert land at the owner (expert-major, then source rank: a fixed order, so results are
   deterministic), write their slot id and routing weight there, copy the rows — forward: each token's
   row once per owner, into ``recv_tokens`` (``_send_rows``); backward: x and dy once per slot, into
   ``recv_x`` / ``recv_dy`` — and count them into the owner's ``arrived[me, l]`` (release). Rows past
   the owner's capacity are not written; they are counted in ``overflow`` (the owner's and mine) and
   reported by ``Workspace.check_overflow`` (the call's output is wrong then), and counted as arrived so
   that no wait hangs on them.
3. and 4. :func:`owner_experts` — wait for every source's counts, build the plan of the rows on their
   way, run the one-GPU up + SwiGLU kernel on the received token rows — each tile first waits until
   the rows of its expert and the lower ones from every source are in (``arrived`` equals ``counts``,
   acquire; see ``expert_fwd._wait_rows_upto``), so experts whose rows are here compute while others' rows
   still travel — reset ``arrived``, then the down GEMM whose epilogue
   weights each row and writes it straight into its source's ``y_slots[slot]``; once it has finished, a
   one-program kernel adds 1 to every source's ``returned[me]`` (release). Backward
   (:func:`owner_experts_backward`): the same with the dy rows dispatched alongside x; the one-GPU fused
   backward runs on them, the dx GEMM writes dx rows and d(routing weight) straight into the source's
   slots, weight grads stay.
5. :func:`combine_returned` — wait until every owner has signalled ``returned`` (acquire), reset it, and
   reduce each token's K slots in slot order (fp32).

With ``comm_sms = N > 0`` phases 2 and 3 share one launch (:func:`send_and_up`, :func:`send_and_dh`): the
first N programs send my rows (local expert first, owner second: :func:`send_list`) while the others are
the expert kernel's tiles, which wait for their rows as above — communication on N SMs overlapping the
GEMM. Not yet: persistent expert kernels that pick ready tiles first (a waiting program holds its SM).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from megamoe.kernels.combine import combine
from megamoe.kernels.expert_bwd import (
    DX,
    act_bwd,
    expert_wgrad,
)
from megamoe.kernels.expert_fwd import (
    DOWN,
    UP,
    _busy_tiles,
    _rows_k_block,
    _sorted_rows_matmul,
    _stamp,
    _tile_rows,
    _up_swiglu_tile,
    _wait_rows,
    descriptor,
    dot_precision,
    persistent_programs,
    sorted_rows_gemm,
    tile_grid,
    up_swiglu_fwd,
)
from megamoe.kernels.plan import BLOCK_M, Plan, build_plan, plan_from_counts
from megamoe.kernels.tuning import TunedKernel, configs
from megamoe.parallel.workspace import Workspace


@triton.jit
def _peer(table_ptr, peer, ty: tl.constexpr):
    """Base pointer of ``peer``'s buffer (scalar or tensor of peers) from an address table."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(ty))


@triton.jit
def _exchange_counts_kernel(offsets_ptr, counts_tab, counts_flag_tab, epoch_ptr, rank, R, L, LB: tl.constexpr):
    owner = tl.program_id(0)
    ls = tl.arange(0, LB)
    e = owner * L + ls
    lmask = ls < L
    n = tl.load(offsets_ptr + e + 1, mask=lmask, other=0) - tl.load(offsets_ptr + e, mask=lmask, other=0)
    epoch = tl.load(epoch_ptr)
    parity = epoch % 2
    tl.store(_peer(counts_tab, owner, tl.int32) + (parity * R + rank) * L + ls, n, mask=lmask)
    tl.debug_barrier()  # every thread's counts before the one thread's (cumulative) release: see _send_rows
    tl.atomic_xchg(_peer(counts_flag_tab, owner, tl.int32) + parity * R + rank, epoch, sem="release", scope="sys")


@triton.jit
def _dispatch_rows_kernel(
    x_ptr,  # (T, D) my tokens
    dy_ptr,  # (T, D) their output gradient (backward; unused unless HAS_DY)
    weights_ptr,  # (N,) my routing weights, flat slots
    row_slot_ptr, offsets_ptr,  # my plan over the E global experts
    topk_idx_ptr,  # (T, K) my routing (forward: which of a token's slots carries its row to an owner)
    counts_tab, counts_flag_tab, recv_tokens_tab, recv_token_row_tab, recv_x_tab, recv_dy_tab, recv_meta_tab,
    recv_weight_tab, arrived_tab, overflow_tab, epoch_ptr,
    rank, R, L, D, top_k, capacity, max_tokens, max_slots,
    HAS_DY: tl.constexpr, RB: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr,
    BD: tl.constexpr,
):
    """Phase 2 as its own kernel: program i sends my sorted rows [i*RB, (i+1)*RB)."""
    _wait_all_counts(counts_flag_tab, epoch_ptr, R, CB)
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    rows = tl.where(rows < tl.load(offsets_ptr + R * L), rows, -1)
    e = _experts_of_rows(rows, offsets_ptr, R * L, EB)
    dst = _dest_bases(e, counts_tab, epoch_ptr, rank, R, L, CB) + rows - tl.load(offsets_ptr + e)
    slots = tl.where(rows >= 0, tl.load(row_slot_ptr + rows, mask=rows >= 0, other=0), -1)
    carries = slots * 0
    if not HAS_DY:
        carries = _carries_row(slots, e, topk_idx_ptr, L, top_k, KB)
    _send_rows(slots, e, dst, carries, x_ptr, dy_ptr, weights_ptr, recv_tokens_tab, recv_token_row_tab, recv_x_tab,
               recv_dy_tab, recv_meta_tab, recv_weight_tab, arrived_tab, overflow_tab, rank, L, D, top_k, capacity,
               max_tokens, max_slots, HAS_DY, RB, BD)


@triton.jit
def _wait_all_counts(counts_flag_tab, epoch_ptr, R, CB: tl.constexpr):
    """Spin until every owner has every source's counts of this call (acquire). Every sending program
    waits, even one with no rows to send: that wait is what keeps a rank from running two calls ahead
    of another (see workspace.py: the counts are double-buffered by the epoch's parity)."""
    epoch = tl.load(epoch_ptr)
    srcs = tl.arange(0, CB)
    for owner in range(R):
        flags = _peer(counts_flag_tab, owner, tl.int32) + (epoch % 2) * R + srcs
        while tl.sum((tl.atomic_add(flags, 0, mask=srcs < R, sem="acquire", scope="sys") != epoch)
                     & (srcs < R), axis=0) > 0:
            pass


@triton.jit
def _experts_of_rows(rows, offsets_ptr, E, EB: tl.constexpr):
    """Global expert of each of my sorted ``rows`` (-1: none; its expert is any valid one): the number of
    experts whose rows end at or before it."""
    es = tl.arange(0, EB)
    ends = tl.load(offsets_ptr + es + 1, mask=es < E, other=2147483647)
    return tl.minimum(tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1), E - 1)


@triton.jit
def _dest_bases(es, counts_tab, epoch_ptr, rank, R, L, CB: tl.constexpr):
    """Where my rows of each global expert of ``es`` start in its owner's receive buffer (0 past R*L
    experts): after the rows of the owner's lower local experts from every source, then those of this
    expert from lower source ranks. The counts at the owner are [src, l], flattened c = src * L + l."""
    parity = tl.load(epoch_ptr) % 2
    owner = es // L
    local = es % L
    cs = tl.arange(0, CB)
    counts = tl.load(_peer(counts_tab, owner, tl.int32)[:, None] + parity * R * L + cs[None, :],
                     mask=(es < R * L)[:, None] & (cs < R * L)[None, :], other=0)
    c_src = cs // L
    c_l = cs % L
    before = (c_l[None, :] < local[:, None]) | ((c_l[None, :] == local[:, None]) & (c_src[None, :] < rank))
    return tl.sum(tl.where(before, counts, 0), axis=1)


@triton.jit
def _carries_row(slot, e, topk_idx_ptr, L, top_k, KB: tl.constexpr):
    """1 where slot ``slot`` (-1: none) of global expert ``e`` is its token's first slot at that expert's
    owner in the senders' order (lowest local expert, then slot; KB >= top_k), else 0: the one slot that
    carries the token's row there in the forward. Dropped slots (expert -1) have no owner."""
    rmask = slot >= 0
    owner = e // L
    local = e % L
    ks = tl.arange(0, KB)
    picks = tl.load(topk_idx_ptr + (slot // top_k).to(tl.int64)[:, None] * top_k + ks[None, :],
                    mask=rmask[:, None] & (ks < top_k)[None, :], other=-1)
    pick_local = picks % L
    before = (picks >= 0) & (picks // L == owner[:, None]) & (
        (pick_local < local[:, None]) | ((pick_local == local[:, None]) & (ks[None, :] < (slot % top_k)[:, None])))
    return (rmask & (tl.sum(before.to(tl.int32), axis=1) == 0)).to(tl.int32)


# The senders' trace (``megamoe.bench.sender_trace``; off unless ``SENDER_TRACE`` is a dict, which then holds each
# traced launch's stamps by kernel, "up" or "dh": :func:`_trace_buffer`) of the send + up and send + dh' kernels:
# the GPU's global timer (ns) at fixed points, per sending program TRACE_HEAD stamps (start, counts in, end) and
# TRACE_PER_BLOCK per block for its first TRACE_BLOCKS blocks (start; copies issued; metadata stored; released;
# and, as the next block's start, the overflow counts and the next entries), then per GEMM tile program
# TRACE_PER_TILE (start; its rows in, if it has any; end). -1: no stamp.
TRACE_HEAD, TRACE_PER_BLOCK, TRACE_BLOCKS, TRACE_PER_TILE = tl.constexpr(3), tl.constexpr(4), tl.constexpr(128), \
    tl.constexpr(3)
TRACE_STRIDE = tl.constexpr(TRACE_HEAD.value + TRACE_PER_BLOCK.value * TRACE_BLOCKS.value)  # stamps per sender
SENDER_TRACE: dict | None = None


@triton.jit
def _tile_trace_at(pid, SENDERS: tl.constexpr):
    """Where GEMM tile program ``pid`` (>= SENDERS) of a sending kernel's launch stamps, after the senders'."""
    return SENDERS * TRACE_STRIDE + TRACE_PER_TILE * (pid - SENDERS)


@triton.jit
def _send_rows(slot, e, dst, carries, x_ptr, dy_ptr, weights_ptr, recv_tokens_tab, recv_token_row_tab, recv_x_tab,
               recv_dy_tab, recv_meta_tab, recv_weight_tab, arrived_tab, overflow_tab, rank, L, D, top_k, capacity,
               max_tokens, max_slots, HAS_DY: tl.constexpr, RB: tl.constexpr, BD: tl.constexpr,
               trace_ptr=None, trace_at=-1, TRACE: tl.constexpr = False):
    """My rows of slots ``slot`` (RB of them; -1: none) of global experts ``e`` into their owners' receive
    buffers at rows ``dst`` (the caller waited for the counts: ``_wait_all_counts``): each row's slot id and
    routing weight, and its token's row of x —
    - forward (not HAS_DY): into the owner's ``recv_tokens`` at row ``rank * max_tokens + token``, by the
      slots where ``carries`` is 1 (:func:`_carries_row`), whatever the slot's ``dst``; the owner's up kernel
      reads it through ``recv_token_row``. A token that picked several of an owner's experts crosses NVLink
      once;
    - backward (HAS_DY): x and dy rows into ``recv_x`` / ``recv_dy`` at ``dst``, one per slot (the weight
      gradients read them there as expert-sorted rows); ``carries`` is not read.
    The validity travels as -1 rather than as a mask argument: Triton 3.6 fails to compile a boolean tensor
    passed to a called function (sm_90a: "failed to legalize unresolved materialization ...
    tensor<64xi1>"). TRACE: stamps ``trace_at + 1..3`` (see SENDER_TRACE)."""
    rmask = slot >= 0  # every access below is masked by it (an early return here fails to compile too)
    owner = e // L
    local = e % L
    fits = rmask & (dst < capacity)
    weight = tl.load(weights_ptr + slot, mask=fits, other=0.0)  # issued before the copy, which hides its latency
    tok = (slot // top_k).to(tl.int64)
    dst64 = dst.to(tl.int64)
    if HAS_DY:
        copies = fits
        # Each destination row's start in the owner's buffers, 16-byte aligned (see the output kernel below).
        x_rows = tl.multiple_of(_peer(recv_x_tab, owner, x_ptr.dtype.element_ty) + dst64 * D, 16)
        dy_rows = tl.multiple_of(_peer(recv_dy_tab, owner, x_ptr.dtype.element_ty) + dst64 * D, 16)
    else:
        copies = rmask & (carries != 0)
        token_row = rank * max_tokens + tok
        x_rows = tl.multiple_of(_peer(recv_tokens_tab, owner, x_ptr.dtype.element_ty) + token_row * D, 16)
        tl.store(_peer(recv_token_row_tab, owner, tl.int32) + dst64, token_row.to(tl.int32), mask=fits)
    # Pipelined (cp.async through shared memory): a sending program is one block on its SM, so its loads
    # must overlap one another to move more than one chunk per memory latency.
    for d0 in tl.range(0, D, BD, num_stages=4):
        ds = d0 + tl.arange(0, BD)
        m = copies[:, None] & (ds < D)[None, :]
        src = tok[:, None] * D + ds[None, :]
        tl.store(x_rows[:, None] + ds[None, :], tl.load(x_ptr + src, mask=m), mask=m)
        if HAS_DY:
            tl.store(dy_rows[:, None] + ds[None, :], tl.load(dy_ptr + src, mask=m), mask=m)
    _stamp(trace_ptr, trace_at, 1, TRACE)
    tl.store(_peer(recv_meta_tab, owner, tl.int32) + dst64, rank * max_slots + slot, mask=fits)
    tl.store(_peer(recv_weight_tab, owner, tl.float32) + dst64, weight.to(tl.float32), mask=fits)
    _stamp(trace_ptr, trace_at, 2, TRACE)
    # Count the rows into their owners' arrivals: one release per expert among them, by one thread, after
    # a barrier of the whole block — the barrier orders every thread's row stores before that thread's
    # release, and a release at system scope is cumulative, so the owner that acquires the count sees
    # the rows. A row that did not fit is counted too, so that no wait hangs on it, and in the owner's
    # and my ``overflow``.
    idx = tl.arange(0, RB)
    same = (e[:, None] == e[None, :]) & rmask[None, :]
    first = rmask & (tl.min(tl.where(same, idx[None, :], RB), axis=1) == idx)
    tl.debug_barrier()
    tl.atomic_add(_peer(arrived_tab, owner, tl.int32) + rank * L + local, tl.sum(same.to(tl.int32), axis=1),
                  mask=first, sem="release", scope="sys")
    _stamp(trace_ptr, trace_at, 3, TRACE)
    lost = rmask & (dst >= capacity)
    tl.atomic_add(_peer(overflow_tab, owner, tl.int32), 1, mask=lost, sem="relaxed", scope="sys")
    tl.atomic_add(_peer(overflow_tab, rank, tl.int32), tl.sum(lost.to(tl.int32), axis=0), sem="relaxed", scope="sys")


@triton.jit
def _send_list_block(block, send_list_ptr, num_rows, RB: tl.constexpr):
    """Entries [block*RB, (block+1)*RB) of :func:`send_list` (slot -1, expert 0 past its end)."""
    pos = block * RB + tl.arange(0, RB)
    m = pos < num_rows
    return (tl.load(send_list_ptr + pos, mask=m, other=-1), tl.load(send_list_ptr + num_rows + pos, mask=m, other=0),
            tl.load(send_list_ptr + 2 * num_rows + pos, mask=m, other=0),
            tl.load(send_list_ptr + 3 * num_rows + pos, mask=m, other=0))


@triton.jit
def _sender(pid, x_ptr, dy_ptr, weights_ptr, send_list_ptr, num_rows, counts_tab, counts_flag_tab,
            recv_tokens_tab, recv_token_row_tab, recv_x_tab, recv_dy_tab, recv_meta_tab, recv_weight_tab, arrived_tab,
            overflow_tab, epoch_ptr, rank, R, L, D, top_k, capacity, max_tokens, max_slots, HAS_DY: tl.constexpr,
            SENDERS: tl.constexpr, RB: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr,
            trace_ptr=None, TRACE: tl.constexpr = False):
    """Sending program ``pid`` of SENDERS in an expert kernel's launch: once the counts are in, blocks pid,
    pid + SENDERS, ... (RB rows each) of my ``num_rows`` rows in the order of :func:`send_list` — local expert
    first, then owner — so that every owner receives its first experts' rows from every source first and its
    tiles can start while later experts' rows travel. TRACE: its stamps (see SENDER_TRACE)."""
    head = pid * TRACE_STRIDE
    _stamp(trace_ptr, head, 0, TRACE)
    _wait_all_counts(counts_flag_tab, epoch_ptr, R, CB)
    os_ = tl.arange(0, EB)
    # Once per program rather than per block: every expert's start at its owner (from the owners' counts,
    # across NVLink with real ranks), indexed by global expert.
    bases = _dest_bases(os_, counts_tab, epoch_ptr, rank, R, L, CB)
    slot, e, index, carries = _send_list_block(pid, send_list_ptr, num_rows, RB)
    _stamp(trace_ptr, head, 1, TRACE)
    for block in range(pid, tl.cdiv(num_rows, RB), SENDERS):
        j = (block - pid) // SENDERS
        trace_at = tl.where(j < TRACE_BLOCKS, head + TRACE_HEAD + j * TRACE_PER_BLOCK, -1)
        _stamp(trace_ptr, trace_at, 0, TRACE)
        # The next block's entries load while this block's rows are copied: a sender's time is a chain of
        # memory latencies per block (docs/NOTES.md §36), and this takes one out of it.
        next_slot, next_e, next_index, next_carries = _send_list_block(block + SENDERS, send_list_ptr, num_rows, RB)
        dst = tl.sum(tl.where(e[:, None] == os_[None, :], bases[None, :], 0), axis=1) + index
        _send_rows(slot, e, dst, carries, x_ptr, dy_ptr, weights_ptr, recv_tokens_tab, recv_token_row_tab, recv_x_tab,
                   recv_dy_tab, recv_meta_tab, recv_weight_tab, arrived_tab, overflow_tab, rank, L, D, top_k, capacity,
                   max_tokens, max_slots, HAS_DY, RB, BD, trace_ptr, trace_at, TRACE)
        slot, e, index, carries = next_slot, next_e, next_index, next_carries
    _stamp(trace_ptr, head, 2, TRACE)


@triton.jit
def _send_and_up_kernel(
    # Programs [0, SENDERS): phase 2, as _dispatch_rows_kernel (rows in blocks of RB, strided over them).
    x_ptr, weights_ptr, send_list_ptr,
    counts_tab, counts_flag_tab, recv_tokens_tab, recv_token_row_tab, recv_meta_tab, recv_weight_tab, arrived_tab,
    overflow_tab, epoch_ptr, rank, R, L, top_k, capacity, max_tokens, max_slots, num_rows,
    # Programs SENDERS and up: the up kernel on my received token rows (its plan: recv_*, rows gathered
    # through recv_token_row), each tile waiting for the rows of its expert and the lower ones (arrived,
    # counts: (R, L); LB >= L).
    recv_tokens_ptr, w13_desc, h_ptr, recv_token_row_ptr, recv_offsets_ptr, tile_expert_ptr, tile_row_ptr,
    arrived_ptr, counts_ptr, ready_ptr, D, I,  # ready: see expert_fwd._wait_rows_upto
    trace_ptr,  # read if TRACE (see SENDER_TRACE)
    SENDERS: tl.constexpr, RB: tl.constexpr, LB: tl.constexpr, EB: tl.constexpr,
    CB: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, TRACE: tl.constexpr,
):
    """Phases 2 and 3 in one launch: the first SENDERS programs send my rows while the others compute on
    the rows that have arrived — communication on SENDERS SMs, overlapping the up GEMM. No deadlock: the
    senders are the grid's first programs, so they are resident before any computing program can wait,
    and they wait only for counts, which every rank wrote before this launch (docs/DESIGN_NOTES.md)."""
    pid = tl.program_id(0)
    if pid < SENDERS:
        _sender(pid, x_ptr, x_ptr, weights_ptr, send_list_ptr, num_rows, counts_tab, counts_flag_tab,
                recv_tokens_tab, recv_token_row_tab, recv_tokens_tab, recv_tokens_tab, recv_meta_tab, recv_weight_tab,
                arrived_tab, overflow_tab, epoch_ptr, rank, R, L, D, top_k, capacity, max_tokens, max_slots, False,
                SENDERS, RB, EB, CB, BD, trace_ptr, TRACE)
    else:
        tile_at = _tile_trace_at(pid, SENDERS)
        _stamp(trace_ptr, tile_at, 0, TRACE)
        _up_swiglu_tile(pid - SENDERS, recv_tokens_ptr, w13_desc, h_ptr, recv_token_row_ptr, recv_offsets_ptr,
                        tile_expert_ptr, tile_row_ptr, arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, D, I, L, 1, R, LB,
                        PREC, TILE_M, BM, BN, BK, EVEN_K, trace_ptr, tile_at, TRACE)
        _stamp(trace_ptr, tile_at, 2, TRACE)


@triton.jit
def _dh_rows_tile(pid, dy_ptr, w2_desc, dh_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, arrived_ptr, counts_ptr,
                  D, I, L, R, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, EVEN_K: tl.constexpr, trace_ptr, trace_at, TRACE: tl.constexpr):
    """One BM x BN block of dh' = dy W2[e] on my received dy rows (expert-major: each row its own slot),
    once every source's rows of its expert are in; rows past the expert's end are not written. dy is read
    through pointers: TMA reads through the async proxy, which the acquire does not order (docs/NOTES.md §16).
    TRACE: stamps ``trace_at + 1`` once the rows are in (see SENDER_TRACE)."""
    e, _, rows, rmask, pid_n = _tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, tl.cdiv(I, BN), BM, TILE_M)
    if e >= L:
        return
    _wait_rows(arrived_ptr, counts_ptr, e, e, L, R, 1)
    _stamp(trace_ptr, trace_at, 1, TRACE)
    n0 = pid_n * BN
    ks = tl.arange(0, BK)
    rows64 = rows[:, None].to(tl.int64)
    a_ptrs = dy_ptr + rows64 * D + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        a = _rows_k_block(a_ptrs, rmask, ks, k0, D, EVEN_K)
        # The descriptor zero-fills past D and past the expert's I columns.
        b = w2_desc.load([e, k0, n0]).reshape(BK, BN)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BK
    cols = n0 + tl.arange(0, BN)
    tl.store(dh_ptr + rows64 * I + cols[None, :], acc.to(dh_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols < I)[None, :])


@triton.jit
def _send_and_dh_kernel(
    # Programs [0, SENDERS): phase 2 of the backward (x and dy rows), as in _send_and_up_kernel.
    x_ptr, dy_ptr, weights_ptr, send_list_ptr,
    counts_tab, counts_flag_tab, recv_x_tab, recv_dy_tab, recv_meta_tab, recv_weight_tab, arrived_tab, overflow_tab,
    epoch_ptr, rank, R, L, top_k, capacity, max_slots, num_rows,
    # Programs SENDERS and up: dh' on my received dy rows (_dh_rows_tile), each tile waiting for its expert's rows.
    recv_dy_ptr, w2_desc, dh_ptr, recv_offsets_ptr, tile_expert_ptr, tile_row_ptr, arrived_ptr, counts_ptr, D, I,
    trace_ptr,  # read if TRACE (see SENDER_TRACE)
    SENDERS: tl.constexpr, RB: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, TRACE: tl.constexpr,
):
    """The backward's phase 2 and its first GEMM in one launch (see _send_and_up_kernel, whose
    no-deadlock argument this shares). SENDERS = 0: the GEMM alone, on rows another launch sends."""
    pid = tl.program_id(0)
    if pid < SENDERS:
        # (The forward's token-row arguments are unread here: rows go per slot, to recv_x and recv_dy.)
        _sender(pid, x_ptr, dy_ptr, weights_ptr, send_list_ptr, num_rows, counts_tab, counts_flag_tab,
                recv_x_tab, recv_meta_tab, recv_x_tab, recv_dy_tab, recv_meta_tab, recv_weight_tab, arrived_tab,
                overflow_tab, epoch_ptr, rank, R, L, D, top_k, capacity, 0, max_slots, True, SENDERS, RB, EB, CB, BD,
                trace_ptr, TRACE)
    else:
        tile_at = _tile_trace_at(pid, SENDERS)
        _stamp(trace_ptr, tile_at, 0, TRACE)
        _dh_rows_tile(pid - SENDERS, recv_dy_ptr, w2_desc, dh_ptr, recv_offsets_ptr, tile_expert_ptr, tile_row_ptr,
                      arrived_ptr, counts_ptr, D, I, L, R, PREC, TILE_M, BM, BN, BK, EVEN_K, trace_ptr, tile_at, TRACE)
        _stamp(trace_ptr, tile_at, 2, TRACE)


@triton.jit
def _send_list_kernel(row_slot_ptr, offsets_ptr, topk_idx_ptr, send_list_ptr, num_rows, R, L, top_k,
                      CARRIES: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, BLOCK: tl.constexpr):
    """Programs (e, c), e < E, write my rows of global expert e into :func:`send_list`, after the segments that
    precede its own: those of every lower local expert, then those of its local expert at lower owners;
    with CARRIES, which of them carry their token's row (:func:`_carries_row`), else 0. Programs (E, c) mark
    the entries of the dropped slots, past the routed rows, as none (slot -1). Program c of a segment's C
    takes its blocks c, c + C, ... of BLOCK rows: a popular expert's rows are not one program's serial loop."""
    e = tl.program_id(0)
    c = tl.program_id(1)
    C = tl.num_programs(1)
    E = R * L
    es = tl.arange(0, EB)
    em = es < E
    sizes = tl.load(offsets_ptr + es + 1, mask=em, other=0) - tl.load(offsets_ptr + es, mask=em, other=0)
    before = ((es % L) < e % L) | (((es % L) == e % L) & (es // L < e // L))
    start = tl.where(e < E, tl.sum(tl.where(before & em, sizes, 0), axis=0), tl.load(offsets_ptr + E))
    row0 = tl.load(offsets_ptr + e)
    n = tl.where(e < E, tl.load(offsets_ptr + e + 1, mask=e < E, other=0), num_rows) - row0
    for i0 in range(c * BLOCK, n, C * BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        pos = send_list_ptr + start + i
        slot = tl.load(row_slot_ptr + row0 + i, mask=m & (e < E), other=-1)
        expert = tl.where(e < E, e, 0) + tl.zeros([BLOCK], tl.int32)
        tl.store(pos, slot, mask=m)
        tl.store(pos + num_rows, expert, mask=m)
        tl.store(pos + 2 * num_rows, i, mask=m)
        carries = tl.zeros([BLOCK], tl.int32)
        if CARRIES:
            carries = _carries_row(slot, expert, topk_idx_ptr, L, top_k, KB)
        tl.store(pos + 3 * num_rows, carries, mask=m)


@triton.jit
def _wait_epoch_kernel(counts_flag_ptr, epoch_ptr, R, RB: tl.constexpr):
    """Spin until every source's counts of this call are in my ``counts`` (acquire)."""
    epoch = tl.load(epoch_ptr)
    srcs = tl.arange(0, RB)
    flags = counts_flag_ptr + (epoch % 2) * R + srcs
    while tl.sum((tl.atomic_add(flags, 0, mask=srcs < R, sem="acquire", scope="sys") != epoch) & (srcs < R),
                 axis=0) > 0:
        pass


@triton.jit
def _wait_and_reset_kernel(counter_ptr, expected_ptr, n, NB: tl.constexpr):
    """Spin until ``counter[i] == expected[i]`` for every i < n (acquire), then zero the counters."""
    i = tl.arange(0, NB)
    m = i < n
    want = tl.load(expected_ptr + i, mask=m, other=0)
    while tl.sum((tl.atomic_add(counter_ptr + i, 0, mask=m, sem="acquire", scope="sys") != want) & m, axis=0) > 0:
        pass
    tl.store(counter_ptr + i, tl.zeros_like(want), mask=m)


@triton.jit
def _rows_to_peer_slots_kernel(
    a_desc,  # (C, K) my received rows (or their dz); block (BM, BK)
    w_desc,  # my experts: (L, N_OUT, K) if W_K_LAST, block (1, BN, BK); else (L, K, N_OUT), block (1, BK, BN)
    weights_ptr,  # (C,) routing weight of each received row (read if WEIGHTED)
    scalar_ptr,  # (C,) fp32 per received row, sent along to the source's slot_scalar (if SCALAR)
    recv_meta_ptr,  # (C,) src * S + slot of each received row
    y_slots_tab, slot_scalar_tab,
    offsets_ptr, tile_expert_ptr, tile_row_ptr,  # the plan of my received rows
    N_OUT, K, E, max_slots,
    PROGRAMS,  # the grid's size; read only if PERSISTENT
    W_K_LAST: tl.constexpr, WEIGHTED: tl.constexpr, SCALAR: tl.constexpr, PERSISTENT: tl.constexpr,
    EB: tl.constexpr, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):
    """The down projection (forward) or dx (backward) of my experts, written straight into the source
    rank's slot rows: no output buffer here, no copy afterwards. Plain stores: the sources learn that
    their rows are whole from :func:`_signal_returned_kernel`, launched after this kernel (a release per
    tile, the first version, made this GEMM 1.7x slower than the one-device one; docs/NOTES.md §9).
    PERSISTENT as for the one-device twin (``expert_fwd._sorted_rows_gemm_kernel``): PROGRAMS programs
    stride over the busy tiles, so one tile's stores into the peers overlap the next tile's loads."""
    num_n = tl.cdiv(N_OUT, BN)
    if PERSISTENT:
        work = _busy_tiles(offsets_ptr, E, EB, TILE_M) * (TILE_M // BM) * num_n
        for pid in tl.range(tl.program_id(0), work, PROGRAMS, flatten=True):
            _rows_to_peer_slots_tile(pid, a_desc, w_desc, weights_ptr, scalar_ptr, recv_meta_ptr, y_slots_tab,
                                     slot_scalar_tab, offsets_ptr, tile_expert_ptr, tile_row_ptr, N_OUT, K, E,
                                     max_slots, num_n, W_K_LAST, WEIGHTED, SCALAR, False, PREC, TILE_M, BM, BN, BK)
    else:
        _rows_to_peer_slots_tile(tl.program_id(0), a_desc, w_desc, weights_ptr, scalar_ptr, recv_meta_ptr,
                                 y_slots_tab, slot_scalar_tab, offsets_ptr, tile_expert_ptr, tile_row_ptr, N_OUT, K,
                                 E, max_slots, num_n, W_K_LAST, WEIGHTED, SCALAR, True, PREC, TILE_M, BM, BN, BK)


@triton.jit
def _rows_to_peer_slots_tile(pid, a_desc, w_desc, weights_ptr, scalar_ptr, recv_meta_ptr, y_slots_tab,
                             slot_scalar_tab, offsets_ptr, tile_expert_ptr, tile_row_ptr, N_OUT, K, E, max_slots,
                             num_n, W_K_LAST: tl.constexpr, WEIGHTED: tl.constexpr, SCALAR: tl.constexpr,
                             SKIP_IDLE: tl.constexpr, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr):
    """One BM x BN output block of ``_rows_to_peer_slots_kernel``. SKIP_IDLE: return on an idle tile (a
    persistent caller visits busy tiles only)."""
    e, row0, rows, rmask, pid_n = _tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, BM, TILE_M)
    if SKIP_IDLE and e >= E:
        return
    n0 = pid_n * BN
    acc = _sorted_rows_matmul(a_desc, w_desc, e, row0, n0, K, W_K_LAST, BM, BN, BK, PREC)
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + rows, mask=rmask, other=0.0)[:, None]
    meta = tl.load(recv_meta_ptr + rows, mask=rmask, other=0)
    src = meta // max_slots
    slot = (meta % max_slots).to(tl.int64)
    cols = n0 + tl.arange(0, BN)
    # Each row's first element at its source; 16-byte aligned (rows are 16-byte multiples, buffers
    # aligned), which lets the compiler store 16 bytes at a time (it cannot know it for loaded pointers).
    out_rows = tl.multiple_of(_peer(y_slots_tab, src, a_desc.dtype) + slot * N_OUT, 16)
    tl.store(out_rows[:, None] + cols[None, :], acc.to(a_desc.dtype), mask=rmask[:, None] & (cols < N_OUT)[None, :])
    if SCALAR:  # by the first N-block; a mask, not an `if`: a branch on it fails to compile in the persistent loop
        first = rmask & (pid_n == 0)
        tl.store(_peer(slot_scalar_tab, src, tl.float32) + slot, tl.load(scalar_ptr + rows, mask=first), mask=first)


@triton.jit
def _return_rows_kernel(recv_tokens_ptr, recv_token_row_ptr, recv_meta_ptr, offsets_ptr, y_slots_tab, L, D, max_slots,
                        RB: tl.constexpr, BD: tl.constexpr):
    """Communication only (no experts): every row I received (its token's row), unchanged, into its
    source's slot."""
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    rmask = rows < tl.load(offsets_ptr + L)
    token_rows = tl.load(recv_token_row_ptr + rows, mask=rmask, other=0).to(tl.int64)
    meta = tl.load(recv_meta_ptr + rows, mask=rmask, other=0)
    out_rows = tl.multiple_of(_peer(y_slots_tab, meta // max_slots, recv_tokens_ptr.dtype.element_ty)
                              + (meta % max_slots).to(tl.int64) * D, 16)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        m = rmask[:, None] & (ds < D)[None, :]
        tl.store(out_rows[:, None] + ds[None, :], tl.load(recv_tokens_ptr + token_rows[:, None] * D + ds[None, :],
                                                           mask=m), mask=m)


@triton.jit
def _signal_returned_kernel(returned_tab, rank, R, RB: tl.constexpr):
    """After my output GEMM (the previous kernel on this stream) has finished: 1 into every source's
    ``returned[me]`` (release, system scope: the GEMM's stores to the sources, peers' memory included,
    are visible before the flag)."""
    srcs = tl.arange(0, RB)
    tl.atomic_add(_peer(returned_tab, srcs, tl.int64) + rank, 1, mask=srcs < R, sem="release", scope="sys")


# The owners' output GEMMs: the tiles of the one-device DOWN / DX kernels, the peer epilogue above.
# Their stores go into other ranks' memory, so they are not autotuned (each config tried would write
# there again, and the timing would be of NVLink traffic): they take the tiles and the launch mode
# (PERSISTENT) DOWN / DX chose on the same operands. (The first version also counted its columns at the
# sources, and hung when autotuned.)
DOWN_PEER = TunedKernel(_rows_to_peer_slots_kernel, default=DOWN.default, candidates=[], key=DOWN.key,
                        even_k=None, blocks=DOWN.blocks, follows=DOWN,
                        constants={"W_K_LAST": True, "WEIGHTED": True, "SCALAR": False})
DX_PEER = TunedKernel(_rows_to_peer_slots_kernel, default=DX.default, candidates=[], key=DX.key,
                      even_k=None, blocks=DX.blocks, follows=DX,
                      constants={"W_K_LAST": False, "WEIGHTED": False, "SCALAR": True})


ROWS_PER_PROGRAM = 16
# Rows (slots) per block and columns per copy step of the in-kernel sending programs. The forward's carry each
# token's row once per owner, about a quarter of a block's slots at top-8 over two ranks, so their blocks are
# wider in slots and narrower per step than the backward's, which copy x and dy for every slot: forward 64 x 128
# (sm_90a send_up: 16 B of spills; run 75, 30B EP=2: forward 2.65-2.75 -> 2.58 ms, docs/NOTES.md §37; 64 x 256
# spills 124 B and gained less), backward 32 x 256 (send_dh: no spills; 64 rows: 264 B).
SEND_UP_ROWS, SEND_UP_COLS = 64, 128
SEND_DH_ROWS, SEND_DH_COLS = 32, 256
# send_list's kernel: rows per block, and programs per segment (global expert) at most. An expert holds at most
# one row per token, so at 16k tokens a program loops over at most 4 blocks (docs/NOTES.md §37: with one program
# per expert the list took 0.29 ms of the 30B EP=2 forward on skewed routing).
SEND_LIST_BLOCK, SEND_LIST_SPLIT = 256, 16

# Never autotuned (it moves rows into peers and counts them): the tiles UP chose on the same operands.
SEND_UP = TunedKernel(_send_and_up_kernel, default=UP.default, candidates=[], key=UP.key, even_k=UP.even_k,
                      blocks=UP.blocks, follows=UP)
# Never autotuned either (it moves rows too): one fixed config, which the autotuner launches once as it is.
SEND_DH = TunedKernel(_send_and_dh_kernel, default=configs((128, 256, 64, 8, 3))[0], candidates=[], key=["D", "I"],
                      even_k=lambda a: a["D"] % a["BK"] == 0, blocks=lambda c: {"w2_desc": [1, c["BK"], c["BN"]]})


def _send_blocks(ws: Workspace, dim: int, max_cols: int = 256) -> dict:
    """Block sizes of the row-sending code (``_send_rows``): all global experts (EB), all (source, local
    expert) counts or ranks (CB), and the columns copied per step (BD, at most ``max_cols``)."""
    num_experts = ws.num_ranks * ws.num_local
    return {"EB": triton.next_power_of_2(num_experts), "CB": triton.next_power_of_2(max(num_experts, ws.num_ranks)),
            "BD": min(max_cols, triton.next_power_of_2(dim))}


def exchange_counts(ws: Workspace, plan: Plan) -> None:
    """Phase 1, which starts a call: a new epoch (on the device), then my counts to every owner."""
    ws.epoch.add_(1)
    _exchange_counts_kernel[(ws.num_ranks,)](plan.offsets_E1, ws.tables["counts"], ws.tables["counts_flag"], ws.epoch,
                                             ws.rank, ws.num_ranks, ws.num_local,
                                             LB=triton.next_power_of_2(ws.num_local))


def dispatch_rows(ws: Workspace, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  plan: Plan, dy_TD: torch.Tensor | None = None) -> None:
    """Phase 2: my routed rows into their owners' receive buffers: in the forward each token's row once
    per owner (``recv_tokens``), in the backward (``dy_TD``) its x and dy rows once per slot (``recv_x``,
    ``recv_dy``); each slot's id and routing weight."""
    num_slots = plan.row_slot_N.numel()
    dim = x_TD.shape[1]
    if num_slots == 0:
        return
    _dispatch_rows_kernel[(triton.cdiv(num_slots, ROWS_PER_PROGRAM),)](
        x_TD, x_TD if dy_TD is None else dy_TD, topk_weights_TK.reshape(-1), plan.row_slot_N, plan.offsets_E1,
        topk_idx_TK, *(ws.tables[n] for n in ("counts", "counts_flag", "recv_tokens", "recv_token_row", "recv_x",
                                              "recv_dy", "recv_meta", "recv_weight", "arrived", "overflow")),
        ws.epoch, ws.rank, ws.num_ranks, ws.num_local, dim, topk_weights_TK.shape[1], ws.capacity, ws.max_tokens,
        ws.max_slots, HAS_DY=dy_TD is not None, RB=ROWS_PER_PROGRAM, KB=triton.next_power_of_2(topk_idx_TK.shape[1]),
        **_send_blocks(ws, dim),
    )


def current_counts(ws: Workspace) -> torch.Tensor:
    """(R, L) rows each source sends to each of my experts in the current call (the copy of the epoch's
    parity, picked on the device: no sync)."""
    return torch.where(ws.epoch % 2 == 0, ws.counts[0], ws.counts[1])


def received_plan(ws: Workspace) -> tuple[Plan, torch.Tensor]:
    """Wait for every source's counts (not its rows: the expert kernels wait for those, per expert), then
    the plan of the rows I am receiving — already expert-major, so built from the counts, with no sort;
    rows past the capacity, lost to an overflow, are not in it — and the current (R, L) counts."""
    _wait_epoch_kernel[(1,)](ws.counts_flag, ws.epoch, ws.num_ranks, RB=triton.next_power_of_2(ws.num_ranks))
    counts = current_counts(ws)
    return plan_from_counts(counts.sum(dim=0, dtype=torch.int32), ws.capacity), counts


def reset_arrivals(ws: Workspace, counts: torch.Tensor) -> None:
    """Zero the arrival counters once every row has arrived (the expert kernel that waited for them has
    run, so this returns at once)."""
    _wait_and_reset_kernel[(1,)](ws.arrived, counts, counts.numel(), NB=triton.next_power_of_2(counts.numel()))


def rows_to_peer_slots(ws: Workspace, kernel: TunedKernel, a_CK: torch.Tensor, w_L: torch.Tensor, plan: Plan,
                       n_out: int, weights_C: torch.Tensor | None = None, scalar_C: torch.Tensor | None = None) -> None:
    """Launch ``_rows_to_peer_slots_kernel`` as ``kernel`` (DOWN_PEER or DX_PEER) configures it. The first
    time a shape is seen with autotuning on, the one-device twin (DOWN or DX) runs once on the same
    operands into a scratch output, to choose the tiles (a host sync, like any first autotuned call)."""
    twin = kernel.follows
    if not twin.has_tuned(a_CK.dtype, N_OUT=n_out, K=a_CK.shape[1]) and plan.row_slot_N.numel():
        sorted_rows_gemm(twin, a_CK, w_L, weights_C, plan, n_out)
    any_c = ws.recv_weight  # stands in for an argument the kernel's constants say it does not read
    programs, tiles = persistent_programs(a_CK.device), tile_grid(plan, n_out)
    kernel[lambda cfg: (programs,) if cfg["PERSISTENT"] else tiles(cfg)](
        descriptor(a_CK), descriptor(w_L), any_c if weights_C is None else weights_C,
        any_c if scalar_C is None else scalar_C, ws.recv_meta,
        ws.tables["y_slots"], ws.tables["slot_scalar"],
        plan.offsets_E1, plan.tile_expert_NT, plan.tile_row_NT,
        n_out, a_CK.shape[1], w_L.shape[0], ws.max_slots, programs, EB=triton.next_power_of_2(w_L.shape[0]),
        PREC=dot_precision(a_CK.dtype), TILE_M=BLOCK_M, dtype=a_CK.dtype,
    )
    signal_returned(ws)


def owner_experts(ws: Workspace, w13_LHD: torch.Tensor, w2_LDI: torch.Tensor, send: tuple | None = None) -> None:
    """Phases 3 and 4, forward: my experts on the rows I received; the down GEMM writes each weighted
    row straight into its source's ``y_slots``. ``send = (x_TD, topk_idx_TK, topk_weights_TK, plan,
    comm_sms)``: phase 2 runs in the up kernel's launch, on ``comm_sms`` of its programs (:func:`send_and_up`);
    without it, the caller has run :func:`dispatch_rows`."""
    plan, counts = received_plan(ws)
    if send is None:  # the up kernel gathers each received row's token row
        h = up_swiglu_fwd(ws.recv_tokens, w13_LHD, dataclasses.replace(plan, row_slot_N=ws.recv_token_row), top_k=1,
                          arrivals=(ws.arrived, counts, ws.ready, ws.epoch))
    else:
        h = send_and_up(ws, *send, w13_LHD, plan, counts)
    reset_arrivals(ws, counts)
    rows_to_peer_slots(ws, DOWN_PEER, h, w2_LDI, plan, w2_LDI.shape[1], weights_C=ws.recv_weight)


def send_list(plan: Plan, num_ranks: int, num_local: int, topk_idx_TK: torch.Tensor | None = None) -> torch.Tensor:
    """(4, N) int32: my N slots' rows in the senders' order, as (slot, global expert, index among my rows
    of that expert, carries: 1 if the slot carries its token's row to the owner in the forward, given my
    routing ``topk_idx_TK``; 0 without it); the dropped slots' entries last, with slot -1. Local expert l
    major, owner k minor:
    segment l * R + k holds my rows of global expert k * L + l, in sorted order. Sorted by global expert,
    every source would send to owner 0 first and owner R-1's tiles could not start before the whole
    exchange ended; in this order every owner has its expert-0 rows from every source after about 1/L of
    it. One launch, on the device, no sync."""
    num_rows = plan.row_slot_N.numel()
    out = torch.empty(4, num_rows, device=plan.row_slot_N.device, dtype=torch.int32)
    if num_rows:
        top_k = 1 if topk_idx_TK is None else topk_idx_TK.shape[1]
        split = min(SEND_LIST_SPLIT, triton.cdiv(num_rows, SEND_LIST_BLOCK))
        _send_list_kernel[(num_ranks * num_local + 1, split)](
            plan.row_slot_N, plan.offsets_E1, plan.row_slot_N if topk_idx_TK is None else topk_idx_TK, out, num_rows,
            num_ranks, num_local, top_k, CARRIES=topk_idx_TK is not None, KB=triton.next_power_of_2(top_k),
            EB=triton.next_power_of_2(num_ranks * num_local), BLOCK=SEND_LIST_BLOCK)
    return out


def _trace_buffer(kernel: str, senders: int, recv_plan: Plan, n_dim: int) -> torch.Tensor | None:
    """With SENDER_TRACE on, a new stamp buffer for ``kernel``'s next launch ("up": send + up, "dh": send + dh'),
    kept there with its layout; else None."""
    if SENDER_TRACE is None:
        return None
    grid = recv_plan.tile_expert_NT.numel() * (BLOCK_M // 64) * triton.cdiv(n_dim, 64)  # the smallest tiles: 64 x 64
    stamps = torch.full((senders * TRACE_STRIDE.value + TRACE_PER_TILE.value * grid,), -1,
                        device=recv_plan.offsets_E1.device, dtype=torch.int64)
    SENDER_TRACE[kernel] = {"stamps": stamps, "senders": senders, "stride": TRACE_STRIDE.value}
    return stamps


def send_and_up(ws: Workspace, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                plan: Plan, comm_sms: int, w13_LHD: torch.Tensor, recv_plan: Plan, counts: torch.Tensor,
                compute: bool = True) -> torch.Tensor:
    """Phases 2 and 3 in one launch (``_send_and_up_kernel``): ``comm_sms`` programs send my rows (``plan``;
    each token's row once per owner) while the rest run the up + SwiGLU GEMM on my received token rows
    (``recv_plan``), each tile once the rows of its expert and the lower ones are in. Returns h (C, I) in
    received-row order. ``compute=False``: the senders alone (the loopback's way to run them for several
    virtual ranks on one stream; h is not written)."""
    num_local, two_i, dim = w13_LHD.shape
    inter = two_i // 2
    if not UP.has_tuned(x_TD.dtype, D=dim, I=inter):  # choose the tiles on the plain kernel (rows: any)
        up_swiglu_fwd(ws.recv_x, w13_LHD, recv_plan, top_k=1, gluon=False)
    h_CI = torch.empty(ws.capacity, inter, device=x_TD.device, dtype=x_TD.dtype)
    tiles = tile_grid(recv_plan, inter)
    trace = _trace_buffer("up", comm_sms, recv_plan, inter)
    SEND_UP[lambda cfg: (comm_sms + (tiles(cfg)[0] if compute else 0),)](
        x_TD, topk_weights_TK.reshape(-1), send_list(plan, ws.num_ranks, num_local, topk_idx_TK),
        *(ws.tables[n] for n in ("counts", "counts_flag", "recv_tokens", "recv_token_row", "recv_meta",
                                 "recv_weight", "arrived", "overflow")),
        ws.epoch, ws.rank, ws.num_ranks, num_local, topk_weights_TK.shape[1], ws.capacity, ws.max_tokens,
        ws.max_slots, plan.row_slot_N.numel(),
        ws.recv_tokens, descriptor(w13_LHD.view(num_local, 2, inter, dim)), h_CI, ws.recv_token_row,
        recv_plan.offsets_E1, recv_plan.tile_expert_NT, recv_plan.tile_row_NT, ws.arrived, counts, ws.ready, dim, inter,
        h_CI if trace is None else trace,
        SENDERS=comm_sms, RB=SEND_UP_ROWS, LB=triton.next_power_of_2(num_local), **_send_blocks(ws, dim, SEND_UP_COLS),
        PREC=dot_precision(x_TD.dtype), TILE_M=BLOCK_M, TRACE=trace is not None, dtype=x_TD.dtype,
    )
    return h_CI


def send_and_dh(ws: Workspace, w2_LDI: torch.Tensor, recv_plan: Plan, counts: torch.Tensor, send: tuple | None = None,
                compute: bool = True) -> torch.Tensor:
    """The backward's phase 2 and its dh' GEMM in one launch (``_send_and_dh_kernel``): with ``send = (x_TD, dy_TD,
    topk_weights_TK, plan, comm_sms)``, ``comm_sms`` programs send my x and dy rows while the rest compute
    dh' = dy W2[e] (C, I) on my received dy rows (``recv_plan``), each tile once its expert's rows are in;
    without it, the GEMM alone (another launch sent the rows). Rows past the routed count are not written.
    ``compute=False``: the senders alone (as for :func:`send_and_up`; dh' is not written)."""
    num_local, dim, inter = w2_LDI.shape
    x_TD, dy_TD, topk_weights_TK, plan, comm_sms = send or (ws.recv_x, ws.recv_dy, ws.recv_weight[:, None], None, 0)
    dh_CI = torch.empty(ws.capacity, inter, device=w2_LDI.device, dtype=w2_LDI.dtype)
    tiles = tile_grid(recv_plan, inter)
    # Without senders the list is unread: the received plan's row map stands in for it.
    send_list_ = recv_plan.row_slot_N if plan is None else send_list(plan, ws.num_ranks, num_local)
    trace = _trace_buffer("dh", comm_sms, recv_plan, inter)
    SEND_DH[lambda cfg: (comm_sms + (tiles(cfg)[0] if compute else 0),)](
        x_TD, dy_TD, topk_weights_TK.reshape(-1), send_list_,
        *(ws.tables[n] for n in ("counts", "counts_flag", "recv_x", "recv_dy", "recv_meta", "recv_weight", "arrived",
                                 "overflow")),
        ws.epoch, ws.rank, ws.num_ranks, num_local, topk_weights_TK.shape[1], ws.capacity, ws.max_slots,
        0 if plan is None else plan.row_slot_N.numel(),
        ws.recv_dy, descriptor(w2_LDI), dh_CI, recv_plan.offsets_E1, recv_plan.tile_expert_NT, recv_plan.tile_row_NT,
        ws.arrived, counts, dim, inter, dh_CI if trace is None else trace,
        SENDERS=comm_sms, RB=SEND_DH_ROWS, **_send_blocks(ws, dim, SEND_DH_COLS), PREC=dot_precision(w2_LDI.dtype),
        TILE_M=BLOCK_M, TRACE=trace is not None, dtype=w2_LDI.dtype,
    )
    return dh_CI


def owner_experts_backward(ws: Workspace, w13_LHD: torch.Tensor, w2_LDI: torch.Tensor, send: tuple | None = None):
    """Phases 3 and 4, backward: dh' on the received dy rows as they arrive (:func:`send_and_dh`), then the
    one-GPU backward's act kernel (the gate/up GEMM recomputed; on sm90 the warp-specialized one) on the received
    x rows and dh' — the rows are already in expert order, so nothing is gathered; the dx GEMM writes each row,
    and its d(routing weight), straight into the source's slots. Returns dw13 and dw2 of my experts.
    ``send = (x_TD, dy_TD, topk_weights_TK, plan, comm_sms)``: phase 2 runs in the dh' kernel's launch;
    without it, the caller ran :func:`dispatch_rows` (or the senders' launch)."""
    plan, counts = received_plan(ws)
    dh = send_and_dh(ws, w2_LDI, plan, counts, send)
    # Every expert's rows are in: each expert with rows had a dh' tile wait for them.
    reset_arrivals(ws, counts)
    dz, hw, dweight = act_bwd(ws.recv_x, dh, w13_LHD, ws.recv_weight[:, None], plan, top_k=1)
    rows_to_peer_slots(ws, DX_PEER, dz, w13_LHD, plan, w13_LHD.shape[2], scalar_C=dweight.view(-1))
    return expert_wgrad(dz, ws.recv_x, plan, w13_LHD.dtype), expert_wgrad(ws.recv_dy, hw, plan, w2_LDI.dtype)


def return_rows(ws: Workspace) -> None:
    """Phases 3 and 4 with no experts (the communication-only figure of the EP benchmark): wait for my
    rows, then send each back, unchanged, into its source's ``y_slots`` and signal."""
    plan, counts = received_plan(ws)
    reset_arrivals(ws, counts)  # returns once every row is in
    dim = ws.recv_x.shape[1]
    _return_rows_kernel[(triton.cdiv(ws.capacity, ROWS_PER_PROGRAM),)](
        ws.recv_tokens, ws.recv_token_row, ws.recv_meta, plan.offsets_E1, ws.tables["y_slots"], ws.num_local, dim,
        ws.max_slots, RB=ROWS_PER_PROGRAM, BD=_send_blocks(ws, dim)["BD"])
    signal_returned(ws)


def signal_returned(ws: Workspace) -> None:
    """After my output kernel: every source's ``returned[me]`` = 1 (release)."""
    _signal_returned_kernel[(1,)](ws.tables["returned"], ws.rank, ws.num_ranks, RB=triton.next_power_of_2(ws.num_ranks))


def wait_returned(ws: Workspace) -> None:
    """Until every owner has signalled that my rows are back (acquire); then reset the signals."""
    _wait_and_reset_kernel[(1,)](ws.returned, ws.one_per_rank, ws.num_ranks, NB=triton.next_power_of_2(ws.num_ranks))


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


def combine_returned(ws: Workspace, topk_idx_TK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Phase 5: wait until every owner has written back every row I sent it (its signal, acquire), then
    each token's sum over its K slots."""
    wait_returned(ws)
    return combine(ws.y_slots[: topk_idx_TK.numel()], topk_idx_TK, out_dtype)


def combine_returned_backward(ws: Workspace, topk_idx_TK: torch.Tensor, out_dtype: torch.dtype):
    """Phase 5 of the backward: dx (T, D) from the returned rows, and d(routing weight) (T, K) fp32 from the
    returned scalars (exact zero for a dropped slot)."""
    dx = combine_returned(ws, topk_idx_TK, out_dtype)
    returned = ws.slot_scalar[: topk_idx_TK.numel()].view(topk_idx_TK.shape)
    return dx, torch.where(topk_idx_TK >= 0, returned, 0.0)


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


def loopback_forward(workspaces: list[Workspace], problems: list[tuple], comm_sms: int = 0) -> list[torch.Tensor]:
    """The forward of R virtual ranks on one device: ``problems[r] = (x, topk_idx, topk_weights, w13, w2)``
    with global expert ids and rank r's local experts. Each phase runs for every rank before the next,
    so every wait's producer has already run (one device executes the launches in order).
    ``comm_sms > 0``: the rows are sent by ``comm_sms`` programs of the up kernel's launch (:func:`send_and_up`)
    — with one virtual rank in the same launch as its GEMM tiles; with more, each rank's senders run in a
    launch of their own first (a rank's tiles would otherwise wait for rows that a later launch sends)."""
    plans = _start(workspaces, problems)
    if comm_sms and len(workspaces) == 1:
        (ws,), (plan,), ((x, idx, weights, w13, w2),) = workspaces, plans, problems
        owner_experts(ws, w13, w2, send=(x, idx, weights, plan, comm_sms))
    elif comm_sms:
        for ws, plan, (x, idx, weights, w13, _) in zip(workspaces, plans, problems):
            send_and_up(ws, x, idx, weights, plan, comm_sms, w13, *received_plan(ws), compute=False)
        for ws, p in zip(workspaces, problems):
            owner_experts(ws, p[3], p[4])
    else:
        for ws, plan, (x, idx, weights, _, _) in zip(workspaces, plans, problems):
            dispatch_rows(ws, x, idx, weights, plan)
        for ws, p in zip(workspaces, problems):
            owner_experts(ws, p[3], p[4])
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
                      comm_sms: int = 0) -> list[tuple]:
    """The backward of :func:`loopback_forward` for output gradients ``dys``: per rank (dx, d topk_weights
    (fp32), dw13, dw2). Nothing from the forward is used: x and dy rows travel again (the workspace is
    shared by every layer, so the forward's received rows are gone by then). ``comm_sms``: as for
    :func:`loopback_forward`."""
    plans = _start(workspaces, problems)
    if comm_sms and len(workspaces) == 1:
        (ws,), (plan,), ((x, _, weights, w13, w2),), (dy,) = workspaces, plans, problems, dys
        weight_grads = [owner_experts_backward(ws, w13, w2, send=(x, dy, weights, plan, comm_sms))]
    elif comm_sms:
        for ws, plan, (x, _, weights, w13, w2), dy in zip(workspaces, plans, problems, dys):
            send_and_dh(ws, w2, *received_plan(ws), send=(x, dy, weights, plan, comm_sms), compute=False)
        weight_grads = [owner_experts_backward(ws, p[3], p[4]) for ws, p in zip(workspaces, problems)]
    else:
        for ws, plan, (x, idx, weights, _, _), dy in zip(workspaces, plans, problems, dys):
            dispatch_rows(ws, x, idx, weights, plan, dy_TD=dy)
        weight_grads = [owner_experts_backward(ws, p[3], p[4]) for ws, p in zip(workspaces, problems)]
    results = []
    for ws, (x, topk_idx, _, _, _), (dw13, dw2) in zip(workspaces, problems, weight_grads):
        results.append((*combine_returned_backward(ws, topk_idx, x.dtype), dw13, dw2))
    return results
