"""Device queries and environment switches that every layer of the package reads: the bottom of the import
graph (it imports nothing from megamoe), so that kernels and the public API can share them without a cycle.

Environment variables (documented in docs/USAGE.md):

* ``MEGAMOE_BACKEND`` — ``auto`` or ``reference`` (read by :func:`megamoe.api.backend_for`);
* ``MEGAMOE_EP`` — ``auto``, ``fused`` or ``all_to_all`` (:func:`megamoe.api.ep_path`);
* ``MEGAMOE_DEBUG=1`` — checks that read device data back to the host (:func:`debug_checks_enabled`);
* ``MEGAMOE_AUTOTUNE=0`` — fixed tile configs (:func:`autotune_requested`);
* ``MEGAMOE_FP8_WGRAD`` — ``1`` (default) or ``0``: FP8 or bf16 weight gradients in ``precision="fp8"``
  (:func:`fp8_wgrad_requested`);
* ``MEGAMOE_FP8_WGRAD_X_SCALES`` — ``tile`` (default), ``layer`` or ``expert``: x's scales in the FP8 dW13
  (:func:`fp8_wgrad_x_scales_requested`);
* ``MEGAMOE_LOW_PEAK_BACKWARD`` — ``0`` or ``1``: the one-GPU backward's order (:func:`low_peak_backward_requested`);
* ``MEGAMOE_WGRAD_BY_SIZE`` — ``1`` (default) or ``0``: the weight-gradient kernels' blocks in order of their experts'
  rows or in expert order (:func:`wgrad_by_size_requested`);
* ``MEGAMOE_WGRAD_TAKEN`` — ``dw13`` (default), ``dw2``, ``dw13,dw2`` or ``none``: the bf16 weight gradients whose
  blocks are taken in turn (:func:`wgrad_taken_requested`);
* ``MEGAMOE_FP8_SCALES`` — ``fp32`` or ``pow2``: the FP8 recipe's scales (:func:`fp8_pow2_scales`);
* ``MEGAMOE_EP_TIMEOUT_S`` — seconds one wait of the fused EP protocol spins before it gives up
  (:func:`megamoe.parallel.workspace.ep_timeout_s`);
* ``MEGAMOE_EP_UNBOUNDED_WAITS=1`` — the fused EP protocol's waits without their bound, only to measure what the
  bound costs (:func:`ep_unbounded_waits`);
* ``TRITON_INTERPRET=1`` — Triton's interpreter runs the kernels on CPU tensors (:func:`interpreting`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings

import torch

_warned: set[str] = set()
_custom_ops = threading.local()  # depth of the active megamoe.checkpoint_context regions, per thread


def warn_once(msg: str) -> None:
    """``warnings.warn`` once per distinct message per process."""
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _switch(name: str, default: bool) -> bool:
    """An on/off environment switch: ``1`` on, ``0`` off, unset (or empty) ``default``; any other value is refused,
    so that a typo cannot silently leave the default on."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0, 1 or unset, not {value!r}")
    return default if value == "" else value == "1"


def autotune_requested() -> bool:
    """``MEGAMOE_AUTOTUNE``: ``1`` or unset, the GEMMs tune their tile configs once per new shape (which synchronises
    with the host then); ``0``: each kernel runs its fixed default config."""
    return _switch("MEGAMOE_AUTOTUNE", True)


def low_peak_backward_requested() -> bool:
    """``MEGAMOE_LOW_PEAK_BACKWARD``: the default of ``megamoe.autograd.LOW_PEAK_BACKWARD`` (the backward's weight
    gradient of w13 before dx's slot rows exist, the dx combine on its own: less memory, a little slower). ``1`` or
    unset: that order in both memory modes; ``0``: dx's slot rows first, combined inside dW13's launch (faster by
    1-2%, one N x D block more at the backward's peak)."""
    return _switch("MEGAMOE_LOW_PEAK_BACKWARD", True)


