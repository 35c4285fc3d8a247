"""The fused expert-parallel owner (phases 3 and 4, see protocol.py): my experts on the rows I receive, each GEMM
tile waiting for its rows as they arrive, and the output GEMMs that write each row straight into its source's
slots. The forward's up kernel and the backward's dh' kernel can carry senders in their launch (their first
``comm_sms`` programs run :func:`megamoe.parallel.senders.sender`): communication on those SMs, overlapping the
GEMM on the rest.

Shape legend as in workspace.py: R ranks, L local experts, C receive capacity, D hidden, I intermediate.

No deadlock: the senders are the grid's first programs, so they are resident before any computing program can
wait, and they wait only for counts, which every rank wrote before this launch (docs/DESIGN.md, "Expert
parallelism").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.kernels.backward_fp8 import backward_rows_fp8
from megamoe.kernels.common import (
    busy_tiles,
    descriptor,
    dot_precision,
    persistent_programs,
    rows_k_block,
    sorted_rows_matmul,
    tile_grid,
    tile_rows,
)
from megamoe.kernels.expert_bwd import DX, act_bwd, act_bwd_from_preact, expert_wgrad
from megamoe.kernels.expert_fwd import (
    DOWN,
    UP,
    down_fp8,
    sorted_rows_gemm,
    up_swiglu_block,
    up_swiglu_fp8,
    up_swiglu_fwd,
)
from megamoe.kernels.plan import BLOCK_M, Plan
from megamoe.kernels.quant import fp8_weight
from megamoe.kernels.tuning import TunedKernel, configs
from megamoe.parallel import trace
from megamoe.parallel.protocol import (
    SLOT_SCALAR,
    Y_SLOTS,
    peer,
    received_plan,
    recv_tokens_fp8,
    reset_arrivals,
    signal_returned,
    wait_rows,
    wait_rows_upto,
)
from megamoe.parallel.senders import (
    ROWS_PER_PROGRAM,
    SEND_DH_COLS,
    SEND_DH_ROWS,
    SEND_UP_COLS,
    SEND_UP_ROWS,
    fp8_xy_per_token,
    send_blocks,
    send_list,
    sender,
)
from megamoe.parallel.trace import stamp, tile_trace_at
from megamoe.parallel.workspace import Workspace


@triton.jit
def _up_rows_tile(pid, recv_tokens_ptr, w13_desc, h_ptr, recv_token_row_ptr, recv_offsets_ptr, tile_expert_ptr,
                  tile_row_ptr, arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, D, I, L, R, LB: tl.constexpr,
                  PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVEN_K: tl.constexpr, trace_ptr, trace_at, TRACE: tl.constexpr, preact_ptr,
                  SAVE_PREACT: tl.constexpr):
    """One BM x BN block of the up + SwiGLU GEMM on my received token rows (each received row its own slot, its
    token row through ``recv_token_row``), once the rows of its expert and the lower ones are in
    (``protocol.wait_rows_upto``). TRACE: stamps ``trace_at + 1`` once the rows are in. SAVE_PREACT: also the
    gate and up products into ``preact`` (C, 2I), received-row order (the saved-activation mode)."""
    e, _, rows, rmask, pid_n = tile_rows(pid, tile_expert_ptr, tile_row_ptr, recv_offsets_ptr, tl.cdiv(I, BN), BM,
                                         TILE_M)
    if e >= L:
        return
    wait_rows_upto(arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, e, L, R, LB)
    stamp(trace_ptr, trace_at, 1, TRACE)
    up_swiglu_block(recv_tokens_ptr, w13_desc, h_ptr, recv_token_row_ptr, e, rows, rmask, pid_n, D, I, 1, PREC, BM,
                    BN, BK, EVEN_K, preact_ptr, SAVE_PREACT)


@triton.jit
def _send_and_up_kernel(
    # Programs [0, SENDERS): phase 2 (senders.sender: rows in blocks of RB, strided over them); unread if SENDERS = 0.
    x_ptr, weights_ptr, send_list_ptr, num_rows, top_k, max_tokens, max_slots,
    peers_ptr,  # (buffers, R) int64: every rank's buffers (workspace.BUFFER_INDEX)
    epoch_ptr, rank, R, L, capacity,
    # Programs SENDERS and up: the up kernel on my received token rows (_up_rows_tile), each tile waiting for the
    # rows of its expert and the lower ones (arrived, counts: (R, L); LB >= L; ready: protocol.wait_rows_upto).
    recv_tokens_ptr, w13_desc, h_ptr, recv_token_row_ptr, recv_offsets_ptr, tile_expert_ptr, tile_row_ptr,
    arrived_ptr, counts_ptr, ready_ptr, D, I,
    trace_ptr,  # read if TRACE (see trace.py)
    preact_ptr,  # (C, 2I) out, if SAVE_PREACT: the gate and up products, received-row order
    SENDERS: tl.constexpr, RB: tl.constexpr, LB: tl.constexpr, EB: tl.constexpr,
    CB: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, TRACE: tl.constexpr, SAVE_PREACT: tl.constexpr,
):
    """Phases 2 and 3 in one launch: the first SENDERS programs send my rows while the others compute on
    the rows that have arrived. SENDERS = 0: the GEMM alone, on rows another launch sends."""
    pid = tl.program_id(0)
    # Nested: the outer test is resolved at compile time, so with SENDERS = 0 the sender is not compiled at all
    # (its pointers are None then).
    if SENDERS > 0:  # noqa: SIM102
        if pid < SENDERS:
            sender(pid, x_ptr, x_ptr, weights_ptr, send_list_ptr, num_rows, peers_ptr, epoch_ptr, rank, R, L, D, top_k,
                   capacity, max_tokens, max_slots, False, SENDERS, RB, EB, CB, BD, trace_ptr, TRACE)
            return
    tile_at = tile_trace_at(pid, SENDERS)
    stamp(trace_ptr, tile_at, 0, TRACE)
    _up_rows_tile(pid - SENDERS, recv_tokens_ptr, w13_desc, h_ptr, recv_token_row_ptr, recv_offsets_ptr,
                  tile_expert_ptr, tile_row_ptr, arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, D, I, L, R, LB, PREC,
                  TILE_M, BM, BN, BK, EVEN_K, trace_ptr, tile_at, TRACE, preact_ptr, SAVE_PREACT)
    stamp(trace_ptr, tile_at, 2, TRACE)


@triton.jit
def _dh_rows_tile(pid, dy_ptr, w2_desc, dh_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr, arrived_ptr, counts_ptr,
                  epoch_ptr, D, I, L, R, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, EVEN_K: tl.constexpr, trace_ptr, trace_at, TRACE: tl.constexpr):
    """One BM x BN block of dh' = dy W2[e] on my received dy rows (expert-major: each row its own slot),
    once every source's rows of its expert are in; rows past the expert's end are not written. dy is read
    through pointers: TMA reads through the async proxy, which the acquire does not order (docs/FACTS.md).
    TRACE: stamps ``trace_at + 1`` once the rows are in (see trace.py)."""
    e, _, rows, rmask, pid_n = tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, tl.cdiv(I, BN), BM, TILE_M)
    if e >= L:
        return
    wait_rows(arrived_ptr, counts_ptr, epoch_ptr, e, e, L, R, 1)
    stamp(trace_ptr, trace_at, 1, TRACE)
    n0 = pid_n * BN
    ks = tl.arange(0, BK)
    rows64 = rows[:, None].to(tl.int64)
    a_ptrs = dy_ptr + rows64 * D + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        a = rows_k_block(a_ptrs, rmask, ks, k0, D, EVEN_K)
        # The descriptor zero-fills past D and past the expert's I columns.
        b = w2_desc.load([e, k0, n0]).reshape(BK, BN)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BK
    cols = n0 + tl.arange(0, BN)
    tl.store(dh_ptr + rows64 * I + cols[None, :], acc.to(dh_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols < I)[None, :])


@triton.jit
def _send_and_dh_kernel(
    # Programs [0, SENDERS): phase 2 of the backward (x and dy rows per slot, senders.sender); unread if SENDERS = 0.
    x_ptr, dy_ptr, weights_ptr, send_list_ptr, num_rows, top_k, max_slots,
    peers_ptr, epoch_ptr, rank, R, L, capacity,
    # Programs SENDERS and up: dh' on my received dy rows (_dh_rows_tile), each tile waiting for its expert's rows.
    recv_dy_ptr, w2_desc, dh_ptr, recv_offsets_ptr, tile_expert_ptr, tile_row_ptr, arrived_ptr, counts_ptr, D, I,
    trace_ptr,  # read if TRACE (see trace.py)
    SENDERS: tl.constexpr, RB: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, TRACE: tl.constexpr,
):
    """The backward's phase 2 and its first GEMM in one launch (see _send_and_up_kernel). SENDERS = 0: the GEMM
    alone, on rows another launch sends."""
    pid = tl.program_id(0)
    # Nested: the outer test is resolved at compile time, so with SENDERS = 0 the sender is not compiled at all
    # (its pointers are None then).
    if SENDERS > 0:  # noqa: SIM102
        if pid < SENDERS:
            sender(pid, x_ptr, dy_ptr, weights_ptr, send_list_ptr, num_rows, peers_ptr, epoch_ptr, rank, R, L, D, top_k,
                   capacity, 0, max_slots, True, SENDERS, RB, EB, CB, BD, trace_ptr, TRACE)
            return
    tile_at = tile_trace_at(pid, SENDERS)
    stamp(trace_ptr, tile_at, 0, TRACE)
    _dh_rows_tile(pid - SENDERS, recv_dy_ptr, w2_desc, dh_ptr, recv_offsets_ptr, tile_expert_ptr, tile_row_ptr,
                  arrived_ptr, counts_ptr, epoch_ptr, D, I, L, R, PREC, TILE_M, BM, BN, BK, EVEN_K, trace_ptr, tile_at,
                  TRACE)
    stamp(trace_ptr, tile_at, 2, TRACE)


@triton.jit
def _rows_to_peer_slots_kernel(
    a_desc,  # (C, K) my received rows (or their dz); block (BM, BK)
    w_desc,  # my experts: (L, N_OUT, K) if W_K_LAST, block (1, BN, BK); else (L, K, N_OUT), block (1, BK, BN)
    weights_ptr,  # (C,) routing weight of each received row (read if WEIGHTED)
    scalar_ptr,  # (C,) fp32 per received row, sent along to the source's slot_scalar (read if SCALAR)
    recv_meta_ptr,  # (C,) src * S + slot of each received row
    peers_ptr,  # (buffers, R) int64: every rank's buffers (workspace.BUFFER_INDEX)
    offsets_ptr, tile_expert_ptr, tile_row_ptr,  # the plan of my received rows
    N_OUT, K, E, R, max_slots,
    PROGRAMS,  # the grid's size; read only if PERSISTENT
    W_K_LAST: tl.constexpr, WEIGHTED: tl.constexpr, SCALAR: tl.constexpr, PERSISTENT: tl.constexpr,
    EB: tl.constexpr, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):
    """The down projection (forward) or dx (backward) of my experts, written straight into the source
    rank's slot rows: no output buffer here, no copy afterwards. Plain stores: the sources learn that
    their rows are whole from ``protocol.signal_returned``, launched after this kernel (a release per
    tile, the first version, made this GEMM 1.7x slower than the one-device one; docs/PERFORMANCE.md).
    PERSISTENT as for the one-device twin (``expert_fwd.sorted_rows_gemm_kernel``): PROGRAMS programs
    stride over the busy tiles, so one tile's stores into the peers overlap the next tile's loads."""
    num_n = tl.cdiv(N_OUT, BN)
    if PERSISTENT:
        work = busy_tiles(offsets_ptr, E, EB, TILE_M) * (TILE_M // BM) * num_n
        for pid in tl.range(tl.program_id(0), work, PROGRAMS, flatten=True):
            _rows_to_peer_slots_tile(pid, a_desc, w_desc, weights_ptr, scalar_ptr, recv_meta_ptr, peers_ptr,
                                     offsets_ptr, tile_expert_ptr, tile_row_ptr, N_OUT, K, E, R, max_slots, num_n,
                                     W_K_LAST, WEIGHTED, SCALAR, False, PREC, TILE_M, BM, BN, BK)
    else:
        _rows_to_peer_slots_tile(tl.program_id(0), a_desc, w_desc, weights_ptr, scalar_ptr, recv_meta_ptr, peers_ptr,
                                 offsets_ptr, tile_expert_ptr, tile_row_ptr, N_OUT, K, E, R, max_slots, num_n,
                                 W_K_LAST, WEIGHTED, SCALAR, True, PREC, TILE_M, BM, BN, BK)


@triton.jit
def _rows_to_peer_slots_tile(pid, a_desc, w_desc, weights_ptr, scalar_ptr, recv_meta_ptr, peers_ptr, offsets_ptr,
                             tile_expert_ptr, tile_row_ptr, N_OUT, K, E, R, max_slots, num_n, W_K_LAST: tl.constexpr,
                             WEIGHTED: tl.constexpr, SCALAR: tl.constexpr, SKIP_IDLE: tl.constexpr,
                             PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr):
    """One BM x BN output block of ``_rows_to_peer_slots_kernel``. SKIP_IDLE: return on an idle tile (a
    persistent caller visits busy tiles only)."""
    e, row0, rows, rmask, pid_n = tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, BM, TILE_M)
    if SKIP_IDLE and e >= E:
        return
    n0 = pid_n * BN
    acc = sorted_rows_matmul(a_desc, w_desc, e, row0, n0, K, W_K_LAST, BM, BN, BK, PREC)
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + rows, mask=rmask, other=0.0)[:, None]
    meta = tl.load(recv_meta_ptr + rows, mask=rmask, other=0)
    src = meta // max_slots
    slot = (meta % max_slots).to(tl.int64)
    cols = n0 + tl.arange(0, BN)
    # Each row's first element at its source; 16-byte aligned (rows are 16-byte multiples, buffers
    # aligned), which lets the compiler store 16 bytes at a time (it cannot know it for loaded pointers).
    out_rows = tl.multiple_of(peer(peers_ptr, Y_SLOTS, src, R, a_desc.dtype) + slot * N_OUT, 16)
    tl.store(out_rows[:, None] + cols[None, :], acc.to(a_desc.dtype), mask=rmask[:, None] & (cols < N_OUT)[None, :])
    if SCALAR:  # by the first N-block; a mask, not an `if`: a branch on it fails to compile in the persistent loop
        first = rmask & (pid_n == 0)
        tl.store(peer(peers_ptr, SLOT_SCALAR, src, R, tl.float32) + slot, tl.load(scalar_ptr + rows, mask=first),
                 mask=first)


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
# Never autotuned (it moves rows into peers and counts them): the tiles UP chose on the same operands.
SEND_UP = TunedKernel(_send_and_up_kernel, default=UP.default, candidates=[], key=UP.key, even_k=UP.even_k,
                      blocks=UP.blocks, follows=UP)
# Never autotuned either (it moves rows too): one fixed config, which the autotuner launches once as it is.
SEND_DH = TunedKernel(_send_and_dh_kernel, default=configs((128, 256, 64, 8, 3))[0], candidates=[], key=["D", "I"],
                      even_k=lambda a: a["D"] % a["BK"] == 0, blocks=lambda c: {"w2_desc": [1, c["BK"], c["BN"]]})


def send_and_up(ws: Workspace, w13_LHD: torch.Tensor, recv_plan: Plan, counts: torch.Tensor, send: tuple | None = None,
                compute: bool = True, preact_C2I: torch.Tensor | None = None) -> torch.Tensor:
    """Phase 3's up + SwiGLU GEMM on my received token rows (``recv_plan``), each tile once the rows of its expert
    and the lower ones are in (``_send_and_up_kernel``). Returns h (C, I) in received-row order. With
    ``send = (x_TD, topk_idx_TK, topk_weights_TK, plan, comm_sms)``, phase 2 in the same launch: ``comm_sms``
    programs send my rows (``plan``; each token's row once per owner); without it, another launch sent them.
    ``compute=False``: the senders alone (the loopback's way to run them for several virtual ranks on one
    stream; h is not written). ``preact_C2I`` (capacity, 2I) in w13's dtype: also the gate and up products of
    each received row (the saved-activation mode)."""
    num_local, two_i, dim = w13_LHD.shape
    inter = two_i // 2
    if not UP.has_tuned(w13_LHD.dtype, D=dim, I=inter):  # choose the tiles on the plain kernel (rows: any)
        up_swiglu_fwd(ws.recv_x, w13_LHD, recv_plan, top_k=1, gluon=False)
    x_TD, topk_idx_TK, topk_weights_TK, plan, comm_sms = send or (None, None, None, None, 0)
    h_CI = torch.empty(ws.capacity, inter, device=w13_LHD.device, dtype=w13_LHD.dtype)
    tiles = tile_grid(recv_plan, inter)
    stamps = trace.buffer_for("up", comm_sms, recv_plan, inter) if comm_sms else None
    SEND_UP[lambda cfg: (comm_sms + (tiles(cfg)[0] if compute else 0),)](
        x_ptr=x_TD, weights_ptr=None if send is None else topk_weights_TK.reshape(-1),
        send_list_ptr=None if send is None else send_list(plan, ws.num_ranks, num_local, topk_idx_TK),
        num_rows=0 if send is None else plan.row_slot_N.numel(), top_k=0 if send is None else topk_idx_TK.shape[1],
        max_tokens=ws.max_tokens, max_slots=ws.max_slots, peers_ptr=ws.peers, epoch_ptr=ws.epoch, rank=ws.rank,
        R=ws.num_ranks, L=num_local, capacity=ws.capacity,
        recv_tokens_ptr=ws.recv_tokens, w13_desc=descriptor(w13_LHD.view(num_local, 2, inter, dim)), h_ptr=h_CI,
        recv_token_row_ptr=ws.recv_token_row, recv_offsets_ptr=recv_plan.offsets_E1,
        tile_expert_ptr=recv_plan.tile_expert_NT, tile_row_ptr=recv_plan.tile_row_NT, arrived_ptr=ws.arrived,
        counts_ptr=counts, ready_ptr=ws.ready, D=dim, I=inter, trace_ptr=stamps, preact_ptr=preact_C2I,
        SAVE_PREACT=preact_C2I is not None, SENDERS=comm_sms, RB=SEND_UP_ROWS, LB=triton.next_power_of_2(num_local),
        **send_blocks(ws, dim, SEND_UP_COLS),
        PREC=dot_precision(w13_LHD.dtype), TILE_M=BLOCK_M, TRACE=stamps is not None, dtype=w13_LHD.dtype,
    )
    return h_CI


def send_and_dh(ws: Workspace, w2_LDI: torch.Tensor, recv_plan: Plan, counts: torch.Tensor, send: tuple | None = None,
                compute: bool = True) -> torch.Tensor:
    """The backward's dh' = dy W2[e] (C, I) on my received dy rows (``recv_plan``), each tile once its expert's
    rows are in (``_send_and_dh_kernel``); rows past the routed count are not written. With ``send = (x_TD, dy_TD,
    topk_weights_TK, plan, comm_sms)``, phase 2 in the same launch: ``comm_sms`` programs send my x and dy rows;
    without it, another launch sent them. ``compute=False``: the senders alone (as for :func:`send_and_up`; dh'
    is not written)."""
    num_local, dim, inter = w2_LDI.shape
    x_TD, dy_TD, topk_weights_TK, plan, comm_sms = send or (None, None, None, None, 0)
    dh_CI = torch.empty(ws.capacity, inter, device=w2_LDI.device, dtype=w2_LDI.dtype)
    tiles = tile_grid(recv_plan, inter)
    stamps = trace.buffer_for("dh", comm_sms, recv_plan, inter) if comm_sms else None
    SEND_DH[lambda cfg: (comm_sms + (tiles(cfg)[0] if compute else 0),)](
        x_ptr=x_TD, dy_ptr=dy_TD, weights_ptr=None if send is None else topk_weights_TK.reshape(-1),
        send_list_ptr=None if send is None else send_list(plan, ws.num_ranks, num_local),
        num_rows=0 if send is None else plan.row_slot_N.numel(), top_k=0 if send is None else topk_weights_TK.shape[1],
        max_slots=ws.max_slots, peers_ptr=ws.peers, epoch_ptr=ws.epoch, rank=ws.rank, R=ws.num_ranks, L=num_local,
        capacity=ws.capacity, recv_dy_ptr=ws.recv_dy, w2_desc=descriptor(w2_LDI), dh_ptr=dh_CI,
        recv_offsets_ptr=recv_plan.offsets_E1, tile_expert_ptr=recv_plan.tile_expert_NT,
        tile_row_ptr=recv_plan.tile_row_NT, arrived_ptr=ws.arrived, counts_ptr=counts, D=dim, I=inter,
        trace_ptr=stamps, SENDERS=comm_sms, RB=SEND_DH_ROWS, **send_blocks(ws, dim, SEND_DH_COLS),
        PREC=dot_precision(w2_LDI.dtype), TILE_M=BLOCK_M, TRACE=stamps is not None, dtype=w2_LDI.dtype,
    )
    return dh_CI


def rows_to_peer_slots(ws: Workspace, kernel: TunedKernel, a_CK: torch.Tensor, w_L: torch.Tensor, plan: Plan,
                       n_out: int, weights_C: torch.Tensor | None = None, scalar_C: torch.Tensor | None = None) -> None:
    """Launch ``_rows_to_peer_slots_kernel`` as ``kernel`` (DOWN_PEER or DX_PEER) configures it, then signal the
    sources. The first time a shape is seen with autotuning on, the one-device twin (DOWN or DX) runs once on
    the same operands into a scratch output, to choose the tiles (a host sync, like any first autotuned call)."""
    twin = kernel.follows
    if not twin.has_tuned(a_CK.dtype, N_OUT=n_out, K=a_CK.shape[1]) and plan.row_slot_N.numel():
        sorted_rows_gemm(twin, a_CK, w_L, weights_C, plan, n_out)
    programs, tiles = persistent_programs(a_CK.device), tile_grid(plan, n_out)
    kernel[lambda cfg: (programs,) if cfg["PERSISTENT"] else tiles(cfg)](
        a_desc=descriptor(a_CK), w_desc=descriptor(w_L), weights_ptr=weights_C, scalar_ptr=scalar_C,
        recv_meta_ptr=ws.recv_meta, peers_ptr=ws.peers, offsets_ptr=plan.offsets_E1,
        tile_expert_ptr=plan.tile_expert_NT, tile_row_ptr=plan.tile_row_NT, N_OUT=n_out, K=a_CK.shape[1],
        E=w_L.shape[0], R=ws.num_ranks, max_slots=ws.max_slots, PROGRAMS=programs,
        EB=triton.next_power_of_2(w_L.shape[0]), PREC=dot_precision(a_CK.dtype), TILE_M=BLOCK_M, dtype=a_CK.dtype,
    )
    signal_returned(ws)


@triton.jit
def _rows_to_sources_kernel(rows_ptr, row_map_ptr, scalar_ptr, recv_meta_ptr, offsets_ptr, peers_ptr, R, L, D,
                            max_slots, ROW_MAP: tl.constexpr, SCALAR: tl.constexpr, RB: tl.constexpr,
                            BD: tl.constexpr):
    """Each received row's output into its source's slot (``recv_meta``): row r of ``rows`` (D > 0), or with ROW_MAP
    row ``row_map[r]``, and with SCALAR ``scalar[r]`` into the source's ``slot_scalar``; rows past the routed count
    are not read."""
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    rmask = rows < tl.load(offsets_ptr + L)
    src_rows = rows.to(tl.int64)
    if ROW_MAP:
        src_rows = tl.load(row_map_ptr + rows, mask=rmask, other=0).to(tl.int64)
    meta = tl.load(recv_meta_ptr + rows, mask=rmask, other=0)
    out_rows = tl.multiple_of(peer(peers_ptr, Y_SLOTS, meta // max_slots, R, rows_ptr.dtype.element_ty)
                              + (meta % max_slots).to(tl.int64) * D, 16)
    if SCALAR:
        tl.store(peer(peers_ptr, SLOT_SCALAR, meta // max_slots, R, tl.float32) + meta % max_slots,
                 tl.load(scalar_ptr + rows, mask=rmask), mask=rmask)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        m = rmask[:, None] & (ds < D)[None, :]
        tl.store(out_rows[:, None] + ds[None, :], tl.load(rows_ptr + src_rows[:, None] * D + ds[None, :], mask=m),
                 mask=m)


@triton.jit
def _row_destinations_kernel(dest_ptr, recv_meta_ptr, offsets_ptr, peers_ptr, base, R, L, D, max_slots,
                             UNIT: tl.constexpr, RB: tl.constexpr):
    """``dest[r]``: where received row r's output goes, its source's ``y_slots`` row (``recv_meta``), in UNIT-element
    (16-byte) units from address ``base``; rows past the routed count are not written."""
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    rmask = rows < tl.load(offsets_ptr + L)
    meta = tl.load(recv_meta_ptr + rows, mask=rmask, other=0)
    source_base = tl.load(peers_ptr + Y_SLOTS * R + meta // max_slots, mask=rmask, other=0)
    tl.store(dest_ptr + rows, (source_base - base) // 16 + (meta % max_slots).to(tl.int64) * (D // UNIT), mask=rmask)


# The kernels without a tile config, for the ahead-of-time compile check (``tools.resources``).
KERNELS = (_rows_to_sources_kernel, _row_destinations_kernel)


def rows_to_sources(ws: Workspace, plan: Plan, rows: torch.Tensor | None, row_map: torch.Tensor | None = None,
                    scalars: torch.Tensor | None = None) -> None:
    """Every row I received (``plan``: :func:`protocol.received_plan`'s) gets its output row of ``rows`` (D wide,
    ``y_slots``' dtype) — row r, or ``row_map[r]`` — sent into its source's ``y_slots``, and ``scalars[r]`` (fp32,
    the backward's d(routing weight)) into its ``slot_scalar``; then the signal to every source
    (``protocol.signal_returned``). A copy of its own, for outputs that no peer-writing GEMM wrote; ``rows`` None:
    the scalars alone (the rows are there already: :func:`row_destinations`)."""
    dim = 0 if rows is None else rows.shape[1]
    _rows_to_sources_kernel[(triton.cdiv(ws.capacity, ROWS_PER_PROGRAM),)](
        rows_ptr=rows if rows is not None else ws.y_slots, row_map_ptr=row_map, scalar_ptr=scalars,
        recv_meta_ptr=ws.recv_meta, offsets_ptr=plan.offsets_E1, peers_ptr=ws.peers, R=ws.num_ranks,
        L=ws.num_local, D=dim, max_slots=ws.max_slots, ROW_MAP=row_map is not None, SCALAR=scalars is not None,
        RB=ROWS_PER_PROGRAM, BD=send_blocks(ws, max(dim, 1))["BD"])
    signal_returned(ws)


def row_destinations(ws: Workspace, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, row_dest) for an output GEMM that writes each received row (``plan``) straight into its source's
    ``y_slots`` (``expert_fwd.sorted_rows_gemm``'s ``dest``): base my own ``y_slots``, ``row_dest`` (capacity,)
    int64 each row's offset from it in 16-byte units (the buffers are 16-byte aligned, their rows 16-byte
    multiples). The caller then signals the sources (``protocol.signal_returned``)."""
    dim = ws.y_slots.shape[1]
    unit = 16 // ws.y_slots.element_size()
    assert ws.y_slots.data_ptr() % 16 == 0 and dim % unit == 0
    dest = torch.empty(ws.capacity, device=ws.y_slots.device, dtype=torch.int64)
    _row_destinations_kernel[(triton.cdiv(ws.capacity, ROWS_PER_PROGRAM),)](
        dest_ptr=dest, recv_meta_ptr=ws.recv_meta, offsets_ptr=plan.offsets_E1, peers_ptr=ws.peers,
        base=ws.y_slots.data_ptr(), R=ws.num_ranks, L=ws.num_local, D=dim, max_slots=ws.max_slots, UNIT=unit,
        RB=ROWS_PER_PROGRAM)
    return ws.y_slots, dest


def token_rows(ws: Workspace, plan: Plan) -> Plan:
    """``plan`` (of my received rows) with each row read from its token's row (``recv_token_row``: ``src * T +
    token``, each token's row received once per owner) of ``recv_tokens`` (the forward's rows, the FP8 recompute's)
    or, in the FP8 backward, of ``recv_x`` / ``recv_dy``, for kernels that take a plan and top_k 1."""
    return Plan(plan.offsets_E1, ws.recv_token_row, plan.tile_expert_NT, plan.tile_row_NT)


def owner_experts_fp8(ws: Workspace, w13_LHD: torch.Tensor, w2_LDI: torch.Tensor,
                      preact_C2I: torch.Tensor | None = None) -> None:
    """Phases 3 and 4 of the forward with my rows received in FP8 (``senders.dispatch_rows`` given x's scales):
    once every row is in, the one-device FP8 kernels over them — the up kernel reading each received row's token
    row and scales from ``protocol.recv_tokens_fp8`` (through ``recv_token_row``), the down kernel weighting each
    output row by its routing weight and writing it straight into its source's ``y_slots`` (:func:`row_destinations`).
    The rows are not waited for tile by tile, so the exchange does not yet overlap the GEMMs. ``preact_C2I``: as
    for :func:`owner_experts`."""
    plan, counts = received_plan(ws)
    reset_arrivals(ws, counts)  # returns once every row is in
    xq, xs = recv_tokens_fp8(ws)
    w13q, w13s, _, _ = fp8_weight(w13_LHD, transposed=False)
    w2q, w2s, _, _ = fp8_weight(w2_LDI, transposed=False)
    hq, hs = up_swiglu_fp8(xq, xs, w13q, w13s, token_rows(ws, plan), 1, preact_NH=preact_C2I)
    down_fp8(hq, hs, w2q, w2s, ws.recv_weight, plan, ws.y_slots.dtype, dest=row_destinations(ws, plan))
    signal_returned(ws)


def owner_experts_backward_fp8(ws: Workspace, w13_LHD: torch.Tensor, w2_LDI: torch.Tensor, fp8_wgrad: bool,
                               preact_C2I: torch.Tensor | None = None, reuse_preact: bool = False):
    """Phases 3 and 4 of the backward in blockwise FP8, on the x and dy rows I received (in x's dtype: the FP8
    weight gradients quantise them 128x1 from their values, not from 1x128 copies; each token's once, read through
    :func:`token_rows`, where ``senders.fp8_xy_per_token`` says): once every row is in, the
    one-device FP8 backward's steps over them (``kernels.backward_fp8.backward_rows_fp8``, ``fp8_wgrad``: FP8 weight
    gradients), each dx row written straight into its source's slot by its GEMM (:func:`row_destinations`) and its
    d(routing weight) sent after it (:func:`rows_to_sources`), before dW13 (after it with bf16 weight gradients).
    ``preact_C2I``, ``reuse_preact``: as
    for :func:`owner_experts_backward`, from :func:`owner_experts_fp8`; without ``preact_C2I`` the gate and up
    products are recomputed from each token's FP8 row, which the sources sent once per owner beside the slot rows
    (``senders.dispatch_rows(x_q=)``), as the forward's up kernel read them. Returns dw13 and dw2 of my experts."""
    plan, counts = received_plan(ws)
    reset_arrivals(ws, counts)  # returns once every row is in
    recompute_from = None
    if preact_C2I is None:
        recompute_from = (*recv_tokens_fp8(ws), token_rows(ws, plan), 1)
    x, dy, rows_from = ws.recv_x, ws.recv_dy, None
    if fp8_xy_per_token(ws, fp8_wgrad):
        token_rows_in = ws.num_ranks * ws.max_tokens
        x, dy, rows_from = ws.recv_x[:token_rows_in], ws.recv_dy[:token_rows_in], (token_rows(ws, plan), 1)
    _, _, dw13, dw2 = backward_rows_fp8(
        dy, x, ws.recv_weight[:, None], w13_LHD, w2_LDI, plan, 1,
        lambda _, dweight: rows_to_sources(ws, plan, None, scalars=dweight.view(-1)), fp8_wgrad=fp8_wgrad,
        preact=preact_C2I, reuse_preact=reuse_preact, recompute_from=recompute_from,
        dx_dest=row_destinations(ws, plan), rows_from=rows_from)
    return dw13, dw2


def owner_experts(ws: Workspace, w13_LHD: torch.Tensor, w2_LDI: torch.Tensor, send: tuple | None = None,
                  preact_C2I: torch.Tensor | None = None) -> None:
    """Phases 3 and 4, forward: my experts on the rows I receive; the down GEMM writes each weighted
    row straight into its source's ``y_slots``. ``send = (x_TD, topk_idx_TK, topk_weights_TK, plan,
    comm_sms)``: phase 2 runs in the up kernel's launch, on ``comm_sms`` of its programs (:func:`send_and_up`);
    without it, the caller has run ``senders.dispatch_rows``. ``preact_C2I``: also the received rows' gate and up
    products (the saved-activation mode; the backward receives its rows in the same order)."""
    plan, counts = received_plan(ws)
    h = send_and_up(ws, w13_LHD, plan, counts, send, preact_C2I=preact_C2I)
    reset_arrivals(ws, counts)
    rows_to_peer_slots(ws, DOWN_PEER, h, w2_LDI, plan, w2_LDI.shape[1], weights_C=ws.recv_weight)


def owner_experts_backward(ws: Workspace, w13_LHD: torch.Tensor, w2_LDI: torch.Tensor, send: tuple | None = None,
                           preact_C2I: torch.Tensor | None = None, reuse_preact: bool = False):
    """Phases 3 and 4, backward: dh' on the received dy rows as they arrive (:func:`send_and_dh`), then the
    one-GPU backward's act kernel (the gate/up GEMM recomputed; on sm90 the warp-specialized one) on the received
    x rows and dh' — the rows are already in expert order, so nothing is gathered; the dx GEMM writes each row,
    and its d(routing weight), straight into the source's slots. Returns dw13 and dw2 of my experts.
    ``send = (x_TD, dy_TD, topk_weights_TK, plan, comm_sms)``: phase 2 runs in the dh' kernel's launch;
    without it, the caller ran ``senders.dispatch_rows`` (or the senders' launch). ``preact_C2I``: the forward's
    gate and up products of the same received rows (:func:`owner_experts`), for the act step instead of its GEMM:
    a row lands at the same place in both directions (its source's base for the expert, plus its index among the
    source's rows of that expert); ``reuse_preact``: dz is written over it (the caller will not read it again)."""
    plan, counts = received_plan(ws)
    dh = send_and_dh(ws, w2_LDI, plan, counts, send)
    # Every expert's rows are in: each expert with rows had a dh' tile wait for them.
    reset_arrivals(ws, counts)
    if preact_C2I is None:
        dz, hw, dweight = act_bwd(ws.recv_x, dh, w13_LHD, ws.recv_weight[:, None], plan, top_k=1)
    else:
        dz, hw, dweight = act_bwd_from_preact(preact_C2I, dh, ws.recv_weight[:, None], plan, top_k=1,
                                              dz_over_preact=reuse_preact)
    rows_to_peer_slots(ws, DX_PEER, dz, w13_LHD, plan, w13_LHD.shape[2], scalar_C=dweight.view(-1))
    return (expert_wgrad(dz, ws.recv_x, plan, w13_LHD.dtype, gemm="dw13"),
            expert_wgrad(ws.recv_dy, hw, plan, w2_LDI.dtype, gemm="dw2"))
