"""Hugging Face transformers (5.x): ``import megamoe.integrations.transformers`` registers ``"megamoe"`` in
transformers' experts interface, so that a model whose experts use the 3-D ``gate_up_proj`` (E, 2I, D) /
``down_proj`` (E, D, I) layout runs them through :func:`megamoe.moe`::

    import megamoe.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="megamoe")
    # or, on a model already built: model.set_experts_implementation("megamoe")

Qwen3-MoE, Qwen3-Next and DeepSeek-V3-style experts (gated SwiGLU, concatenated gate/up, no biases) are
supported. Experts that megamoe does not compute are refused with a ``ValueError`` naming what differs, never
run approximately: transposed weights, biases, interleaved gate/up rows, a gate other than silu(g)·u (gpt-oss's
clamped activation), non-gated experts. transformers' expert-parallel sentinel ids (``>= num_experts``: "not
on this rank") contribute nothing, as dropped slots. bf16, fp16 and fp32 models; under ``torch.no_grad`` it
keeps nothing for a backward. For activation checkpointing, :func:`enable_activation_checkpointing` (or
transformers' own switch with :func:`megamoe.checkpoint_context` as its ``context_fn``). Expert parallelism:
:func:`shard_experts`. Keeping the gate/up pre-activation for the backward: :func:`set_save_for_backward`. Blockwise
FP8 GEMMs: :func:`set_precision`.
"""

from __future__ import annotations

import torch
from transformers.integrations import moe as hf_moe

import megamoe
from megamoe.api import PRECISIONS, SAVE_MODES, check_ep_options

NAME = "megamoe"


def _refuse_what_megamoe_does_not_compute(experts: torch.nn.Module) -> None:
    kind = type(experts).__name__
    if not getattr(experts, "has_gate", True):
        raise ValueError(f"experts_implementation='megamoe': {kind} has no gate (megamoe runs gated SwiGLU experts)")
    if getattr(experts, "has_bias", False):
        raise ValueError(f"experts_implementation='megamoe': {kind} has expert biases, which megamoe does not add")
    if getattr(experts, "is_transposed", False):
        raise ValueError(f"experts_implementation='megamoe': {kind} stores its weights transposed; megamoe takes "
                         "gate_up_proj (E, 2I, D) and down_proj (E, D, I)")
    if not getattr(experts, "is_concatenated", True):
        raise ValueError(f"experts_implementation='megamoe': {kind} interleaves its gate and up rows; megamoe takes "
                         "gate rows then up rows")
    if getattr(type(experts), "_apply_gate", hf_moe._default_apply_gate) is not hf_moe._default_apply_gate:
        raise ValueError(f"experts_implementation='megamoe': {kind} has its own gating function (a clamped or "
                         "scaled activation?); megamoe computes silu(gate) * up")
    act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"experts_implementation='megamoe': {kind} uses the {act!r} activation; megamoe computes "
                         "silu(gate) * up")