def wgrad_by_size_requested() -> bool:
    """``MEGAMOE_WGRAD_BY_SIZE``: the default of ``megamoe.kernels.gluon_sm90.WGRAD_BY_SIZE``, read once, at import.
    ``1`` or unset: the Gluon weight-gradient kernels (bf16 and FP8) deal their blocks in order of their experts'
    rows, most first (faster under a skewed routing, docs/PERFORMANCE.md); ``0``: in expert order. The same outputs,
    bit for bit, either way."""
    return _switch("MEGAMOE_WGRAD_BY_SIZE", True)


WGRAD_GEMMS = ("dw13", "dw2")  # the layer's weight gradients, by the names MEGAMOE_WGRAD_TAKEN takes


def wgrad_taken_requested() -> frozenset[str]:
    """``MEGAMOE_WGRAD_TAKEN``: the default of ``megamoe.kernels.gluon_sm90.WGRAD_TAKEN``, read once, at import: the
    bf16 Gluon weight gradients (names of :data:`WGRAD_GEMMS`, comma-separated) whose programs take the blocks of the
    size order in turn from a counter, the others' blocks dealt to their programs before the launch
    (``MEGAMOE_WGRAD_BY_SIZE`` says in which order). Unset (or empty): ``dw13`` (under a skewed routing faster, under
    an even one level; dW2 taken in turn 2-5% slower under an even one: docs/PERFORMANCE.md); ``none``: no weight
    gradient. A name twice or not of :data:`WGRAD_GEMMS` is refused. The same outputs, bit for bit, either way."""
    value = os.environ.get("MEGAMOE_WGRAD_TAKEN", "")
    if value == "":
        return frozenset({"dw13"})
    if value == "none":
        return frozenset()
    names = value.split(",")
    if any(name not in WGRAD_GEMMS for name in names) or len(set(names)) != len(names):
        raise ValueError(f"MEGAMOE_WGRAD_TAKEN must be 'none' or names of {WGRAD_GEMMS} separated by commas, each "
                         f"once, not {value!r}")
    return frozenset(names)


def ep_unbounded_waits() -> bool:
    """``MEGAMOE_EP_UNBOUNDED_WAITS=1``: the fused expert-parallel protocol's waits compiled without their time bound
    (``MEGAMOE_EP_TIMEOUT_S``): no wait gives up and none writes the error record, so a missing peer hangs its ranks.
    Only for measuring what the bound costs (``bash scripts/gpu-check.sh ep-waits``); read once, at import."""
    return _switch("MEGAMOE_EP_UNBOUNDED_WAITS", False)


def fp8_wgrad_requested() -> bool:
    """``MEGAMOE_FP8_WGRAD``: the default of ``megamoe.autograd.FP8_WGRAD``. ``1`` or unset: FP8 weight gradients
    (DeepSeek-V3's recipe; on the H200 as fast as the bf16 ones at the 30B layer and faster at the 235B one,
    docs/PERFORMANCE.md); ``0``: the bf16 weight gradients (exact products of the unquantised rows)."""
    return _switch("MEGAMOE_FP8_WGRAD", True)


FP8_WGRAD_X_SCALES = ("tile", "layer", "expert")
# How results name the options of the recipe (the recipe's own "tile" is named by none).
FP8_WGRAD_X_SCALES_NAMES = {"layer": "over the layer", "expert": "per expert"}


