"""The fused expert-parallel protocol's senders (phase 2, see protocol.py): my routed rows into their owners'
receive buffers, either from kernels of their own (:func:`dispatch_rows`: the token rows token by token, then the
slots' fields and counts) or from the first programs of the owner's expert kernel's launch (:func:`sender`, run by
``owner.send_and_up`` / ``owner.send_and_dh``).

Shape legend as in workspace.py; E = R*L global experts; T, K this rank's tokens and slots; N = T*K.

Forward: each token's row once per owner, into ``recv_tokens`` at row ``src * T + token``, carried by the
token's first slot at that owner (:func:`carries_row`); every slot's id (``recv_meta``), routing weight and
``recv_token_row`` at its place in the owner's expert-major order. Backward: x and dy once per slot, into
``recv_x`` / ``recv_dy`` at that place; or (the FP8 layer's, whose owners read them through ``recv_token_row``) once
per token and owner, at row ``src * T + token`` of the same buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.kernels.plan import Plan
from megamoe.kernels.quant import FP8, GROUP, quantize_rows
from megamoe.parallel.protocol import (
    ARRIVED,
    OVERFLOW,
    RECV_DY,
    RECV_META,
    RECV_TOKEN_ROW,
    RECV_TOKENS,
    RECV_WEIGHT,
    RECV_X,
    dest_bases,
    peer,
    wait_all_counts,
)
from megamoe.parallel.trace import (
    TRACE_BLOCKS,
    TRACE_HEAD,
    TRACE_PER_BLOCK,
    TRACE_STRIDE,
    stamp,
)
from megamoe.parallel.workspace import Workspace

# Rows (slots) per program of the dispatch kernel of its own; tokens and columns per program of its token-major
# row copy (``_send_token_rows_kernel``; the tiles of ``expert_bwd._scatter_rows``, the same read-once-write-K
# pattern; the columns a multiple of 128, the FP8 scale groups').
ROWS_PER_PROGRAM = 16
TOKEN_ROWS_TOKENS, TOKEN_ROWS_COLS = 16, 512
# Rows (slots) per block and columns per copy step of the in-kernel sending programs. The forward's carry each
# token's row once per owner, about a quarter of a block's slots at top-8 over two ranks, so their blocks are
# wider in slots and narrower per step than the backward's, which copy x and dy for every slot: forward 64 x 128
# (30B EP=2 forward 2.65-2.75 -> 2.58 ms, docs/PERFORMANCE.md; sm_90a send_up then spilled 16 B, since none; 64 x 256
# spilled 124 B and gained less), backward 32 x 256 (send_dh: no spills; 64 rows: 264 B).
SEND_UP_ROWS, SEND_UP_COLS = 64, 128
SEND_DH_ROWS, SEND_DH_COLS = 32, 256
# send_list's kernel: rows per block, and programs per segment (global expert) at most. An expert holds at most
# one row per token, so at 16k tokens a program loops over at most 4 blocks (with one program per expert the
# list took 0.29 ms of the 30B EP=2 forward on skewed routing).
SEND_LIST_BLOCK, SEND_LIST_SPLIT = 256, 16


@triton.jit
def carries_row(slot, e, topk_idx_ptr, L, top_k, KB: tl.constexpr):
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


@triton.jit
def send_rows(slot, e, dst, carries, x_ptr, dy_ptr, weights_ptr, peers_ptr, rank, R, L, D, top_k, capacity,
              max_tokens, max_slots, HAS_DY: tl.constexpr, RB: tl.constexpr, BD: tl.constexpr,
              trace_ptr=None, trace_at=-1, TRACE: tl.constexpr = False, x_s_ptr=None, num_tokens=0,
              X_SCALES: tl.constexpr = False, GB: tl.constexpr = 1, xq_ptr=None, ROWS: tl.constexpr = True):
    """My rows of slots ``slot`` (RB of them; -1: none) of global experts ``e`` into their owners' receive
    buffers at rows ``dst`` (the caller waited for the counts: ``protocol.wait_all_counts``): each row's slot id
    and routing weight, and its token's row of x —
    - forward (not HAS_DY): into the owner's ``recv_tokens`` at row ``rank * max_tokens + token``, by the
      slots where ``carries`` is 1 (:func:`carries_row`), whatever the slot's ``dst``; the owner's up kernel
      reads it through ``recv_token_row``. A token that picked several of an owner's experts crosses NVLink
      once. With X_SCALES x is e4m3 (``kernels.quant.quantize_rows``) and its (D/128, ``num_tokens``) scales
      ``x_s`` travel beside it: the rows and the scales in ``recv_tokens``' memory as
      ``protocol.recv_tokens_fp8`` lays them out (GB: D/128 rounded up to a power of two);
    - backward (HAS_DY): x and dy rows into ``recv_x`` / ``recv_dy`` at ``dst``, one per slot (the weight
      gradients read them there as expert-sorted rows); with X_SCALES also each token's e4m3 row ``xq`` and its
      scales once per owner into ``recv_tokens`` as in the forward (the FP8 recompute's input).
    Without ROWS no row is copied here (:func:`_send_token_rows_kernel` copied them, token by token, before this
    kernel's releases: the forward's, and the FP8 backward's x and dy once per token and owner): only the slots'
    fields, each slot's ``recv_token_row`` among them.
    The validity travels as -1 rather than as a mask argument: Triton 3.6 fails to compile a boolean tensor
    passed to a called function (sm_90a: "failed to legalize unresolved materialization ...
    tensor<64xi1>"). TRACE: stamps ``trace_at + 1..3`` (see trace.py)."""
    rmask = slot >= 0  # every access below is masked by it (an early return here fails to compile too)
    owner = e // L
    local = e % L
    fits = rmask & (dst < capacity)
    weight = tl.load(weights_ptr + slot, mask=fits, other=0.0)  # issued before the copy, which hides its latency
    tok = (slot // top_k).to(tl.int64)
    dst64 = dst.to(tl.int64)
    token_copies = rmask & (carries != 0)  # the slots that carry their token's row into recv_tokens
    token_row = rank * max_tokens + tok
    if HAS_DY:
        copies = fits
        # Each destination row's start in the owner's buffers, 16-byte aligned (see owner.py's output kernel).
        x_rows = tl.multiple_of(peer(peers_ptr, RECV_X, owner, R, x_ptr.dtype.element_ty) + dst64 * D, 16)
        dy_rows = tl.multiple_of(peer(peers_ptr, RECV_DY, owner, R, x_ptr.dtype.element_ty) + dst64 * D, 16)
        if X_SCALES:
            q_rows = tl.multiple_of(peer(peers_ptr, RECV_TOKENS, owner, R, xq_ptr.dtype.element_ty) + token_row * D,
                                    16)
    else:
        copies = token_copies
        x_rows = tl.multiple_of(peer(peers_ptr, RECV_TOKENS, owner, R, x_ptr.dtype.element_ty) + token_row * D, 16)
    if (not HAS_DY) or X_SCALES or not ROWS:
        tl.store(peer(peers_ptr, RECV_TOKEN_ROW, owner, R, tl.int32) + dst64, token_row.to(tl.int32), mask=fits)
    if X_SCALES and ROWS:  # after the R * T rows of D bytes, (D/128, R * T) fp32
        rows_in = token_row * 0 + R * max_tokens  # R * T, in int64
        s_rows = peer(peers_ptr, RECV_TOKENS, owner, R, tl.float32) + rows_in * D // 4 + token_row
        gs = tl.arange(0, GB)
        gm = token_copies[:, None] & (gs < D // 128)[None, :]
        tl.store(s_rows[:, None] + gs[None, :] * rows_in[:, None],
                 tl.load(x_s_ptr + gs[None, :] * num_tokens + tok[:, None], mask=gm), mask=gm)
    # Pipelined (cp.async through shared memory): a sending program is one block on its SM, so its loads
    # must overlap one another to move more than one chunk per memory latency.
    for d0 in tl.range(0, D if ROWS else 0, BD, num_stages=4):
        ds = d0 + tl.arange(0, BD)
        m = copies[:, None] & (ds < D)[None, :]
        src = tok[:, None] * D + ds[None, :]
        tl.store(x_rows[:, None] + ds[None, :], tl.load(x_ptr + src, mask=m), mask=m)
        if HAS_DY:
            tl.store(dy_rows[:, None] + ds[None, :], tl.load(dy_ptr + src, mask=m), mask=m)
            if X_SCALES:
                mq = token_copies[:, None] & (ds < D)[None, :]
                tl.store(q_rows[:, None] + ds[None, :], tl.load(xq_ptr + src, mask=mq), mask=mq)
    stamp(trace_ptr, trace_at, 1, TRACE)
    tl.store(peer(peers_ptr, RECV_META, owner, R, tl.int32) + dst64, rank * max_slots + slot, mask=fits)
    tl.store(peer(peers_ptr, RECV_WEIGHT, owner, R, tl.float32) + dst64, weight.to(tl.float32), mask=fits)
    stamp(trace_ptr, trace_at, 2, TRACE)
    # Count the rows into their owners' arrivals: one release per expert among them, by one thread, after
    # a barrier of the whole block — the barrier orders every thread's row stores before that thread's
    # release, and a release at system scope is cumulative, so the owner that acquires the count sees
    # the rows. A row that did not fit is counted too, so that no wait hangs on it, and in the owner's
    # and my ``overflow``.
    idx = tl.arange(0, RB)
    same = (e[:, None] == e[None, :]) & rmask[None, :]
    first = rmask & (tl.min(tl.where(same, idx[None, :], RB), axis=1) == idx)
    tl.debug_barrier()
    tl.atomic_add(peer(peers_ptr, ARRIVED, owner, R, tl.int32) + rank * L + local, tl.sum(same.to(tl.int32), axis=1),
                  mask=first, sem="release", scope="sys")
    stamp(trace_ptr, trace_at, 3, TRACE)
    lost = rmask & (dst >= capacity)
    tl.atomic_add(peer(peers_ptr, OVERFLOW, owner, R, tl.int32), 1, mask=lost, sem="relaxed", scope="sys")
    tl.atomic_add(peer(peers_ptr, OVERFLOW, rank, R, tl.int32), tl.sum(lost.to(tl.int32), axis=0), sem="relaxed",
                  scope="sys")


@triton.jit
def _dispatch_rows_kernel(
    x_ptr,  # (T, D) my tokens
    dy_ptr,  # (T, D) their output gradient (backward; read only if HAS_DY)
    weights_ptr,  # (N,) my routing weights, flat slots
    row_slot_ptr, offsets_ptr,  # my plan over the E global experts
    topk_idx_ptr,  # (T, K) my routing (forward: which of a token's slots carries its row to an owner)
    peers_ptr,  # (buffers, R) int64: every rank's buffers (workspace.BUFFER_INDEX)
    epoch_ptr,
    rank, R, L, D, top_k, capacity, max_tokens, max_slots,
    HAS_DY: tl.constexpr, RB: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr,
    BD: tl.constexpr,
    x_s_ptr=None, num_tokens=0,  # X_SCALES: x's (D/128, T) scales (of x in e4m3; in the backward of xq)
    X_SCALES: tl.constexpr = False, GB: tl.constexpr = 1,
    xq_ptr=None,  # backward with X_SCALES: (T, D) x in e4m3, each token's row sent once per owner beside x's
    ROWS: tl.constexpr = True,  # the rows copied here (else by ``_send_token_rows_kernel``, before)
):
    """Phase 2 as its own kernel: program i sends my sorted rows [i*RB, (i+1)*RB)."""
    wait_all_counts(peers_ptr, epoch_ptr, R, CB)
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    rows = tl.where(rows < tl.load(offsets_ptr + R * L), rows, -1)
    e = _experts_of_rows(rows, offsets_ptr, R * L, EB)
    dst = dest_bases(e, peers_ptr, epoch_ptr, rank, R, L, CB) + rows - tl.load(offsets_ptr + e)
    slots = tl.where(rows >= 0, tl.load(row_slot_ptr + rows, mask=rows >= 0, other=0), -1)
    carries = slots * 0
    if ROWS and ((not HAS_DY) or X_SCALES):
        carries = carries_row(slots, e, topk_idx_ptr, L, top_k, KB)
    send_rows(slots, e, dst, carries, x_ptr, dy_ptr, weights_ptr, peers_ptr, rank, R, L, D, top_k, capacity,
              max_tokens, max_slots, HAS_DY, RB, BD, x_s_ptr=x_s_ptr, num_tokens=num_tokens, X_SCALES=X_SCALES,
              GB=GB, xq_ptr=xq_ptr, ROWS=ROWS)


@triton.jit
def _send_token_rows_kernel(
    x_ptr,  # (T, D) forward: my tokens (e4m3 with X_SCALES); backward: x in its dtype
    dy_ptr,  # (T, D) backward (HAS_DY): dy
    xq_ptr,  # (T, D) e4m3, backward with X_SCALES: x's rows for the owners' recompute
    x_s_ptr,  # (D/128, T) fp32 with X_SCALES: the e4m3 rows' scales
    topk_idx_ptr,  # (T, K) my routing: the owners each token's rows go to
    peers_ptr, epoch_ptr, rank, R, L, D, T, top_k, max_tokens,
    HAS_DY: tl.constexpr, X_SCALES: tl.constexpr, TB: tl.constexpr, KB: tl.constexpr, CB: tl.constexpr,
    BD: tl.constexpr,
):
    """Token-major sending: program (i, j) reads TB tokens' columns [j*BD, (j+1)*BD) once and writes them to every
    owner among the tokens' picks, once per owner, at row ``rank * max_tokens + token`` of its token-row buffers:
    forward x into ``recv_tokens`` (with X_SCALES in e4m3, its scales where ``protocol.recv_tokens_fp8`` reads
    them); backward (HAS_DY) x and dy into ``recv_x`` / ``recv_dy``, with X_SCALES x's e4m3 row and scales into
    ``recv_tokens``. The slots' fields and the arrival counts follow in ``_dispatch_rows_kernel`` (ROWS off),
    launched after this kernel: its releases come after these stores. (The slot-major walk copies a token's rows from
    the slot that carries them, a chain of latencies per slot row: it cost per slot, not per byte.)"""
    wait_all_counts(peers_ptr, epoch_ptr, R, CB)
    toks = tl.program_id(0) * TB + tl.arange(0, TB)
    tmask = toks < T
    tok = toks.to(tl.int64)
    ks = tl.arange(0, KB)
    picks = tl.load(topk_idx_ptr + tok[:, None] * top_k + ks[None, :], mask=tmask[:, None] & (ks < top_k)[None, :],
                    other=-1)
    owners = tl.where(picks >= 0, picks // L, -1)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    m = tmask[:, None] & (cols < D)[None, :]
    src = tok[:, None] * D + cols[None, :]
    a = tl.load(x_ptr + src, mask=m)
    if HAS_DY:
        b = tl.load(dy_ptr + src, mask=m)
        if X_SCALES:
            q = tl.load(xq_ptr + src, mask=m)
    if X_SCALES:  # this block's 1x128 groups (BD a multiple of 128)
        G: tl.constexpr = BD // 128
        gs = tl.program_id(1) * G + tl.arange(0, G)
        gm = tmask[:, None] & (gs < D // 128)[None, :]
        scales = tl.load(x_s_ptr + gs[None, :] * T + tok[:, None], mask=gm)
        rows_in = tok * 0 + R * max_tokens  # R * T, in int64
    row = rank * max_tokens + tok
    for k in range(top_k):
        owner = tl.sum(tl.where(ks[None, :] == k, owners, 0), axis=1)
        earlier = tl.sum(((owners == owner[:, None]) & (ks[None, :] < k)).to(tl.int32), axis=1)
        send = tmask & (owner >= 0) & (earlier == 0)  # the token's first pick at that owner
        sm = send[:, None] & (cols < D)[None, :]
        owner = tl.maximum(owner, 0)  # (a dropped pick's -1 would index the peer table's row before)
        # Each row's start, 16-byte aligned (buffers aligned, rows 16-byte multiples): 16-byte stores
        if HAS_DY:
            x_rows = tl.multiple_of(peer(peers_ptr, RECV_X, owner, R, x_ptr.dtype.element_ty) + row * D, 16)
            dy_rows = tl.multiple_of(peer(peers_ptr, RECV_DY, owner, R, dy_ptr.dtype.element_ty) + row * D, 16)
            tl.store(x_rows[:, None] + cols[None, :], a, mask=sm)
            tl.store(dy_rows[:, None] + cols[None, :], b, mask=sm)
            if X_SCALES:
                q_rows = tl.multiple_of(peer(peers_ptr, RECV_TOKENS, owner, R, xq_ptr.dtype.element_ty) + row * D, 16)
                tl.store(q_rows[:, None] + cols[None, :], q, mask=sm)
        else:
            x_rows = tl.multiple_of(peer(peers_ptr, RECV_TOKENS, owner, R, x_ptr.dtype.element_ty) + row * D, 16)
            tl.store(x_rows[:, None] + cols[None, :], a, mask=sm)
        if X_SCALES:
            s_rows = peer(peers_ptr, RECV_TOKENS, owner, R, tl.float32) + rows_in * D // 4 + row
            tl.store(s_rows[:, None] + gs[None, :] * rows_in[:, None], scales, mask=send[:, None] & gm)


@triton.jit
def _experts_of_rows(rows, offsets_ptr, E, EB: tl.constexpr):
    """Global expert of each of my sorted ``rows`` (-1: none; its expert is any valid one): the number of
    experts whose rows end at or before it."""
    es = tl.arange(0, EB)
    ends = tl.load(offsets_ptr + es + 1, mask=es < E, other=2147483647)
    return tl.minimum(tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1), E - 1)


@triton.jit
def _send_list_block(block, send_list_ptr, num_rows, RB: tl.constexpr):
    """Entries [block*RB, (block+1)*RB) of :func:`send_list` (slot -1, expert 0 past its end)."""
    pos = block * RB + tl.arange(0, RB)
    m = pos < num_rows
    return (tl.load(send_list_ptr + pos, mask=m, other=-1), tl.load(send_list_ptr + num_rows + pos, mask=m, other=0),
            tl.load(send_list_ptr + 2 * num_rows + pos, mask=m, other=0),
            tl.load(send_list_ptr + 3 * num_rows + pos, mask=m, other=0))


@triton.jit
def sender(pid, x_ptr, dy_ptr, weights_ptr, send_list_ptr, num_rows, peers_ptr, epoch_ptr, rank, R, L, D, top_k,
           capacity, max_tokens, max_slots, HAS_DY: tl.constexpr, SENDERS: tl.constexpr, RB: tl.constexpr,
           EB: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr, trace_ptr=None, TRACE: tl.constexpr = False):
    """Sending program ``pid`` of SENDERS in an expert kernel's launch: once the counts are in, blocks pid,
    pid + SENDERS, ... (RB rows each) of my ``num_rows`` rows in the order of :func:`send_list` — local expert
    first, then owner — so that every owner receives its first experts' rows from every source first and its
    tiles can start while later experts' rows travel. TRACE: its stamps (see trace.py)."""
    head = pid * TRACE_STRIDE
    stamp(trace_ptr, head, 0, TRACE)
    wait_all_counts(peers_ptr, epoch_ptr, R, CB)
    os_ = tl.arange(0, EB)
    # Once per program rather than per block: every expert's start at its owner (from the owners' counts,
    # across NVLink with real ranks), indexed by global expert.
    bases = dest_bases(os_, peers_ptr, epoch_ptr, rank, R, L, CB)
    slot, e, index, carries = _send_list_block(pid, send_list_ptr, num_rows, RB)
    stamp(trace_ptr, head, 1, TRACE)
    for block in range(pid, tl.cdiv(num_rows, RB), SENDERS):
        j = (block - pid) // SENDERS
        trace_at = tl.where(j < TRACE_BLOCKS, head + TRACE_HEAD + j * TRACE_PER_BLOCK, -1)
        stamp(trace_ptr, trace_at, 0, TRACE)
        # The next block's entries load while this block's rows are copied: a sender's time is a chain of
        # memory latencies per block (docs/DESIGN.md, "Expert parallelism"), and this takes one out of it.
        next_slot, next_e, next_index, next_carries = _send_list_block(block + SENDERS, send_list_ptr, num_rows, RB)
        dst = tl.sum(tl.where(e[:, None] == os_[None, :], bases[None, :], 0), axis=1) + index
        send_rows(slot, e, dst, carries, x_ptr, dy_ptr, weights_ptr, peers_ptr, rank, R, L, D, top_k, capacity,
                  max_tokens, max_slots, HAS_DY, RB, BD, trace_ptr, trace_at, TRACE)
        slot, e, index, carries = next_slot, next_e, next_index, next_carries
    stamp(trace_ptr, head, 2, TRACE)


@triton.jit
def _send_list_kernel(row_slot_ptr, offsets_ptr, topk_idx_ptr, send_list_ptr, num_rows, R, L, top_k,
                      CARRIES: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, BLOCK: tl.constexpr):
    """Programs (e, c), e < E, write my rows of global expert e into :func:`send_list`, after the segments that
    precede its own: those of every lower local expert, then those of its local expert at lower owners;
    with CARRIES, which of them carry their token's row (:func:`carries_row`), else 0. Programs (E, c) mark
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
            carries = carries_row(slot, expert, topk_idx_ptr, L, top_k, KB)
        tl.store(pos + 3 * num_rows, carries, mask=m)


# The kernels without a tile config, for the ahead-of-time compile check (``tools.resources``).
KERNELS = (_dispatch_rows_kernel, _send_list_kernel, _send_token_rows_kernel)


def send_blocks(ws: Workspace, dim: int, max_cols: int = 256) -> dict:
    """Block sizes of the row-sending code (:func:`send_rows`): all global experts (EB), all (source, local
    expert) counts or ranks (CB), and the columns copied per step (BD, at most ``max_cols``)."""
    num_experts = ws.num_ranks * ws.num_local
    return {"EB": triton.next_power_of_2(num_experts), "CB": triton.next_power_of_2(max(num_experts, ws.num_ranks)),
            "BD": min(max_cols, triton.next_power_of_2(dim))}


def dispatch_rows(ws: Workspace, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  plan: Plan, dy_TD: torch.Tensor | None = None, x_s: torch.Tensor | None = None,
                  x_q: torch.Tensor | None = None, xy_per_token: bool = False) -> None:
    """Phase 2 in kernels of their own: my routed rows into their owners' receive buffers: in the forward each
    token's row once per owner (``recv_tokens``; copied token by token, ``_send_token_rows_kernel``), in the
    backward (``dy_TD``) its x and dy rows once per slot (``recv_x``, ``recv_dy``; in the slot walk); each slot's id
    and routing weight, then the arrival counts (``_dispatch_rows_kernel``). ``x_s``: the forward's rows travel in FP8, ``x_TD``
    e4m3 and ``x_s`` its (D/128, T) fp32 scales (``kernels.quant.quantize_rows``), received as
    ``protocol.recv_tokens_fp8`` reads them: D + D/32 bytes per row. In the backward ``x_q`` and ``x_s``, x in e4m3
    and its scales: also each token's FP8 row once per owner, as in the forward (the FP8 recompute's input).
    ``xy_per_token`` (backward): x and dy once per token and owner instead, at row ``src * T + token`` of
    ``recv_x`` / ``recv_dy``, read through ``recv_token_row`` (``owner.token_rows``); the receive capacity must hold
    R * T rows (the API's, R * T * K, does)."""
    num_slots = plan.row_slot_N.numel()
    if xy_per_token and (dy_TD is None or ws.capacity < ws.num_ranks * ws.max_tokens):
        raise ValueError(f"dispatch_rows: x and dy once per token (xy_per_token) is the backward's (dy given: "
                         f"{dy_TD is not None}) and needs a receive capacity of R * T = "
                         f"{ws.num_ranks * ws.max_tokens} rows or more, got {ws.capacity}")
    dim = x_TD.shape[1]
    fp8_x = x_TD if dy_TD is None else x_q  # the e4m3 rows that travel, if any
    if (x_s is not None or x_q is not None) and not (
            x_s is not None and fp8_x is not None and (x_q is None or dy_TD is not None) and fp8_x.dtype == FP8
            and fp8_x.shape == x_TD.shape and x_s.shape == (dim // GROUP, x_TD.shape[0])):
        raise ValueError("dispatch_rows: FP8 token rows are x in e4m3 (the forward's x_TD, or the backward's x_q "
                         f"beside dy_TD) with its (D/128, T) scales x_s; got x {tuple(x_TD.shape)} {x_TD.dtype}, "
                         f"x_q {None if x_q is None else (tuple(x_q.shape), x_q.dtype)}, scales "
                         f"{None if x_s is None else tuple(x_s.shape)}, dy given: {dy_TD is not None}")
    if num_slots == 0:
        return
    top_k, num_tokens = topk_idx_TK.shape[1], x_TD.shape[0]
    blocks = send_blocks(ws, dim)
    # The token rows token by token (every row the forward sends, the backward's with xy_per_token), then the slots'
    # fields and counts; the backward's rows per slot in the slot walk itself.
    token_major = dy_TD is None or xy_per_token
    if token_major:
        cols = min(TOKEN_ROWS_COLS, triton.next_power_of_2(dim))
        _send_token_rows_kernel[(triton.cdiv(num_tokens, TOKEN_ROWS_TOKENS), triton.cdiv(dim, cols))](
            x_ptr=x_TD, dy_ptr=dy_TD, xq_ptr=x_q, x_s_ptr=x_s, topk_idx_ptr=topk_idx_TK, peers_ptr=ws.peers,
            epoch_ptr=ws.epoch, rank=ws.rank, R=ws.num_ranks, L=ws.num_local, D=dim, T=num_tokens, top_k=top_k,
            max_tokens=ws.max_tokens, HAS_DY=dy_TD is not None, X_SCALES=x_s is not None, TB=TOKEN_ROWS_TOKENS,
            KB=triton.next_power_of_2(top_k), CB=blocks["CB"], BD=cols)
    _dispatch_rows_kernel[(triton.cdiv(num_slots, ROWS_PER_PROGRAM),)](
        x_ptr=x_TD, dy_ptr=dy_TD, weights_ptr=topk_weights_TK.reshape(-1), row_slot_ptr=plan.row_slot_N,
        offsets_ptr=plan.offsets_E1, topk_idx_ptr=topk_idx_TK, peers_ptr=ws.peers, epoch_ptr=ws.epoch,
        rank=ws.rank, R=ws.num_ranks, L=ws.num_local, D=dim, top_k=top_k, capacity=ws.capacity,
        max_tokens=ws.max_tokens, max_slots=ws.max_slots, HAS_DY=dy_TD is not None, RB=ROWS_PER_PROGRAM,
        KB=triton.next_power_of_2(top_k), **blocks, x_s_ptr=x_s, num_tokens=num_tokens,
        X_SCALES=x_s is not None, GB=triton.next_power_of_2(max(1, dim // GROUP)), xq_ptr=x_q,
        ROWS=not token_major,
    )


def check_fp8_comm_sms(fp8: bool, comm_sms: int) -> None:
    """In FP8 the rows are sent by :func:`dispatch_rows_fp8`, kernels of their own: senders inside the FP8 expert
    kernels' launches are not built yet."""
    if fp8 and comm_sms:
        raise ValueError(f"with precision='fp8' the rows are sent by a dispatch kernel of their own: comm_sms must be "
                         f"0 (or None), got {comm_sms}")


def fp8_xy_per_token(ws: Workspace, fp8_wgrad: bool) -> bool:
    """Whether the FP8 backward's x and dy rows travel once per token and owner (:func:`dispatch_rows`'
    ``xy_per_token``), read by the owner's FP8 weight gradients through ``recv_token_row``: with FP8 weight gradients
    (bf16 ones read sorted slot rows), where the receive buffers hold R * T rows (the API's workspaces, of R * T * K,
    always do; else once per slot)."""
    return fp8_wgrad and ws.capacity >= ws.num_ranks * ws.max_tokens


def dispatch_rows_fp8(ws: Workspace, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                      plan: Plan, dy_TD: torch.Tensor | None = None, token_rows: bool = True,
                      fp8_wgrad: bool = True) -> None:
    """:func:`dispatch_rows` for the FP8 layer, x (in its own dtype) quantised 1x128 here, once: in the forward each
    token's e4m3 row and scales once per owner; in the backward (``dy_TD``) x and dy rows in x's dtype, once per
    token and owner or per slot (:func:`fp8_xy_per_token`, ``fp8_wgrad``: the owners' weight gradients in FP8), and,
    with ``token_rows`` (no saved products, so the owners recompute), each token's e4m3 row and scales too."""
    if dy_TD is None:
        xq, xs = quantize_rows(x_TD)
        dispatch_rows(ws, xq, topk_idx_TK, topk_weights_TK, plan, x_s=xs)
    else:
        xq, xs = quantize_rows(x_TD) if token_rows else (None, None)
        dispatch_rows(ws, x_TD, topk_idx_TK, topk_weights_TK, plan, dy_TD=dy_TD, x_s=xs, x_q=xq,
                      xy_per_token=fp8_xy_per_token(ws, fp8_wgrad))


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
            row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, topk_idx_ptr=topk_idx_TK, send_list_ptr=out,
            num_rows=num_rows, R=num_ranks, L=num_local, top_k=top_k, CARRIES=topk_idx_TK is not None,
            KB=triton.next_power_of_2(top_k), EB=triton.next_power_of_2(num_ranks * num_local),
            BLOCK=SEND_LIST_BLOCK)
    return out
