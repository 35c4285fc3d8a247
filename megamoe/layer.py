"""``MegaMoE``: a drop-in MoE block (router + SwiGLU experts) built on :func:`megamoe.moe`."""

from __future__ import annotations

import torch
from torch import nn

from megamoe.api import (
    FLOAT_DTYPES,
    PRECISIONS,
    SAVE_MODES,
    check_ep_options,
    check_fp8_dims,
    moe,
)
from megamoe.routing import SCORE_FUNCS, route


class MegaMoE(nn.Module):
    """Router + experts. ``y = layer(x)`` for ``x`` of shape (..., hidden_size).

    Args:
        hidden_size: D, the model width.
        intermediate_size: I, each expert's SwiGLU width (``moe_intermediate_size`` in HF configs).
        num_experts: E, the number of routed experts.
        top_k: K, experts per token.
        score_func: ``"softmax"`` (Qwen3-MoE) or ``"sigmoid"`` (DeepSeek-V3 / TorchTitan); see
            :mod:`megamoe.routing`.
        norm_topk_prob: renormalise each token's K gating weights to sum to one.
        ep_group: process group for expert parallelism, or ``None``. With a group of R ranks this
            rank holds experts [r*E/R, (r+1)*E/R) (``w13``/``w2`` have E/R experts; R must divide E), the
            router stays replicated over all E, and :func:`megamoe.moe` exchanges the rows.
        precision: ``"bf16"`` or ``"fp8"`` (blockwise FP8 GEMMs; D and I multiples of 128): see :func:`megamoe.moe`.
        max_tokens_per_rank: with ``ep_group``, on the fused path: see :func:`megamoe.moe` (checked here).
        comm_sms: with ``ep_group``, on the fused path: see :func:`megamoe.moe` (``None``: the measured default;
            checked here, and values above 0 refused at the first forward where the fused path does not run).
        save_for_backward: ``"none"`` (keep no activations; the backward recomputes the gate/up GEMM) or
            ``"preact"`` (keep the gate/up pre-activation, K·2I·2 bytes per token in bf16): see
            :func:`megamoe.moe`.
        route_scale: multiplies the gating weights (DeepSeek-V3 ``routed_scaling_factor``).
        initializer_range: std of the normal init of every weight (HF ``initializer_range``).
        device, dtype: where and in which dtype to create the parameters (the router is kept in the
            same dtype; its scores are computed in fp32). fp64 on CPU only (the reference implementation).

    Parameters: ``gate.weight`` (E, D), ``w13`` (E/R, 2I, D) gate rows then up rows, ``w2`` (E/R, D, I)
    (R = 1 without ``ep_group``).

    Aux-loss-free load balancing (TorchTitan / DeepSeek-V3): in training mode every forward adds the
    tokens routed to each expert into the ``tokens_per_expert`` buffer; :meth:`update_expert_bias`
    (call it after the optimizer step, after summing ``tokens_per_expert`` over data-parallel ranks if
    you want a global balance) nudges ``expert_bias``, which is added to the scores to choose experts
    but never to the gating weights.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        ep_group=None,
        precision: str = "bf16",
        *,
        max_tokens_per_rank: int | None = None,
        comm_sms: int | tuple[int, int] | None = None,
        save_for_backward: str = "none",
        route_scale: float = 1.0,
        initializer_range: float = 0.02,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision == "fp8":
            check_fp8_dims(hidden_size, intermediate_size)
        if save_for_backward not in SAVE_MODES:
            raise ValueError(f"save_for_backward must be one of {SAVE_MODES}, got {save_for_backward!r}")
        check_ep_options(max_tokens_per_rank, comm_sms)
        on_cpu = torch.device(device if device is not None else torch.get_default_device()).type == "cpu"
        dtypes = (*FLOAT_DTYPES, torch.float64) if on_cpu else FLOAT_DTYPES  # fp64: the CPU reference (gradcheck)
        if dtype is not None and dtype not in dtypes:
            raise TypeError(f"dtype must be None or one of {dtypes} (the dtypes megamoe.moe computes in here), got "
                            f"{dtype}")
        num_ranks = 1
        if ep_group is not None:
            import torch.distributed as dist

            if not isinstance(ep_group, dist.ProcessGroup):
                raise TypeError(f"ep_group must be a torch.distributed ProcessGroup or None, got "
                                f"{type(ep_group).__name__}")
            num_ranks = dist.get_world_size(ep_group)
            if num_experts % num_ranks:
                raise ValueError(f"num_experts={num_experts} must be a multiple of the ep_group size {num_ranks}")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob, self.route_scale = score_func, norm_topk_prob, route_scale
        self.ep_group, self.precision, self.initializer_range = ep_group, precision, initializer_range
        self.max_tokens_per_rank, self.comm_sms = max_tokens_per_rank, comm_sms
        self.save_for_backward = save_for_backward
        factory = {"device": device, "dtype": dtype}
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        num_local = num_experts // num_ranks
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size, **factory))
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, device=device, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for every weight, as HF's ``_init_weights`` does for MoE models."""
        for p in (self.gate.weight, self.w13, self.w2):
            nn.init.normal_(p, mean=0.0, std=self.initializer_range)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have last dimension hidden_size={self.hidden_size}, got {tuple(x.shape)}")
        if x.dtype != self.w13.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the layer's weights are {self.w13.dtype}: cast the input "
                            "(or the layer: layer.to(x.dtype))")
        x_TD = x.reshape(-1, self.hidden_size)
        logits_TE = self.gate(x_TD)
        topk_idx, topk_weights = route(
            logits_TE, self.top_k, score_func=self.score_func, norm_topk_prob=self.norm_topk_prob,
            expert_bias_E=self.expert_bias, route_scale=self.route_scale,
        )
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.scatter_add_(
                    0, topk_idx.reshape(-1), torch.ones_like(topk_idx.reshape(-1), dtype=torch.float32)
                )
        y_TD = moe(x_TD, topk_idx, topk_weights, self.w13, self.w2, group=self.ep_group, precision=self.precision,
                   max_tokens_per_rank=self.max_tokens_per_rank, comm_sms=self.comm_sms,
                   save_for_backward=self.save_for_backward)
        return y_TD.reshape(x.shape)

    @torch.no_grad()
    def update_expert_bias(self, coeff: float = 1e-3) -> None:
        """TorchTitan's aux-loss-free update: raise the bias of under-loaded experts and lower it for
        over-loaded ones by ``coeff`` (sign of the deviation from the mean load), keep the bias centred,
        and reset ``tokens_per_expert``."""
        delta = coeff * torch.sign(self.tokens_per_expert.mean() - self.tokens_per_expert)
        self.expert_bias.add_(delta - delta.mean())
        self.tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        # precision="bf16" computes in the weights' dtype, whatever it is: the dtype says what runs, and the
        # precision shows only where it changes that
        precision = "" if self.precision == "bf16" else f"precision={self.precision!r}, "
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func!r}, "
                f"dtype={str(self.w13.dtype).removeprefix('torch.')}, {precision}"
                f"save_for_backward={self.save_for_backward!r}")