def enable_activation_checkpointing(model, context_fn=megamoe.checkpoint_context) -> None:
    """Full activation checkpointing of every decoder layer of a transformers ``model``, under which megamoe's
    forward is not recomputed (:func:`megamoe.checkpoint_context`): transformers' own switch
    (``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` before it was renamed) with
    ``use_reentrant=False`` and megamoe's ``context_fn``. ``context_fn=None``: plain full checkpointing (what the
    benchmark gives the other experts implementations)."""
    kwargs = {"use_reentrant": False} if context_fn is None else {"use_reentrant": False, "context_fn": context_fn}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def megamoe_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature: ``hidden_states`` (T, D), ``top_k_index`` (T, K) expert ids
    (``>= num_experts``: not on this rank), ``top_k_weights`` (T, K); returns (T, D) in ``hidden_states``'s
    dtype."""
    _refuse_what_megamoe_does_not_compute(self)
    w13, w2 = self.gate_up_proj, self.down_proj
    topk_idx = top_k_index.masked_fill(top_k_index >= self.num_experts, -1)  # sentinels: dropped slots
    group = getattr(self, EP_GROUP, None)  # set by shard_experts: this rank holds its E/R experts only
    max_tokens_per_rank, comm_sms = getattr(self, EP_OPTIONS, (None, None))
    y = megamoe.moe(hidden_states.to(w13.dtype).contiguous(), topk_idx, top_k_weights, w13, w2, group=group,
                    save_for_backward=getattr(self, SAVE_FOR_BACKWARD, "none"),
                    precision=getattr(self, PRECISION, "bf16"), max_tokens_per_rank=max_tokens_per_rank,
                    comm_sms=comm_sms)
    return y.to(hidden_states.dtype)


EP_GROUP = "megamoe_ep_group"
EP_OPTIONS = "megamoe_ep_options"  # (max_tokens_per_rank, comm_sms), set by shard_experts
SAVE_FOR_BACKWARD = "megamoe_save_for_backward"
PRECISION = "megamoe_precision"


def _set_on_experts(model: torch.nn.Module, attr: str, value: str, caller: str) -> None:
    found = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    if not found:
        raise ValueError(f"{caller}: the model has no experts module with gate_up_proj / down_proj")
    for module in found:
        setattr(module, attr, value)


def set_save_for_backward(model: torch.nn.Module, mode: str) -> None:
    """What every experts module of ``model`` keeps between forward and backward (:func:`megamoe.moe`'s
    ``save_for_backward``): ``"none"`` (the default: nothing; what checkpointed training wants) or ``"preact"``
    (the gate/up pre-activation, K·2I·2 bytes per token in bf16: the backward skips its recompute GEMM; with
    :func:`shard_experts` each rank keeps a buffer sized for the most rows it can receive, see
    :func:`megamoe.moe`)."""
    if mode not in SAVE_MODES:
        raise ValueError(f"save_for_backward must be one of {SAVE_MODES}, got {mode!r}")
    _set_on_experts(model, SAVE_FOR_BACKWARD, mode, "set_save_for_backward")


def set_precision(model: torch.nn.Module, precision: str) -> None:
    """The GEMM precision of every experts module of ``model`` (:func:`megamoe.moe`'s ``precision``): ``"bf16"``
    (the default) or ``"fp8"`` (blockwise FP8, DeepSeek-V3's recipe; the expert weights stay the bf16 master copy
    and their FP8 copies are cached until the optimizer changes them, or made at every call under
    ``megamoe.set_fp8_weight_cache("call")``; with :func:`shard_experts` too, the rows
    crossing to their owners in e4m3)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    _set_on_experts(model, PRECISION, precision, "set_precision")


def shard_experts(model: torch.nn.Module, ep_group, *, max_tokens_per_rank: int | None = None,
                  comm_sms: int | tuple[int, int] | None = None) -> list[torch.nn.Module]:
    """Expert parallelism for a transformers model with ``experts_implementation="megamoe"``: every experts module
    of ``model`` keeps only the experts of this rank of ``ep_group`` (rank r of R keeps experts [r*E/R,
    (r+1)*E/R) of its ``gate_up_proj`` / ``down_proj``, which must be divisible by R) and exchanges tokens
    with the other ranks through :func:`megamoe.moe`'s ``group`` (the router stays replicated and routes to global
    expert ids; each rank runs its own tokens). Call it on every rank, after loading the full weights and before
    wrapping the model (FSDP2: shard the experts over the data-parallel mesh only). Returns the experts modules.
    ``max_tokens_per_rank``, ``comm_sms``: passed to every call of :func:`megamoe.moe` (the fused path's workspace
    size, which also lets a compiled first call's token count be dynamic, and its sending SMs; ``None``: agreed at
    the first call, and the measured default).

    Their gradients are summed over the ep ranks' tokens: a trainer that averages the loss over ``R`` ranks divides
    them by ``R`` (FSDP2's average covers only its own mesh)."""
    import torch.distributed as dist

    check_ep_options(max_tokens_per_rank, comm_sms)
    ranks, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    sharded = []
    for module in model.modules():
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "num_experts")):
            continue
        _refuse_what_megamoe_does_not_compute(module)
        num_experts = module.gate_up_proj.shape[0]
        if num_experts % ranks:
            raise ValueError(f"shard_experts: {num_experts} experts do not split over {ranks} ranks")
        mine = slice(rank * num_experts // ranks, (rank + 1) * num_experts // ranks)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name)
            setattr(module, name, torch.nn.Parameter(full.detach()[mine].clone(), requires_grad=full.requires_grad))
        setattr(module, EP_GROUP, ep_group)
        setattr(module, EP_OPTIONS, (max_tokens_per_rank, comm_sms))
        sharded.append(module)
    if not sharded:
        raise ValueError("shard_experts: the model has no experts module with gate_up_proj / down_proj")
    return sharded


hf_moe.ExpertsInterface.register(NAME, megamoe_experts_forward)
