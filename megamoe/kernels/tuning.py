"""Tile configs of the GEMM kernels: a fixed default per kernel, and a short list of candidates that
Triton's autotuner times once per static shape (D, I and the dtypes — never the token count) on first use.

Autotuning is opt-in, ``MEGAMOE_AUTOTUNE=1``: measured 1.10x instead of 1.04x over the compiled baseline
on the 235B layer, but that run also found that the tuning call itself returned a stale d(routing
weight) (fixed since, with the fix checked on CPU only; see docs/NOTES.md). It becomes the default once
``test_autotuned_configs_match_fp32_reference`` has passed on a GPU. Otherwise — and always under the
interpreter and for fp32 operands — each kernel runs its fixed default. Autotuning synchronises the host
once per new shape, on its first call; later calls are sync-free.

Invariant every kernel keeps so that autotuning is safe: any config writes every output element the
caller reads (the autotuner runs several configs on the same buffers before the chosen one).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton

TILE_KEYS = ("BM", "BN", "BK")


def autotune_enabled(dtype: torch.dtype) -> bool:
    return (os.environ.get("MEGAMOE_AUTOTUNE", "0") == "1" and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.empty((), dtype=dtype).element_size() == 2)


def fit_dtype(config: dict, dtype: torch.dtype) -> dict:
    """Configs are tuned for 16-bit operands; fp32 tiles are twice the bytes, so halve BK to stay inside
    shared memory (the 30B down config needs 288 KB in fp32 against 227 KB)."""
    if torch.empty((), dtype=dtype).element_size() > 2:
        return {**config, "BK": config["BK"] // 2}
    return config


def _triton_config(config: dict) -> triton.Config:
    return triton.Config({k: config[k] for k in TILE_KEYS}, num_warps=config["num_warps"],
                         num_stages=config["num_stages"])


class TunedKernel:
    """A Triton kernel with EVEN_K derived from BK, launched with ``default`` or autotuned over
    ``[default, *candidates]`` keyed on ``key`` (static dims). ``kernel[grid](*args, dtype=..., **kw)``
    with ``grid`` a function of the config dict, as for ``triton.autotune``."""

    def __init__(self, kernel, default: dict, candidates: list[dict], key: list[str],
                 even_k: Callable[[dict], bool]):
        self.default = default
        self.candidates = candidates
        self._kernel = triton.heuristics({"EVEN_K": even_k})(kernel)
        self._tuned = triton.autotune([_triton_config(c) for c in [default, *candidates]], key=key)(self._kernel)

    @property
    def jit_fn(self):
        """The underlying ``triton.jit`` function."""
        return self._kernel.fn

    def __getitem__(self, grid: Callable[[dict], tuple]):
        def launch(*args, dtype: torch.dtype, **kwargs):
            if autotune_enabled(dtype):
                self._tuned[grid](*args, **kwargs)
            else:
                config = fit_dtype(self.default, dtype)
                self._kernel[grid(config)](*args, **kwargs, **config)

        return launch


def configs(*rows: tuple) -> list[dict]:
    """Config dicts from (BM, BN, BK, num_warps, num_stages) rows."""
    return [dict(zip((*TILE_KEYS, "num_warps", "num_stages"), row)) for row in rows]