def fp8_wgrad_x_scales_requested() -> str:
    """``MEGAMOE_FP8_WGRAD_X_SCALES``: the default of ``megamoe.autograd.FP8_WGRAD_X_SCALES``, read once, at import.
    ``tile`` or unset: x quantised for the FP8 dW13 as the recipe's 128x1 groups (one scale per channel and 128 of an
    expert's tokens); ``layer``: one scale per channel over the layer's tokens, so that the GEMM promotes each K-step
    by dz's scales alone (faster; less accurate on heavy-tailed x: ``tools.fp8_wgrad_scales``, docs/PERFORMANCE.md);
    ``expert``: one per channel over each expert's tokens (the same GEMM; between the two in accuracy, and a pass over
    x's gathered rows for the amax)."""
    value = os.environ.get("MEGAMOE_FP8_WGRAD_X_SCALES", "") or "tile"
    if value not in FP8_WGRAD_X_SCALES:
        raise ValueError(f"MEGAMOE_FP8_WGRAD_X_SCALES must be one of {FP8_WGRAD_X_SCALES}, got {value!r}")
    return value


FP8_SCALES = ("fp32", "pow2")
_fp8_scales = "fp32"


def set_fp8_scales(kind: str) -> None:
    """The blockwise FP8 recipe's scales from now on, for every quantiser (activations, weights, h, dz):
    ``"fp32"`` (the default: amax / 448) or ``"pow2"`` (amax / 448 rounded up to a power of two, so that scaling
    and unscaling are exact; DeepSeek-V3's option). Also set at import by ``MEGAMOE_FP8_SCALES``. The cached FP8
    weight copies follow (``kernels.quant.fp8_weight`` keys them on it)."""
    global _fp8_scales
    if kind not in FP8_SCALES:
        raise ValueError(f"FP8 scales must be one of {FP8_SCALES}, got {kind!r} (MEGAMOE_FP8_SCALES or set_fp8_scales)")
    _fp8_scales = kind


def fp8_pow2_scales() -> bool:
    """Whether the FP8 recipe's scales are powers of two (:func:`set_fp8_scales`); read by every FP8 quantiser at
    each call."""
    return _fp8_scales == "pow2"


set_fp8_scales(os.environ.get("MEGAMOE_FP8_SCALES", "fp32"))

FP8_WEIGHT_CACHES = ("step", "ahead", "call")


def fp8_weight_cache_requested() -> str:
    """``MEGAMOE_FP8_WEIGHT_CACHE``: the policy of the expert weights' FP8 copies at import
    (``kernels.quant.set_fp8_weight_cache``): ``step`` or unset, kept until the weights change; ``ahead``, likewise,
    and made again right after each optimizer step on a stream of their own; ``call``, made at every call and kept
    by none."""
    value = os.environ.get("MEGAMOE_FP8_WEIGHT_CACHE", "") or "step"
    if value not in FP8_WEIGHT_CACHES:
        raise ValueError(f"MEGAMOE_FP8_WEIGHT_CACHE must be one of {FP8_WEIGHT_CACHES}, got {value!r}")
    return value


def debug_checks_enabled() -> bool:
    """``MEGAMOE_DEBUG=1`` turns on checks that read device data back to the host (slow, synchronising)."""
    return _switch("MEGAMOE_DEBUG", False)


@functools.cache
def sm_count(device_index: int) -> int:
    """SMs of CUDA device ``device_index`` (cached: the launchers ask on every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``device_index`` (cached: the backward's launchers ask several times a
    step, and the query costs host time). Not for code that ``torch.compile`` traces: Dynamo warns on every
    ``functools.cache``-wrapped call it traces (:func:`megamoe.api.backend_for` asks torch directly)."""
    return torch.cuda.get_device_capability(device_index)


def custom_ops_forced() -> bool:
    """Whether megamoe must run as ``torch.library`` custom ops even eagerly: inside a
    :func:`megamoe.checkpoint_context` region on this thread, whose selective-checkpoint policy sees ops, not
    ``autograd.Function`` calls."""
    return getattr(_custom_ops, "depth", 0) > 0


@contextlib.contextmanager
def forcing_custom_ops(context):
    """``context`` entered with :func:`custom_ops_forced` true inside it."""
    _custom_ops.depth = getattr(_custom_ops, "depth", 0) + 1
    try:
        with context:
            yield
    finally:
        _custom_ops.depth -= 1
