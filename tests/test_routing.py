"""Routers against the formulas of Hugging Face Qwen3-MoE and TorchTitan / DeepSeek-V3."""

import pytest
import torch

from megamoe.routing import route


def hf_qwen3_router(logits, top_k, norm_topk_prob):
    # Qwen3MoeSparseMoeBlock: softmax in fp32, top-k, renormalise, cast back to the hidden dtype.
    probs = torch.nn.functional.softmax(logits, dim=1, dtype=torch.float)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return idx, weights


def titan_sigmoid_router(logits, top_k, bias, route_norm, route_scale):
    # TorchTitan TokenChoiceTopKRouter (score_func="sigmoid", no expert groups).
    scores = torch.sigmoid(logits.to(torch.float32))
    if bias is not None:
        _, idx = torch.topk(scores + bias, k=top_k, dim=1)
        top = scores.gather(dim=1, index=idx)
    else:
        top, idx = torch.topk(scores, k=top_k, dim=1)
    if route_norm:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, top * route_scale


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_matches_hf_qwen3(norm, dtype):
    logits = torch.randn(64, 12, generator=torch.Generator().manual_seed(1)).to(dtype)
    idx, w = route(logits, 4, score_func="softmax", norm_topk_prob=norm)
    ref_idx, ref_w = hf_qwen3_router(logits, 4, norm)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(64))


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("norm,scale", [(True, 1.0), (False, 2.5)])
def test_sigmoid_matches_torchtitan(use_bias, norm, scale):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(50, 10, generator=gen)
    bias = torch.randn(10, generator=gen) if use_bias else None
    idx, w = route(logits, 3, score_func="sigmoid", norm_topk_prob=norm, expert_bias_E=bias, route_scale=scale)
    ref_idx, ref_w = titan_sigmoid_router(logits, 3, bias, norm, scale)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, rtol=0, atol=0)


def test_bias_changes_choice_not_weights():
    logits = torch.zeros(4, 6)
    logits[:, 0] = 3.0
    bias = torch.zeros(6)
    bias[5] = 10.0
    idx, w = route(logits, 1, score_func="sigmoid", norm_topk_prob=False, expert_bias_E=bias)
    assert (idx == 5).all()
    torch.testing.assert_close(w, torch.full((4, 1), 0.5))  # sigmoid(0), the unbiased score


def test_route_is_differentiable():
    logits = torch.randn(8, 5, requires_grad=True)
    _, w = route(logits, 2)
    w.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"score_func": "relu"}, "score_func"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": 9}, "top_k"),
])
def test_route_rejects_bad_arguments(kwargs, match):
    args = {"top_k": 2, **kwargs}
    top_k = args.pop("top_k")
    with pytest.raises(ValueError, match=match):
        route(torch.randn(3, 8), top_k, **args)
