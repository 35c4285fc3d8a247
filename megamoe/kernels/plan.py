"""Routing plan: from ``topk_idx`` build, on the device and with no host sync, the expert-sorted row map
and the tile table every expert kernel walks.

Shape legend: T tokens, K slots per token, E experts, N = T*K slots, NT = ceil(N/BLOCK_M) + E tiles
(a static upper bound: each expert wastes less than one tile), so grids never depend on the routing.
C = ceil(N / CHUNK) chunks of slots; NB = a power of two >= E + 2 histogram bins (E experts, one bin
for dropped slots, one for the padding of the last chunk).

Four small launches, a stable counting sort, every one parallel (a single-program scan measured
0.23 ms for the 30B layer): per-chunk histograms → one program per key scans its column down the
chunks → tile table and expert offsets → each chunk scatters its slots (stable rank inside the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows per tile, shared by every expert kernel (forward and backward walk the same tile table); a kernel
# may split a tile into sub-tiles of BM rows (see common.tile_rows).
BLOCK_M = 128
CHUNK = 128  # slots per chunk of the counting sort
SCAN_BLOCK = 1024  # chunks per step of the column scan


@dataclass(frozen=True)
class Plan:
    """Where each routed row lives. All int32, all on the device of ``topk_idx``."""

    offsets_E1: torch.Tensor
    """(E+1,) first sorted row of each expert; ``offsets_E1[E]`` = number of routed (non-dropped) rows."""
    row_slot_N: torch.Tensor
    """(N,) sorted row → flat slot ``t*K + k`` (token ``t``, slot ``k``); rows past ``offsets_E1[E]`` are dropped slots."""
    tile_expert_NT: torch.Tensor
    """(NT,) expert of each tile; ``E`` marks an idle tile (the bound NT is not reached)."""
    tile_row_NT: torch.Tensor
    """(NT,) first sorted row of each tile; a tile covers rows [tile_row, min(tile_row + BLOCK_M, offsets_E1[e+1]))."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.offsets_E1, self.row_slot_N, self.tile_expert_NT, self.tile_row_NT


