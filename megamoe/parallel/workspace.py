"""Buffers of the fused expert-parallel protocol, and the table of every rank's base addresses that the
protocol's kernels (protocol.py, senders.py, owner.py) read and write through.

Shape legend: R ranks, L local experts per rank, C receive capacity (rows one rank can receive per call,
from all sources), T token capacity (tokens one rank can send per call), S slot capacity (T*K slots one
rank can send per call), D hidden size.

Each rank owns one set of buffers; a peer's buffer is reached through ``peers[BUFFER_INDEX[name], peer]`` (an
int64 address the kernels cast to a pointer: one (len(BUFFERS), R) table, which every kernel takes as one
argument). Two ways to build them, with the same kernels:

* :func:`loopback_workspaces` — R virtual ranks on one device (ordinary tensors): the protocol (counts,
  flags, peer writes, returns) is tested and profiled on one GPU, or on CPU in the Triton interpreter;
* :func:`symmetric_workspace` — one rank per GPU of a node: every buffer lives in one symmetric-memory
  allocation (``torch.distributed._symmetric_memory``, CUDA backend, NVLink multicast off), so a peer's
  buffer is its base address (from the rendezvous) plus the buffer's offset.

Flags never need a host round trip: ``counts_flag`` holds the call's epoch (a device counter every call
increments), ``arrived`` counts rows and ``returned`` counts owners that have written back; each is
reset by its only reader once it has seen them all. ``counts`` and ``counts_flag`` come in two copies, picked by the epoch's parity: a rank
that has finished a call may write the next call's counts while a slower rank still reads this call's
(it cannot get two calls ahead: the next dispatch waits for every rank's next counts). See
docs/DESIGN.md ("Expert parallelism") for why no wait deadlocks. Every wait is also bounded
(``MEGAMOE_EP_TIMEOUT_S``): one that gives up writes the rank's error record into its control block
(``CONTROL``: the epoch, then the record), which :meth:`Workspace.check_error` raises.
"""

from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

# Most expert-parallel ranks the kernels' wait loops handle (one node).
MAX_EP_RANKS = 16

# name: (shape from (R, L, C, T, S, D), dtype; None = the activation dtype)
BUFFERS = {
    # [epoch % 2, src, l]: rows src sends to my expert l (two copies: see below)
    "counts": (lambda R, L, C, T, S, D: (2, R, L), torch.int32),
    "counts_flag": (lambda R, L, C, T, S, D: (2, R), torch.int32),  # [epoch % 2, src]: epoch once src's counts are in
    "arrived": (lambda R, L, C, T, S, D: (R, L), torch.int32),  # [src, l]: rows of (src, l) written so far
    # epoch * (L + 1) + n once one of my up tiles has seen experts 0..n-1 arrived (protocol.wait_rows_upto)
    "ready": (lambda R, L, C, T, S, D: (1,), torch.int64),
    # Forward: each source's token rows, src * T + token, written once per (token, owner) however many of
    # the owner's experts the token picked.
    "recv_tokens": (lambda R, L, C, T, S, D: (R * T, D), None),
    "recv_token_row": (lambda R, L, C, T, S, D: (C,), torch.int32),  # forward: recv_tokens row of each received row
    # backward: received rows, expert-major, then source-major (the FP8 layer's: each token's at src * T + token,
    # senders.fp8_xy_per_token); recv_dy likewise
    "recv_x": (lambda R, L, C, T, S, D: (C, D), None),
    "recv_meta": (lambda R, L, C, T, S, D: (C,), torch.int32),  # src * S + slot of each received row
    "recv_weight": (lambda R, L, C, T, S, D: (C,), torch.float32),  # routing weight of each received row
    "recv_dy": (lambda R, L, C, T, S, D: (C, D), None),  # backward: dy of each received row's token
    "y_slots": (lambda R, L, C, T, S, D: (S, D), None),  # rows sent back (forward: weighted outputs; backward: dx)
    "slot_scalar": (lambda R, L, C, T, S, D: (S,), torch.float32),  # backward: d(routing weight) sent back
    "returned": (lambda R, L, C, T, S, D: (R,), torch.int64),  # [owner]: 1 once owner has written back my rows
    "overflow": (lambda R, L, C, T, S, D: (1,), torch.int32),  # rows that did not fit (sticky)
}
# Row of each buffer in the peer table (``Workspace.peers``); the kernels name them by these indices.
BUFFER_INDEX = {name: i for i, name in enumerate(BUFFERS)}

