"""Activation checkpointing that leaves megamoe alone: a ``context_fn`` for ``torch.utils.checkpoint`` under which a
checkpointed block recomputes everything but megamoe's forward.

megamoe keeps no activations (``save_for_backward="none"``), so under full checkpointing its forward need not run
twice: saving its output, (T, D), is enough. :func:`checkpoint_context` is a selective-checkpoint policy that
saves the outputs of megamoe's ops (the layer's output and the routing plan) and prefers recomputing every other
op; while it is active, megamoe runs as ``torch.library`` custom ops, which the policy can see (eagerly it
otherwise runs an ``autograd.Function``, which a dispatch-level policy cannot). The backward then runs megamoe's
own backward on the recomputed input. With expert parallelism likewise: the fused EP layer runs as custom ops
(``megamoe.parallel.fused``), so its forward, communication included, runs once per step too, and every rank's
backward sends its rows again in the same order.::

    from torch.utils.checkpoint import checkpoint
    y = checkpoint(block, x, use_reentrant=False, context_fn=megamoe.checkpoint_context)
    # Hugging Face transformers (its activation_checkpointing_enable / gradient_checkpointing_enable):
    megamoe.integrations.transformers.enable_activation_checkpointing(model)
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from megamoe import autograd  # noqa: F401  (registers the torch.ops.megamoe ops the policy names)
from megamoe.env import forcing_custom_ops
from megamoe.parallel import fused  # noqa: F401  (likewise, the expert-parallel layer's)

# The ops whose outputs the policy saves (built once: the policy runs on every op of a checkpointed region).
_MEGAMOE_OPS = frozenset({torch.ops.megamoe.plan.default, torch.ops.megamoe.experts_fwd.default,
                          torch.ops.megamoe.experts_fwd_saved.default, torch.ops.megamoe.ep_fwd.default,
                          torch.ops.megamoe.ep_fwd_saved.default})


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MEGAMOE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# The forward ops whose first output is the layer's output, y: what the caller's code reads after them.
_FORWARD_OPS = _MEGAMOE_OPS - {torch.ops.megamoe.plan.default}


class _PrivateSavedOutputs(TorchDispatchMode):
    """Hands the caller a copy of the layer's output y from each of megamoe's forward ops, so that the y the policy
    keeps for the recompute stays private. Entered above the policy's mode (it sees each op first). Without it the
    kept y is the caller's own: code compiled inside an eager checkpoint (transformers' per-layer compile, where
    the checkpoint wraps the layer's call) writes later results into the storage of a tensor that its graph no
    longer reads (inductor's buffer reuse), and so would the recompute's replay of that graph: the recompute got
    another value than megamoe's output, and the forward's own output was overwritten during the backward
    (``tests/test_checkpoint.py``, the checkpoint around a compiled block). The ops' other outputs (the plan, the
    saved products) are read by megamoe's backward only, so a compiled graph keeps them as saved values and never
    reuses their storage. The cost: a copy of y, (T, D), in the forward and in the recompute."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # as the policy's own modes: dynamo compiles under it
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in _FORWARD_OPS:
            return out
        return (out[0].clone(), *out[1:]) if isinstance(out, (tuple, list)) else out.clone()


@contextlib.contextmanager
def _keeping_private(mode):
    with mode, _PrivateSavedOutputs():
        yield


def _tracing() -> bool:
    """Whether the checkpointed region is being traced for torch.compile (AOTAutograd's proxy mode is active), as
    ``torch.utils.checkpoint`` itself tells (its ``_is_compiling``)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def checkpoint_context() -> tuple:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: megamoe's outputs are
    saved, everything else in the checkpointed region is recomputed (see the module docstring). Eagerly, megamoe
    runs as custom ops inside the region; under torch.compile (a compiled region traced with its checkpoint inside,
    whatever the order of wrapping and compiling) it already does, and torch wants the policy's two dispatch modes
    as they are; otherwise the kept outputs are private copies (:class:`_PrivateSavedOutputs`)."""
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    if _tracing():
        return forward, recompute
    return forcing_custom_ops(_keeping_private(forward)), forcing_custom_ops(_keeping_private(recompute))
