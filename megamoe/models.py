"""The models megamoe is trained and measured on: the presets' layer dimensions, transformers'
``Qwen3MoeForCausalLM`` built at them (``python -m megamoe.train``, and the model step of
``python -m megamoe.bench.model``), and what both tools offer on it: the experts implementations (SonicMoE's
wired to its installed package) and the compile modes."""

from __future__ import annotations

import functools

import torch

PRESETS = {
    # name: (D hidden, I expert intermediate, E experts, K top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "tiny": (64, 32, 8, 2),
}
# Attention shapes of the presets' models (heads, KV heads, head dim), beside the MoE dims of PRESETS.
ATTENTION = {"qwen3-30b-a3b": (32, 4, 128), "qwen3-235b-a22b": (64, 4, 128), "tiny": (4, 2, 16)}


# The models' attention: transformers' SDPA ("sdpa"), or the same SDPA call registered under a name of its own,
# "sdpa_causal", for which transformers builds no mask: for one unpadded sequence per row (what the tools feed) the
# same attention, always through SDPA's is_causal=True and so its flash kernel. Compiling the whole model, transformers
# (5.24, with torch < 2.14) builds the full causal mask under "sdpa" instead, and SDPA runs without flash
# (docs/PERFORMANCE.md, "Inside a transformers model").
ATTENTION_IMPLEMENTATIONS = ("sdpa", "sdpa_causal")


def build(preset: str, layers: int, vocab: int, dtype: torch.dtype, device, seed: int = 0, attention: str = "sdpa"):
    """transformers' ``Qwen3MoeForCausalLM`` at ``preset``'s layer dimensions with ``layers`` decoder layers and
    ``vocab`` tokens, random weights from ``seed``, ``attention`` one of :data:`ATTENTION_IMPLEMENTATIONS` (no
    padding: "sdpa_causal" holds for unpadded sequences only). A model to train: no KV cache (``use_cache=False``;
    with it, transformers warns under activation checkpointing from inside the forward, which a fullgraph compile
    cannot trace)."""
    from transformers import AttentionInterface, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {attention!r}")
    AttentionInterface.register("sdpa_causal", sdpa_attention_forward)  # no mask function under this name
    dim, inter, num_experts, top_k = PRESETS[preset]
    heads, kv_heads, head_dim = ATTENTION[preset]
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim, moe_intermediate_size=inter,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                            max_position_embeddings=65536, attn_implementation=attention, use_cache=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype)


# -- the experts and compilation both tools offer ------------------------------------------------------------------

# transformers' experts implementations the tools run: megamoe's (registered by megamoe.integrations.transformers)
# and transformers' own; "sonicmoe" is transformers' SonicMoE integration running the installed package.
EXPERTS = ("megamoe", "grouped_mm", "eager", "sonicmoe")
# "layers": each decoder layer compiled on its own (graph breaks allowed); "model": the whole model in one graph,
# fullgraph=True (a graph break is an error).
COMPILE_MODES = ("layers", "model")
SONICMOE_INSTALL = "install sonic-moe (0.1.2.post1 was measured) with the QuACK and CUTLASS DSL versions it pins"


def experts_problem(experts, cuda: bool) -> str | None:
    """Why ``experts`` (names of :data:`EXPERTS`) cannot run here, in one line, or None: SonicMoE needs its
    package (importing it also wires it into transformers, :func:`use_installed_sonicmoe`) and a CUDA GPU."""
    if "sonicmoe" not in experts:
        return None
    try:
        use_installed_sonicmoe()
    except ImportError as exc:
        return str(exc)
    if not cuda:
        return "--experts sonicmoe needs a CUDA GPU (SonicMoE's kernels are CUDA only)"
    return None


def _not_importable(exc: ImportError) -> str:
    first = (str(exc).splitlines() or [type(exc).__name__])[0]  # the CUDA stack's errors can run long
    return f"--experts sonicmoe: SonicMoE is not importable ({first}); {SONICMOE_INSTALL}"


def pin_quack_default_configs() -> None:
    """SonicMoE's GEMMs at QuACK's default config: QuACK autotunes every GEMM shape on first use, which took longer
    than 9 minutes for one layer shape on the H200. ``ImportError`` where SonicMoE or QuACK is not importable."""
    import quack.gemm_interface as qgi
    import sonicmoe.functional as f0
    import sonicmoe.functional.backward as f2
    import sonicmoe.functional.forward as f1

    for module in (f0, f1, f2):
        for name in ("gemm", "gemm_gated", "gemm_dgated"):
            if hasattr(module, name):
                setattr(module, name, functools.partial(getattr(qgi, name), tuned=False))


def use_installed_sonicmoe() -> None:
    """Makes transformers' ``experts_implementation="sonicmoe"`` run the installed ``sonicmoe`` package (at QuACK's
    default GEMM config) instead of the build transformers fetches from the hub, which needs the network and a
    ``kernels`` install the GPU machines do not have. Raises ``ImportError`` (one line) where ``import sonicmoe``
    fails. A kernel transformers has already loaded is kept."""
    from transformers.integrations import sonicmoe as hf_sonicmoe

    if hf_sonicmoe._SONICMOE is not None:
        return
    try:  # sonicmoe on its own first: where it is missing, its ImportError is the one to report
        import sonicmoe
    except ImportError as exc:
        raise ImportError(_not_importable(exc)) from None
    try:
        from sonicmoe.enums import ActivationType

        pin_quack_default_configs()
    except ImportError as exc:
        raise ImportError(_not_importable(exc)) from None
    run = sonicmoe.moe_general_routing_inputs

    # dynamo cannot trace SonicMoE's CuTe DSL launches: the call runs eagerly (a graph break under per-layer
    # compilation; under fullgraph compilation an error that names this function).
    @torch._dynamo.disable
    def moe_general_routing_inputs(x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E,
                                   activation_type, is_inference_mode_enabled=False, concat_layout=False,
                                   stream_id=None):
        # transformers passes stream_id=None (its hub build picks the stream itself); the installed package
        # launches on the stream it is given, which must be the caller's current one.
        if stream_id is None:
            stream_id = torch.cuda.current_stream(x.device).cuda_stream
        return run(x, router_scores, token_indices, expert_indices, w1, b1, w2, b2, E, stream_id, activation_type,
                   is_inference_mode_enabled, concat_layout=concat_layout)

    hf_sonicmoe._SONICMOE = hf_sonicmoe.SonicMoE(activation_type_enum=ActivationType,
                                                 moe_general_routing_inputs=moe_general_routing_inputs)


def compile_model(model, mode: str, fullgraph: bool = True) -> None:
    """Compiles ``model`` (a transformers causal LM) in place, as :data:`COMPILE_MODES` says; ``fullgraph=False``
    lets the whole model (``mode="model"``) break into several graphs where dynamo cannot trace a call. Without a
    GPU the backend is ``aot_eager`` (graph capture and AOT autograd without code generation): inductor's CPU code
    is minutes of C++ compilation for a test-sized model and measures nothing."""
    backend = "inductor" if next(model.parameters()).is_cuda else "aot_eager"
    if mode == "layers":
        for layer in model.model.layers:
            layer.compile(backend=backend)
    elif mode == "model":
        model.compile(backend=backend, fullgraph=fullgraph)  # in place: parameter names stay the model's own
    else:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
