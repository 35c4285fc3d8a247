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

import torch
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


def _tracing() -> bool:
    """Whether the checkpointed region is being traced for torch.compile (AOTAutograd's proxy mode is active), as
    ``torch.utils.checkpoint`` itself tells (its ``_is_compiling``)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def checkpoint_context() -> tuple:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: megamoe's outputs are
    saved, everything else in the checkpointed region is recomputed (see the module docstring). Eagerly, megamoe
    runs as custom ops inside the region; under torch.compile (a compiled region traced with its checkpoint inside,
    whatever the order of wrapping and compiling) it already does, and torch wants the policy's two dispatch modes
    as they are."""
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    if _tracing():
        return forward, recompute
    return forcing_custom_ops(forward), forcing_custom_ops(recompute)
