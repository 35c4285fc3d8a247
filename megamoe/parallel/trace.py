"""The sending kernels' trace: global-timer stamps at fixed points of the forward's send + up and the backward's
send + dh' launches (``tools.sender_trace`` reads them). Off unless a :func:`recording` is open; the
kernels take it as a constexpr ``TRACE`` flag, so an untraced launch compiles to the same code as if the stamps
were not there.

Stamp layout of one traced launch (int64 ns, -1 where none was taken): per sending program ``TRACE_STRIDE``
stamps — ``TRACE_HEAD`` (start, counts in, end), then ``TRACE_PER_BLOCK`` per block for its first
``TRACE_BLOCKS`` blocks (start; copies issued; metadata stored; released; and, as the next block's start, the
overflow counts and the next entries) — then ``TRACE_PER_TILE`` per GEMM tile program (start; its rows in, if
it has any; end).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from megamoe.kernels.plan import BLOCK_M, Plan

TRACE_HEAD, TRACE_PER_BLOCK, TRACE_BLOCKS, TRACE_PER_TILE = (tl.constexpr(3), tl.constexpr(4), tl.constexpr(128),
                                                             tl.constexpr(3))
TRACE_STRIDE = tl.constexpr(TRACE_HEAD.value + TRACE_PER_BLOCK.value * TRACE_BLOCKS.value)  # stamps per sender

_recorded: dict | None = None  # kernel ("up", "dh") → its latest traced launch, while a recording is open


@triton.jit
def stamp(trace_ptr, at, k, TRACE: tl.constexpr):
    """``trace[at + k] = now`` (the GPU's global timer, ns) if TRACE and ``at >= 0``."""
    if TRACE:
        tl.store(trace_ptr + at + k, globaltimer(), mask=at >= 0)


@triton.jit
def tile_trace_at(pid, SENDERS: tl.constexpr):
    """Where GEMM tile program ``pid`` (>= SENDERS) of a sending kernel's launch stamps, after the senders'."""
    return SENDERS * TRACE_STRIDE + TRACE_PER_TILE * (pid - SENDERS)


@contextlib.contextmanager
def recording():
    """Trace the sending kernels launched inside: yields a dict that holds, per kernel ("up": send + up, "dh":
    send + dh'), its latest traced launch as ``{"stamps": (n,) int64, "senders": S, "stride": TRACE_STRIDE}``
    (read it after a device synchronisation)."""
    global _recorded
    _recorded = {}
    try:
        yield _recorded
    finally:
        _recorded = None


def buffer_for(kernel: str, senders: int, recv_plan: Plan, n_dim: int) -> torch.Tensor | None:
    """Inside :func:`recording`, a new stamp buffer for ``kernel``'s next launch ("up" or "dh"), kept in the
    recording with its layout; else None (the launch is not traced)."""
    if _recorded is None:
        return None
    grid = recv_plan.tile_expert_NT.numel() * (BLOCK_M // 64) * triton.cdiv(n_dim, 64)  # the smallest tiles: 64 x 64
    stamps = torch.full((senders * TRACE_STRIDE.value + TRACE_PER_TILE.value * grid,), -1,
                        device=recv_plan.offsets_E1.device, dtype=torch.int64)
    _recorded[kernel] = {"stamps": stamps, "senders": senders, "stride": TRACE_STRIDE.value}
    return stamps