def num_tiles(num_slots: int, num_experts: int) -> int:
    return -(-num_slots // BLOCK_M) + num_experts


@triton.jit
def _slot_keys(idx_ptr, N, E, BLOCK: tl.constexpr):
    """Sort key of this chunk's slots: expert id, E for a dropped slot, E+1 past the end."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    ids = tl.load(idx_ptr + offs, mask=valid, other=0).to(tl.int32)
    key = tl.where(ids >= 0, ids, E)
    return offs, valid, tl.where(valid, key, E + 1)


@triton.jit
def _plan_count_kernel(
    idx_ptr,  # (N,) expert ids, -1 = dropped
    hist_ptr,  # (C, NB) int32 out
    N, E,
    BLOCK: tl.constexpr, NB: tl.constexpr,
):
    _, _, key = _slot_keys(idx_ptr, N, E, BLOCK)
    tl.store(hist_ptr + tl.program_id(0) * NB + tl.arange(0, NB), tl.histogram(key, NB))


@triton.jit
def _plan_scan_kernel(
    hist_ptr,  # (C, NB) int32 per-chunk histograms
    chunk_base_ptr,  # (C, NB) int32 out: rows of key b in the chunks before c
    total_ptr,  # (NB,) int32 out: rows of key b in all chunks
    C,
    NB: tl.constexpr, CB: tl.constexpr,
):
    """One program per key: an exclusive scan down its histogram column."""
    b = tl.program_id(0)
    running = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, C, CB):
        rows = c0 + tl.arange(0, CB)
        h = tl.load(hist_ptr + rows * NB + b, mask=rows < C, other=0)
        tl.store(chunk_base_ptr + rows * NB + b, running + tl.cumsum(h, axis=0) - h, mask=rows < C)
        running += tl.sum(h, axis=0)
    tl.store(total_ptr + b, running)


@triton.jit
def _key_starts(total_ptr, NB: tl.constexpr):
    """First sorted row of each key (experts in order, then dropped slots), from the key totals."""
    total = tl.load(total_ptr + tl.arange(0, NB))
    return total, tl.cumsum(total, axis=0) - total


@triton.jit
def _plan_tiles_kernel(
    total_ptr,  # (NB,) int32 rows per key
    offsets_ptr,  # (E+1,) int32 out
    tile_expert_ptr,  # (NT,) int32 out
    tile_row_ptr,  # (NT,) int32 out
    E, NT,
    NB: tl.constexpr, TB: tl.constexpr, BM: tl.constexpr,
):
    bins = tl.arange(0, NB)
    total, start = _key_starts(total_ptr, NB)
    if tl.program_id(0) == 0:
        tl.store(offsets_ptr + bins, start, mask=bins <= E)
    is_expert = bins < E
    tiles = tl.where(is_expert, (total + BM - 1) // BM, 0)
    tile_end = tl.cumsum(tiles, axis=0)
    tile_start = tile_end - tiles
    ti = tl.program_id(0) * TB + tl.arange(0, TB)
    # Expert of tile ti: how many experts' tiles end at or before it (E: past the last, idle).
    e = tl.sum(((tile_end[None, :] <= ti[:, None]) & is_expert[None, :]).to(tl.int32), axis=1)
    pick = bins[None, :] == e[:, None]
    row = tl.sum(tl.where(pick, start[None, :] + (ti[:, None] - tile_start[None, :]) * BM, 0), axis=1)
    tl.store(tile_expert_ptr + ti, e, mask=ti < NT)
    tl.store(tile_row_ptr + ti, row, mask=ti < NT)


@triton.jit
def _plan_scatter_kernel(
    idx_ptr,  # (N,) expert ids
    chunk_base_ptr,  # (C, NB) rows of each key in earlier chunks
    total_ptr,  # (NB,) rows per key
    row_slot_ptr,  # (N,) int32 out: sorted row -> slot
    N, E,
    BLOCK: tl.constexpr, NB: tl.constexpr,
):
    offs, valid, key = _slot_keys(idx_ptr, N, E, BLOCK)
    _, start = _key_starts(total_ptr, NB)
    bins = tl.arange(0, NB)
    key_start = tl.sum(tl.where(bins[None, :] == key[:, None], start[None, :], 0), axis=1)
    lane = tl.arange(0, BLOCK)
    # Stable rank inside the chunk: earlier slots with the same key.
    earlier = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    base = key_start + tl.load(chunk_base_ptr + tl.program_id(0) * NB + key)
    tl.store(row_slot_ptr + base + rank, offs, mask=valid)


def _tile_table(total, offsets, tile_expert, tile_row, num_experts: int, nb: int) -> None:
    """The expert offsets and the tile table from the per-key row totals (``_plan_tiles_kernel``)."""
    nt = tile_expert.numel()
    tb = max(16, 8192 // nb)
    _plan_tiles_kernel[(triton.cdiv(nt, tb),)](total_ptr=total, offsets_ptr=offsets, tile_expert_ptr=tile_expert,
                                               tile_row_ptr=tile_row, E=num_experts, NT=nt, NB=nb, TB=tb, BM=BLOCK_M,
                                               num_warps=4)


def build_plan(topk_idx_TK: torch.Tensor, num_experts: int) -> Plan:
    """Stable counting sort of the T*K slots by expert (dropped slots last) and the tile table.
    Deterministic (integer counts, fixed order); four launches; no host sync."""
    device = topk_idx_TK.device
    idx_N = topk_idx_TK.reshape(-1)
    n = idx_N.numel()
    nb = triton.next_power_of_2(num_experts + 2)
    chunks = max(1, triton.cdiv(n, CHUNK))
    nt = num_tiles(n, num_experts)
    i32 = {"device": device, "dtype": torch.int32}
    hist = torch.empty(chunks, nb, **i32)
    chunk_base = torch.empty(chunks, nb, **i32)
    total = torch.empty(nb, **i32)
    offsets = torch.empty(num_experts + 1, **i32)
    row_slot = torch.empty(n, **i32)
    tile_expert = torch.empty(nt, **i32)
    tile_row = torch.empty(nt, **i32)
    _plan_count_kernel[(chunks,)](idx_ptr=idx_N, hist_ptr=hist, N=n, E=num_experts, BLOCK=CHUNK, NB=nb, num_warps=4)
    _plan_scan_kernel[(nb,)](hist_ptr=hist, chunk_base_ptr=chunk_base, total_ptr=total, C=chunks, NB=nb,
                             CB=SCAN_BLOCK, num_warps=4)
    _tile_table(total, offsets, tile_expert, tile_row, num_experts, nb)
    _plan_scatter_kernel[(chunks,)](idx_ptr=idx_N, chunk_base_ptr=chunk_base, total_ptr=total, row_slot_ptr=row_slot,
                                    N=n, E=num_experts, BLOCK=CHUNK, NB=nb, num_warps=4)
    return Plan(offsets, row_slot, tile_expert, tile_row)


@torch.library.custom_op("megamoe::plan", mutates_args=())
def plan_op(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
    """:func:`build_plan` as a ``torch.library`` custom op (its four tensors, in ``Plan``'s order): what the custom-op
    wirings of the layer (one GPU and expert-parallel) build their plan with, so that torch.compile sees one opaque
    op and a checkpoint policy can save its outputs."""
    return build_plan(topk_idx_TK, num_experts).tensors()


@plan_op.register_fake
def _(topk_idx_TK, num_experts):
    n = topk_idx_TK.numel()
    nt = num_tiles(n, num_experts)
    i32 = {"dtype": torch.int32}
    return (topk_idx_TK.new_empty(num_experts + 1, **i32), topk_idx_TK.new_empty(n, **i32),
            topk_idx_TK.new_empty(nt, **i32), topk_idx_TK.new_empty(nt, **i32))


def plan_from_counts(rows_per_expert_E: torch.Tensor, num_rows: int) -> Plan:
    """The plan of ``num_rows`` rows that are already sorted by expert, expert e owning the next
    ``rows_per_expert_E[e]`` rows (clipped at ``num_rows``; rows past the last expert are unused): the
    rows received by an expert-parallel owner. Identity row map, so each row is its own slot (use
    ``top_k=1``); one launch for the tile table, no sort, no host sync."""
    device = rows_per_expert_E.device
    num_experts = rows_per_expert_E.numel()
    nb = triton.next_power_of_2(num_experts + 2)
    ends = rows_per_expert_E.to(torch.int64).cumsum(0).clamp_max(num_rows)
    routed = torch.diff(ends, prepend=ends.new_zeros(1))
    total = torch.zeros(nb, device=device, dtype=torch.int32)
    total[:num_experts] = routed.to(torch.int32)
    total[num_experts] = num_rows - ends[-1].to(torch.int32)  # unused rows: the "dropped" key
    nt = num_tiles(num_rows, num_experts)
    offsets = torch.empty(num_experts + 1, device=device, dtype=torch.int32)
    tile_expert = torch.empty(nt, device=device, dtype=torch.int32)
    tile_row = torch.empty(nt, device=device, dtype=torch.int32)
    _tile_table(total, offsets, tile_expert, tile_row, num_experts, nb)
    row_slot = torch.arange(num_rows, device=device, dtype=torch.int32)
    return Plan(offsets, row_slot, tile_expert, tile_row)


EXPERT_KEY = tl.constexpr(2**20)  # > any expert count; a sort key's expert part


@triton.jit
def _experts_by_size_kernel(offsets_ptr, table_ptr, E, EB: tl.constexpr):
    """One program: the experts by their rows, most first (ties: the lower index first), each as (expert, first sorted
    row, end row) into ``table`` (E, 3). EB: a power of two >= E."""
    e = tl.arange(0, EB)
    valid = e < E
    start = tl.load(offsets_ptr + e, mask=valid, other=0)
    rows = tl.where(valid, tl.load(offsets_ptr + e + 1, mask=valid, other=0) - start, -1)
    # one key per expert, in ascending order: its rows' shortfall from 2**31 (so, most rows first), then its index;
    # the padding's -1 rows sort after every expert
    key = tl.sort((2**31 - rows.to(tl.int64)) * EXPERT_KEY + e)
    expert = (key % EXPERT_KEY).to(tl.int32)
    first = tl.load(offsets_ptr + expert, mask=valid, other=0)
    end = tl.load(offsets_ptr + expert + 1, mask=valid, other=0)
    tl.store(table_ptr + 3 * e, expert, mask=valid)
    tl.store(table_ptr + 3 * e + 1, first, mask=valid)
    tl.store(table_ptr + 3 * e + 2, end, mask=valid)


def experts_by_size(offsets_E1: torch.Tensor) -> torch.Tensor:
    """(E, 3) int32: the experts of the expert offsets ``offsets_E1`` (a plan's) by their rows, most first (ties: the
    lower index first), each as (expert, first sorted row, end row). One launch, no host sync. The weight-gradient
    kernels deal their blocks in this order (``gluon_sm90.WGRAD_BY_SIZE``)."""
    num_experts = offsets_E1.numel() - 1
    if num_experts >= EXPERT_KEY.value:
        raise ValueError(f"experts_by_size takes fewer than {EXPERT_KEY.value} experts, got {num_experts}")
    table = torch.empty(num_experts, 3, device=offsets_E1.device, dtype=torch.int32)
    _experts_by_size_kernel[(1,)](offsets_ptr=offsets_E1, table_ptr=table, E=num_experts,
                                  EB=triton.next_power_of_2(num_experts), num_warps=4)
    return table
