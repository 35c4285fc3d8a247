"""Routing plan: from ``topk_idx`` build, on the device and with no host sync, the expert-sorted row map
and the tile table every expert kernel walks.

Shape legend: T tokens, K slots per token, E experts, N = T*K slots, NT = ceil(N/BLOCK_M) + E tiles
(a static upper bound: each expert wastes less than one tile), so grids never depend on the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows per tile, shared by every expert kernel (forward and backward walk the same tile table).
BLOCK_M = 128


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


def build_plan(topk_idx_TK: torch.Tensor, num_experts: int) -> Plan:
    """Stable counting sort of the T*K slots by expert (dropped slots last) and the tile table.

    Deterministic: a stable sort and integer counts. A handful of small device ops; no host sync.
    """
    device = topk_idx_TK.device
    idx_N = topk_idx_TK.reshape(-1).to(torch.int64)
    key_N = torch.where(idx_N >= 0, idx_N, num_experts)
    _, order_N = torch.sort(key_N, stable=True)
    counts_E1 = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts_E1.scatter_add_(0, key_N, torch.ones_like(key_N))
    counts_E = counts_E1[:num_experts]
    offsets_E1 = torch.cat([counts_E.new_zeros(1), torch.cumsum(counts_E, 0)])
    tiles_E = (counts_E + BLOCK_M - 1) // BLOCK_M
    tile_end_E = torch.cumsum(tiles_E, 0)
    tile_i = torch.arange(num_tiles(idx_N.numel(), num_experts), device=device)
    tile_expert = torch.searchsorted(tile_end_E, tile_i, right=True)
    e = tile_expert.clamp_max(num_experts - 1)
    tile_row = offsets_E1[e] + (tile_i - (tile_end_E[e] - tiles_E[e])) * BLOCK_M
    i32 = torch.int32
    return Plan(offsets_E1.to(i32), order_N.to(i32), tile_expert.to(i32), tile_row.to(i32))