# Words of a rank's control block (``Workspace.control``, int32, its own memory only): the call's epoch, the record
# of the first wait of this rank that gave up (stage 0: none; see STAGES below), and the bounds its waits read.
CONTROL = {"epoch": 0, "err_stage": 1, "err_peer": 2, "err_index": 3, "err_expected": 4, "err_seen": 5,
           "err_epoch": 6, "timeout_us": 7, "poll_limit": 8}
CONTROL_WORDS = 16
DEFAULT_TIMEOUT_S = 10.0
# In Triton's CPU interpreter there is no global timer: a wait gives up after this many polls per second of the
# timeout instead (a poll of the interpreter takes about a millisecond).
INTERPRETER_POLLS_PER_S = 1000


def ep_timeout_s() -> float:
    """How long one wait of the fused protocol spins before it gives up: ``MEGAMOE_EP_TIMEOUT_S`` (default 10 s,
    read when a workspace is made)."""
    value = float(os.environ.get("MEGAMOE_EP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if not 0 < value <= 2000:
        raise ValueError(f"MEGAMOE_EP_TIMEOUT_S={value}: 0 < seconds <= 2000")
    return value


def new_control(device) -> torch.Tensor:
    control = torch.zeros(CONTROL_WORDS, dtype=torch.int32, device=device)
    timeout = ep_timeout_s()
    control[CONTROL["timeout_us"]] = int(timeout * 1e6)
    control[CONTROL["poll_limit"]] = max(1, int(timeout * INTERPRETER_POLLS_PER_S))
    return control


# Every live workspace of the process by its number (``Workspace.number``), by which the fused layer's custom ops
# name it (a custom op cannot take the object). Weak: a workspace lives as long as the layers (or tests) that hold it.
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def by_number(number: int) -> Workspace:
    """The live workspace numbered ``number`` (``Workspace.number``)."""
    ws = _LIVE.get(number)
    if ws is None:
        raise RuntimeError(f"expert-parallel workspace {number} no longer exists (a layer's backward ran after its "
                           "workspace was dropped)")
    return ws


@dataclass
class Workspace:
    """One rank's view: its own buffers, every rank's addresses, and its call counter."""

    rank: int
    num_ranks: int
    num_local: int
    capacity: int
    max_tokens: int
    max_slots: int
    buffers: dict[str, torch.Tensor]
    peers: torch.Tensor
    """(len(BUFFERS), R) int64: row ``BUFFER_INDEX[name]`` holds that buffer's base address on every rank."""
    control: torch.Tensor
    """(CONTROL_WORDS,) int32 on the device: the epoch (incremented at the start of every call, no host sync),
    the error record of a wait that gave up, and the waits' bound (see CONTROL)."""
    handle: object = None
    """The symmetric-memory rendezvous, kept alive with the workspace (None for loopback)."""

    def __post_init__(self):
        self.one_per_rank = torch.ones(self.num_ranks, dtype=torch.int64, device=self.control.device)
        """What ``returned`` holds once every owner has written back."""
        self.epoch = self.control[:1]
        """(1,) int32: the call counter (the control block's first word; the kernels find the rest after it)."""
        self._record_copy = None  # (pinned host copy of the error record, the event after its copy)
        self.number = next(_NUMBERS)
        """This workspace's number in the process, by which the custom ops name it (:func:`by_number`)."""
        _LIVE[self.number] = self

    def error(self) -> str | None:
        """The error record as a message, or None (reads it back: a host sync)."""
        return describe_error(self.rank, self.control.cpu().tolist())

    def check_error(self, now: bool = False) -> None:
        """Raise ``RuntimeError`` naming the stage, the peer and what was missing if a wait of an earlier call
        gave up (its results were wrong; every later call's waits return at once until :meth:`reset`). ``now``:
        read the record back (a host sync; the debug mode, ``MEGAMOE_DEBUG=1``). Otherwise without a sync: the
        record as :meth:`snapshot_error` copied it to the host behind the previous call's work, read here once that
        copy has landed — so the next call raises if the host has waited for the failed one in between (a loss
        read back, an optimizer step's sync), else the call after."""
        if now or self.control.device.type != "cuda":  # on CPU the host ran the kernels: the record is final
            message = self.error()
            if message:
                raise RuntimeError(message)
            return
        if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
            return  # a CUDA graph or a compiled graph cannot hold the host-side check (debug mode: after the call)
        if self._record_copy is not None and self._record_copy[1].query():
            message = describe_error(self.rank, self._record_copy[0].tolist())
            if message:
                raise RuntimeError(message)

    def snapshot_error(self) -> None:
        """At the end of a call, behind its work: copy the error record to pinned host memory (no sync) for the next
        :meth:`check_error`. Skipped while an earlier copy is still in flight (its buffer is being written), and on
        CPU, in a CUDA graph or a compiled graph."""
        if self.control.device.type != "cuda" or torch.cuda.is_current_stream_capturing() or \
                torch.compiler.is_compiling():
            return
        if self._record_copy is None:
            self._record_copy = (torch.empty(CONTROL_WORDS, dtype=torch.int32, pin_memory=True), torch.cuda.Event())
        if self._record_copy[1].query():
            self._record_copy[0].copy_(self.control, non_blocking=True)
            self._record_copy[1].record()

    def reset(self) -> None:
        """After an error: every flag, counter and the error record back to zero, the epoch to 0, on this rank. Call
        it on every rank of the group, then synchronise the device and barrier (:func:`megamoe.parallel.fused.
        reset_workspaces` does all three) before the next call."""
        for name in ("counts", "counts_flag", "arrived", "ready", "returned", "overflow"):
            self.buffers[name].zero_()
        self.control[: CONTROL["timeout_us"]].zero_()
        self._record_copy = None

    def __getattr__(self, name: str) -> torch.Tensor:
        buffers = self.__dict__.get("buffers", {})
        if name in buffers:
            return buffers[name]
        raise AttributeError(name)

    def check_overflow(self, now: bool = False) -> None:
        """Raise if any earlier call received more rows than ``capacity`` (those rows were dropped by the
        protocol, so its results were wrong). Asynchronous on a GPU (``torch._assert_async``: the stream
        fails with this message, and the CUDA context with it); immediate on CPU. ``now``: read the counter
        back (a host sync) and raise ``RuntimeError`` at once — the debug mode (``MEGAMOE_DEBUG=1``)."""
        message = (f"megamoe: expert-parallel receive capacity {self.capacity} rows exceeded on rank {self.rank}; "
                   "raise max_tokens_per_rank")
        if now:
            if int(self.overflow[0]):
                raise RuntimeError(message)
            return
        torch._assert_async(self.overflow[0] == 0, message)


# What each stage's wait waits for (the error record's "stage" word).
STAGES = {1: "the counts of a source (owner, before its expert kernels)",
          2: "every source's counts at an owner (sender, before sending)",
          3: "a source's rows of one of my experts (owner's expert tile)",
          4: "a source's rows, to reset the arrival counters (owner)",
          5: "an owner writing back my rows (source, before the combine)"}


def describe_error(rank: int, control: list[int]) -> str | None:
    """The error record of ``control`` (the control block's words) as a message, or None if there is none."""
    stage = control[CONTROL["err_stage"]]
    if stage == 0:
        return None
    peer, index = control[CONTROL["err_peer"]], control[CONTROL["err_index"]]
    return (f"megamoe: expert-parallel wait gave up on rank {rank} after {control[CONTROL['timeout_us']] / 1e6:g} s "
            f"(MEGAMOE_EP_TIMEOUT_S) in call {control[CONTROL['err_epoch']]}, waiting for {STAGES.get(stage, stage)}: "
            f"peer rank {peer}, index {index} (expert or rank), expected {control[CONTROL['err_expected']]}, "
            f"seen {control[CONTROL['err_seen']]}. A peer is dead, hung, launched too late, or sent less than it "
            "announced; this call's and later calls' results are wrong until every rank resets its workspace "
            "(megamoe.parallel.fused.reset_workspaces).")


def _check_ranks(num_ranks: int) -> None:
    if not 1 <= num_ranks <= MAX_EP_RANKS:
        raise ValueError(f"expert parallelism over {num_ranks} ranks: 1 to {MAX_EP_RANKS} are supported")


def loopback_workspaces(num_ranks: int, num_local: int, capacity: int, max_tokens: int, max_slots: int, dim: int,
                        dtype: torch.dtype, device) -> list[Workspace]:
    """R virtual ranks' workspaces on one device, wired to each other."""
    _check_ranks(num_ranks)
    shape_args = (num_ranks, num_local, capacity, max_tokens, max_slots, dim)
    per_rank = [
        {name: torch.zeros(shape(*shape_args), dtype=kind or dtype, device=device)
         for name, (shape, kind) in BUFFERS.items()}
        for _ in range(num_ranks)
    ]
    peers = torch.tensor([[bufs[name].data_ptr() for bufs in per_rank] for name in BUFFERS], dtype=torch.int64,
                         device=device)
    return [Workspace(r, num_ranks, num_local, capacity, max_tokens, max_slots, per_rank[r], peers,
                      new_control(device))
            for r in range(num_ranks)]


_ALIGN = 128  # bytes between buffers inside the symmetric allocation


def check_same_on_every_rank(group, **signature) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless every rank passed the same ``signature`` (a
    collective: one all-gather of a few numbers, once per workspace). Ranks that called the fused layer with
    different experts per rank, top-k, hidden size, dtype or token capacity would otherwise exchange rows of
    mismatched sizes."""
    mine = tuple(sorted((name, str(value)) for name, value in signature.items()))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if any(other != mine for other in every):
        differing = sorted({name for other in every for (name, value) in other if (name, value) not in mine})
        raise ValueError(f"expert parallelism: the ranks of the group called with different {', '.join(differing)}: "
                         + "; ".join(f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in other if k in differing)
                                     for r, other in enumerate(every)))


def symmetric_workspace(group, num_local: int, capacity: int, max_tokens: int, max_slots: int, dim: int,
                        dtype: torch.dtype) -> Workspace:
    """This rank's workspace in symmetric memory over ``group`` (a collective: every rank calls it with
    the same sizes). Allocate it once per (group, sizes) and reuse it across layers and steps. Sets
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` unless already set: nothing here uses NVLink multicast."""
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_ranks(num_ranks)
    check_same_on_every_rank(group, local_experts=num_local, capacity=capacity, max_tokens=max_tokens,
                             max_slots=max_slots, hidden_size=dim, dtype=dtype)
    shape_args = (num_ranks, num_local, capacity, max_tokens, max_slots, dim)
    layout, size = {}, 0  # name → (byte offset, shape, dtype)
    for name, (shape, kind) in BUFFERS.items():
        kind = kind or dtype
        layout[name] = (size, shape(*shape_args), kind)
        size += -(-torch.Size(shape(*shape_args)).numel() * kind.itemsize // _ALIGN) * _ALIGN
    device = torch.device("cuda", torch.cuda.current_device())
    raw = symm_mem.empty(size, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(raw, group)
    raw.zero_()
    buffers = {name: raw[offset:offset + torch.Size(shp).numel() * kind.itemsize].view(kind).view(shp)
               for name, (offset, shp, kind) in layout.items()}
    bases = handle.buffer_ptrs
    peers = torch.tensor([[base + offset for base in bases] for offset, _, _ in layout.values()], dtype=torch.int64,
                         device=device)
    torch.cuda.synchronize(device)
    dist.barrier(group)  # every rank's buffers are zeroed before any peer writes into them
    return Workspace(rank, num_ranks, num_local, capacity, max_tokens, max_slots, buffers, peers,
                     new_control(device), handle)
