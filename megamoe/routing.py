"""Routers: token → (top-k expert ids, gating weights).

Shape legend: T tokens, E experts, K experts per token.

Two score functions, each matching the model family's own code on the same logits:

* ``softmax`` — Qwen3-MoE / Mixtral (Hugging Face): fp32 softmax over all E logits, top-k of the
  probabilities, optionally renormalised to sum to one.
* ``sigmoid`` — DeepSeek-V3 / TorchTitan: fp32 sigmoid scores; the gating values are the scores of the chosen
  experts, optionally renormalised, then multiplied by ``route_scale``.

With either, an optional per-expert bias (aux-loss-free load balancing, ``MegaMoE.update_expert_bias``) is added
*only to choose* the experts, never to the gating values; a zero bias (``MegaMoE``'s initial one; Qwen3's own
routing has none) chooses as the model family's code does.
"""

from __future__ import annotations

import torch

SCORE_FUNCS = ("softmax", "sigmoid")


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    norm_topk_prob: bool = True,
    expert_bias_E: torch.Tensor | None = None,
    route_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token.

    Args:
        logits_TE: (T, E) router logits, any float dtype (scores are computed in fp32).
        top_k: experts per token, 1 <= top_k <= E.
        score_func: ``"softmax"`` or ``"sigmoid"`` (see module docstring).
        norm_topk_prob: renormalise the K gating weights of each token to sum to one.
        expert_bias_E: optional (E,) fp32 bias added to the scores for the choice only.
        route_scale: factor applied to the gating weights last (DeepSeek-V3 ``routed_scaling_factor``).

    Returns:
        topk_idx_TK: (T, K) int64 expert ids, in descending order of (biased) score.
        topk_weights_TK: (T, K) fp32 gating weights (differentiable w.r.t. ``logits_TE``).
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be (T, E), got shape {tuple(logits_TE.shape)}")
    num_experts = logits_TE.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    else:
        scores_TE = torch.sigmoid(logits_TE.float())
    if expert_bias_E is None:
        topk_weights_TK, topk_idx_TK = torch.topk(scores_TE, top_k, dim=-1)
    else:
        _, topk_idx_TK = torch.topk(scores_TE + expert_bias_E.float(), top_k, dim=-1)
        topk_weights_TK = scores_TE.gather(1, topk_idx_TK)
    if norm_topk_prob:
        # Softmax probabilities are positive, so their sum is > 0; sigmoid sums get TorchTitan's epsilon.
        eps = 1e-20 if score_func == "sigmoid" else 0.0
        topk_weights_TK = topk_weights_TK / (topk_weights_TK.sum(dim=-1, keepdim=True) + eps)
    if route_scale != 1.0:
        topk_weights_TK = topk_weights_TK * route_scale
    return topk_idx_TK, topk_weights_TK
