"""Activation checkpointing that leaves megamoe alone: a ``context_fn`` for ``torch.utils.checkpoint`` under which a
checkpointed block recomputes everything but megamoe's forward.

megamoe keeps no activations (``save_for_backward="none"``), so under full checkpointing its forward need not run
twice: saving its output, (T, D), is enough. :func:`checkpoint_context` is a selective-checkpoint policy that
saves the outputs of megamoe's forward ops (the layer's output) and prefers recomputing every other op, the routing
plan's included; while it is active, megamoe runs as ``torch.library`` custom ops, which the policy can see (eagerly it
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

# megamoe's forward ops, whose outputs the policy saves (built once: the policy runs on every op of a checkpointed
# region); the first output of each is the layer's output, y. The routing plan's op (``megamoe::plan``, a few small
# kernels) is recomputed with the rest of the block: saving its int32 vectors would hold ~0.5 MiB per layer (16 384
# tokens, top-8) beyond what plain checkpointing holds.
_FORWARD_OPS = frozenset({torch.ops.megamoe.experts_fwd.default, torch.ops.megamoe.experts_fwd_saved.default,
                          torch.ops.megamoe.ep_fwd.default, torch.ops.megamoe.ep_fwd_saved.default})


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _FORWARD_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _PrivateSavedOutputs(TorchDispatchMode):
    """Hands the caller a copy of the layer's output y from each of megamoe's forward ops, so that the y the policy
    keeps for the recompute stays private. Entered above the policy's mode (it sees each op first). Without it the
    kept y is the caller's own: code compiled inside an eager checkpoint (transformers' per-layer compile, where
    the checkpoint wraps the layer's call) writes later results into the storage of a tensor that its graph no
    longer reads (inductor's buffer reuse), and so would the recompute's replay of that graph: the recompute got
    another value than megamoe's output, and the forward's own output was overwritten during the backward
    (``tests/test_checkpoint.py``, the checkpoint around a compiled block). The forward ops' other output (the saved
    products) is read by megamoe's backward only, so a compiled graph keeps it as a saved value and never
    reuses its storage. The cost: a copy of y, (T, D), in the forward and in the recompute."""

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
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the outputs of
    megamoe's forward ops are saved, everything else in the checkpointed region (the routing plan included) is
    recomputed (see the module docstring). Eagerly, megamoe runs as custom ops inside the region; under
    torch.compile (a compiled region traced with its checkpoint inside, whatever the order of wrapping and
    compiling) it already does, and torch wants the policy's two dispatch modes as they are; otherwise the kept
    layer outputs are private copies (:class:`_PrivateSavedOutputs`)."""
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    if _tracing():
        return forward, recompute
    return forcing_custom_ops(_keeping_private(forward)), forcing_custom_ops(_keeping_private(recompute))
