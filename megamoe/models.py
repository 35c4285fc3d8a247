"""The models megamoe is trained and measured on: the presets' layer dimensions, and transformers'
``Qwen3MoeForCausalLM`` built at them (``python -m megamoe.train``, and the model step of
``python -m megamoe.bench.model``)."""

from __future__ import annotations

import torch

PRESETS = {
    # name: (D hidden, I expert intermediate, E experts, K top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "tiny": (64, 32, 8, 2),
}
# Attention shapes of the presets' models (heads, KV heads, head dim), beside the MoE dims of PRESETS.
ATTENTION = {"qwen3-30b-a3b": (32, 4, 128), "qwen3-235b-a22b": (64, 4, 128), "tiny": (4, 2, 16)}


def build(preset: str, layers: int, vocab: int, dtype: torch.dtype, device, seed: int = 0):
    """transformers' ``Qwen3MoeForCausalLM`` at ``preset``'s layer dimensions with ``layers`` decoder layers and
    ``vocab`` tokens, random weights from ``seed``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dim, inter, num_experts, top_k = PRESETS[preset]
    heads, kv_heads, head_dim = ATTENTION[preset]
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim, moe_intermediate_size=inter,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                            max_position_embeddings=65536, attn_implementation="sdpa",
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype)
