"""Tile configs of the GEMM kernels: a fixed default per kernel, and a short list of candidates that
Triton's autotuner times once per static shape (D, I and the dtypes — never the token count) on first use.

Autotuning is on by default for 16-bit operands on a GPU (measured 1.10x instead of 1.04x over the
compiled baseline on the 235B layer; docs/PERFORMANCE.md). ``MEGAMOE_AUTOTUNE=0`` pins each kernel to its
fixed default, as do the interpreter and fp32 operands. Autotuning synchronises the host once per new
shape, on its first call (run one step before capturing a CUDA graph); later calls are sync-free.

Invariant every autotuned kernel keeps so that autotuning is safe: any config writes every output
element the caller reads (the autotuner runs several configs on the same buffers before the chosen one).
A kernel whose effects are not idempotent (the expert-parallel epilogues add to other ranks' arrival
counters) must run once per launch, so it is never autotuned: it ``follows`` its one-device twin and
launches with the config the twin chose for the same key (see ``TunedKernel.has_tuned``).

TMA operands: a kernel parameter named ``*_desc`` is a ``triton.tools.tensor_descriptor.TensorDescriptor``
whose block shape depends on the config; the kernel's ``blocks(config)`` gives it, and the launcher (or,
when autotuning, each config's pre-hook) sets it before the launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from megamoe import env

TILE_KEYS = ("BM", "BN", "BK")
LAUNCH_KEYS = ("num_warps", "num_stages")


def autotune_enabled(dtype: torch.dtype) -> bool:
    """Whether launches with ``dtype`` operands tune their configs: 16-bit operands on a GPU, unless
    ``MEGAMOE_AUTOTUNE=0``."""
    return env.autotune_requested() and not env.interpreting() and dtype.itemsize == 2


def fit_dtype(config: dict, dtype: torch.dtype) -> dict:
    """Configs are tuned for 16-bit operands; fp32 tiles are twice the bytes, so halve BK to stay inside
    shared memory (the 30B down config needs 288 KB in fp32 against 227 KB). A kernel without a K loop has no BK."""
    if dtype.itemsize > 2 and "BK" in config:
        return {**config, "BK": config["BK"] // 2}
    return config


def _triton_config(config: dict, pre_hook) -> triton.Config:
    return triton.Config({k: v for k, v in config.items() if k not in LAUNCH_KEYS}, num_warps=config["num_warps"],
                         num_stages=config["num_stages"], pre_hook=pre_hook)


class TunedKernel:
    """A Triton kernel (with EVEN_K derived from BK by ``even_k``, if given), launched with ``default`` or autotuned over
    ``[default, *candidates]`` keyed on ``key`` (static dims) on the key's first launch, and launched with the
    chosen config directly after that. ``kernel[grid](*args, dtype=..., **kw)``
    with ``grid`` a function of the config dict, as for ``triton.autotune``. ``blocks(config)`` maps each
    ``*_desc`` parameter to its TMA block shape under that config. ``constants``: constexpr arguments
    this instance always passes (one Triton kernel can serve several GEMMs). ``follows``: for a kernel
    that must not be autotuned (non-idempotent effects), the kernel whose tiles it shares and whose
    choice it takes, per key; it launches with ``default`` until ``follows`` has tuned that key. ``restore``: the
    arguments a launch may write over (a kernel writing its output in place of an input), which autotuning copies
    before each config's trial and puts back after it, so that every trial and the final launch read the caller's
    values. A config is the tile shape, ``num_warps``, ``num_stages`` and any other constexpr knob of the kernel (e.g.
    ``PERSISTENT``); each config keeps only the knobs its own kernel has (a ``configs`` row's BK where the
    kernel has no K loop, a followed twin's extra knobs)."""

    def __init__(self, kernel, default: dict, candidates: list[dict], key: list[str],
                 even_k: Callable[[dict], bool] | None, blocks: Callable[[dict], dict[str, list[int]]],
                 constants: dict | None = None, follows: TunedKernel | None = None, restore: tuple[str, ...] = ()):
        self._kernel = triton.heuristics({"EVEN_K": even_k})(kernel) if even_k else kernel
        self._arg_names = self.jit_fn.arg_names
        self.default = self._own(default)
        self.candidates = [self._own(c) for c in candidates]
        self.key = key
        self.even_k = even_k
        self.blocks = blocks
        self.constants = constants or {}
        self.follows = follows
        self._chosen: dict[tuple, dict] = {}  # (key values..., dtype) -> the config autotuning picked
        self.last_config: dict | None = None  # the config of the latest launch (for the benchmarks' records)
        tuned_configs = [_triton_config(c, self._set_blocks) for c in [self.default, *self.candidates]]
        self._tuned = triton.autotune(tuned_configs, key=key, restore_value=list(restore))(self._kernel)

    def _own(self, config: dict) -> dict:
        """``config`` without the knobs this kernel lacks (a follower's twin may have more)."""
        return {k: v for k, v in config.items() if k in LAUNCH_KEYS or k in self._arg_names}

    def has_tuned(self, dtype: torch.dtype, **key_values) -> bool:
        """Whether a launch with these key arguments (all of ``key``, by name) and operand dtype has
        autotuned, or needs no tuning (autotuning off)."""
        return not autotune_enabled(dtype) or (*(key_values[k] for k in self.key), dtype) in self._chosen

    def _set_blocks(self, nargs: dict) -> None:
        for name, block in self.blocks(nargs).items():
            nargs[name].block_shape = block

    @property
    def jit_fn(self):
        """The underlying ``triton.jit`` function."""
        return self._kernel.fn if isinstance(self._kernel, triton.runtime.Heuristics) else self._kernel

    def __getitem__(self, grid: Callable[[dict], tuple]):
        def launch(*args, dtype: torch.dtype, **kwargs):
            kwargs = {**kwargs, **self.constants}
            named = {**dict(zip(self._arg_names, args)), **kwargs}
            key = (*(named[k] for k in self.key), dtype)
            if not autotune_enabled(dtype):
                config = fit_dtype(self.default, dtype)
            elif self.follows is not None:
                config = self._own(self.follows._chosen.get(key, self.default))
            elif key in self._chosen:
                # Tuned: straight to the kernel; the autotuner's per-call work is host time that small
                # batches pay (docs/DESIGN.md, "Tile configs").
                config = self._chosen[key]
            else:
                self._tuned[grid](*args, **kwargs)
                best = self._tuned.best_config
                self._chosen[key] = self.last_config = {**best.kwargs, "num_warps": best.num_warps,
                                                        "num_stages": best.num_stages}
                return
            self.last_config = config
            self._set_blocks({**named, **config})
            self._kernel[grid(config)](*args, **kwargs, **config)

        return launch


def configs(*rows: tuple, **knobs) -> list[dict]:
    """Config dicts from (BM, BN, BK, num_warps, num_stages) rows, each with the constexpr ``knobs``."""
    return [{**dict(zip((*TILE_KEYS, *LAUNCH_KEYS), row)), **knobs} for row in rows]
