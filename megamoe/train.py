"""Train transformers' Qwen3-MoE on real text, with megamoe's experts or transformers' own:

    python -m megamoe.train [--preset qwen3-30b-a3b] [--layers 4] [--experts megamoe] [--steps 300]
                            [--compile-mode layers|model]
    torchrun --nproc-per-node N -m megamoe.train ... [--ep N]        (FSDP2; --ep: expert parallelism)

Without a GPU the defaults are a run of about a minute on 2 cores (``--preset tiny --steps 30 --seq-len 256
--seqs-per-step 4``, fp32), and the script says so before the first step.

Also a template to copy. What it does, in order:

- **Data**: the Python standard library's sources of the running interpreter (``--corpus`` for another folder),
  every ``*.py`` file in sorted order, one document each; every 50th document is held out for eval. A byte-level
  BPE tokenizer (``tokenizers``, ``--vocab-size`` 32 768) is trained on the training documents; documents are
  tokenised, joined with an end-of-text token and cut into sequences of ``--seq-len`` tokens. Tokenizer and
  tokens are cached in ``--out``/cache, keyed by the corpus's digest. Sequences are read in a random order per
  epoch from ``--seed`` (rank r of R takes every R-th batch).
- **Model**: ``Qwen3MoeForCausalLM`` built from a config at the preset's layer dimensions (hidden size, heads,
  KV heads, head dim, 128 experts, top-8, expert width, ``norm_topk_prob``) and Qwen3's vocabulary (151 936)
  with ``--layers`` decoder layers, random weights from ``--seed``, SDPA attention, bf16 weights and bf16 AdamW
  states (no fp32 master copy; on CPU fp32). The router's auxiliary load-balancing loss (transformers' Qwen3-MoE
  formula, coefficient 0.001, counted without a host sync) is part of the loss; the logged loss is the
  language-model loss alone.
- **Step**: ``--micro-batches`` forward+backward passes (default 1; more: gradient accumulation, the loss and
  gradients their mean, FSDP2's reduction after the last; FP8 experts quantise their weights once per step, so
  more micro-batches share it, or with ``--fp8-weight-cache call`` at every call, keeping no copies between layers)
  of ``--seqs-per-step`` sequences each; full activation checkpointing of every decoder layer (megamoe under
  :func:`megamoe.checkpoint_context`, which does not rerun its forward; the others plainly), optionally
  ``torch.compile`` of every decoder layer (``--compile-mode layers``, or ``--compile``) or of the whole model in
  one graph (``--compile-mode model``, ``fullgraph=True``; without a GPU the ``aot_eager`` backend); gradient
  clipping at 1.0; AdamW (β 0.9/0.95, weight decay 0.1) with
  linear warm-up and cosine decay to 10% of ``--lr``, torch's fused implementation (one pass over each parameter's
  weights, gradient and states; ``--optimizer foreach`` for its multi-tensor one, a pass per arithmetic step with
  temporaries the size of the weights).
- **Output** in ``--out``/``--name``: ``log.json`` (configuration — with FP8 experts whether their weight gradients
  are FP8, ``fp8_weight_gradients``, with FP8 ones x's scales in dW13, ``fp8_wgrad_x_scales``, and their weight
  copies' policy, ``fp8_weight_cache`` —, per-step losses, eval losses, each step's expert load per decoder layer
  (``expert_load``: the most-loaded expert's top-k assignments over the mean, every rank's tokens; 1 is balanced; the
  progress bar shows the largest), the last step's assignments per decoder layer and expert (``expert_counts``, which
  ``python -m tools.power --counts`` times the layer on), tokens/s — the median over the steps after the first 10 —,
  step and host times, each step's forward+backward passes (``passes_ms``), its gradients' clipping (``clip_ms``: the
  expert gradients' mean over ``--ep``, the norm and the scaling) and its optimizer step (``optimizer_ms``: AdamW and
  zeroing the gradients), the three making up ``step_ms``, with their medians (``passes_ms_median``,
  ``clip_ms_median``, ``optimizer_ms_median``), MFU, peak memory, what the CUDA caching allocator asked of the driver
  over those steps (``allocator_timed_steps``: segments got by ``cudaMalloc`` and given back, and allocations retried
  after freeing its cache, each a stall); GPU, versions, date, commit, command), ``loss.png``, with ``--profile A-B``
  ``profile.json`` (torch's profiler over steps A to B: each part's host and device time per step, and each kernel's,
  with the part that launched it; ``megamoe.profiling``), and checkpoints (``--checkpoint-every``): per rank, the
  model's and the optimizer's tensors in ``rank{r}.safetensors`` (with the RNG states) and the step in ``state.json``;
  ``--resume DIR`` continues from one bitwise as if never stopped (same world size and ``--ep``).

MFU counts 6 FLOPs per token per active parameter of the attention projections, router, routed experts and LM
head, plus causal attention's 6·S·H·hd per token per layer (S the sequence length), without the recompute of
checkpointing, against 989 TFLOP/s (the H100/H200's dense bf16 peak). ``--moe-share-steps`` times extra steps'
forward+backward passes (``--micro-batches`` a step, and with FP8 experts their weight copies made in each step, as
after an optimizer step) at the end with the experts and with the experts replaced by zeros (same routing):
``moe_ms`` is the difference per step, ``moe_share`` its fraction of the forward+backward passes,
``moe_share_of_step`` its fraction of the training step (the median ``step_ms``: clipping and the optimizer step too),
the share that an Amdahl estimate of tokens/s takes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

import megamoe
from megamoe.arguments import (
    HelpFormatter,
    add_compile_mode,
    non_negative_int,
    positive_float,
    positive_int,
    step_range,
)
from megamoe.env import FP8_WEIGHT_CACHES, FP8_WGRAD_X_SCALES_NAMES
from megamoe.integrations.transformers import (
    enable_activation_checkpointing,
    set_precision,
    shard_experts,
)
from megamoe.kernels.grads import scale_
from megamoe.kernels.quant import (
    clear_weight_cache,
    fp8_weight_cache,
    make_weight_copies_ahead,
    weight_copies_bytes,
)
from megamoe.models import (
    ATTENTION,
    COMPILE_MODES,
    EXPERTS,
    PRESETS,
    build,
    compile_model,
    experts_problem,
)
from megamoe.profiling import StepProfiler
from megamoe.provenance import git_commit, source_digest, utc_now

QWEN3_VOCAB = 151_936  # Qwen3's vocabulary size (the model's embedding and LM head; the tokenizer uses fewer ids)
PEAK_TFLOPS = 989.0  # dense bf16, H100 / H200 SXM
EVAL_EVERY_DOC = 50  # every 50th document is held out
TIMING_SKIP = 10  # steps left out of the medians (compilation, autotuning, allocator warm-up)
# what profile.json repeats of log.json, so that it stands alone
PROFILE_PROVENANCE = ("gpu", "torch", "triton", "megamoe", "commit", "source_sha256", "date", "command", "preset",
                      "layers", "experts", "expert_precision", "seq_len", "seqs_per_step", "micro_batches", "world",
                      "ep", "seed", "compile_mode", "optimizer")
AUX_LOSS_COEF = 0.001
# What fits one H200 (141 GB) with bf16 weights, gradients and AdamW states (8 bytes per parameter): the 2-layer
# 30B-dims run peaked at 38.7 GiB (16 384 tokens, checkpointed); each further layer adds ~4.6 GiB (0.62 G
# parameters) at the 30B dims and ~18 GiB (2.4 G) at the 235B dims. Estimates, with room to spare.
DEFAULT_LAYERS = {"qwen3-30b-a3b": 16, "qwen3-235b-a22b": 4, "tiny": 2}
# The defaults that differ by device: one H200's run, and a run of about a minute on a CPU (42 s on 2 cores).
GPU_DEFAULTS = {"preset": "qwen3-30b-a3b", "steps": 300, "seq_len": 16384, "seqs_per_step": 1, "warmup": 30}
CPU_DEFAULTS = {"preset": "tiny", "steps": 30, "seq_len": 256, "seqs_per_step": 4, "warmup": 3}
NO_EXPERTS = "megamoe_train_no_experts"  # the ablation of --moe-share-steps


# -- data --------------------------------------------------------------------------------------------------------

def corpus_files(root: Path) -> list[Path]:
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    if not files:
        raise FileNotFoundError(f"no *.py files under {root}")
    return files


def load_corpus(root: Path, vocab_size: int, cache: Path, log=print) -> dict:
    """{"train", "eval": int32 token ids (documents joined by the end-of-text id), "digest", "documents",
    "vocab_size"}: the tokenizer trained on the training documents, both cached under ``cache``."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = corpus_files(root)
    docs = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    digest = hashlib.sha256()
    for path, text in zip(files, docs):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + text.encode() + b"\0")
    key = f"{digest.hexdigest()[:16]}-v{vocab_size}"
    tokens_file, tokenizer_file = cache / f"tokens-{key}.safetensors", cache / f"tokenizer-{key}.json"
    info = {"digest": digest.hexdigest(), "documents": len(docs), "characters": sum(map(len, docs))}
    if tokens_file.exists() and tokenizer_file.exists():
        tokens = load_file(tokens_file)
        return {**info, **tokens, "vocab_size": Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()}
    held_out = [i % EVAL_EVERY_DOC == 0 for i in range(len(docs))]
    log(f"training a {vocab_size}-token BPE tokenizer on {len(docs)} documents ({info['characters'] / 1e6:.1f} M "
        f"characters) of {root}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([d for d, h in zip(docs, held_out) if not h], trainer)
    eot = tokenizer.token_to_id("<|endoftext|>")
    split = {"train": [], "eval": []}
    for doc, encoding in zip(held_out, tokenizer.encode_batch(docs)):
        split["eval" if doc else "train"] += [*encoding.ids, eot]
    tokens = {name: torch.tensor(ids, dtype=torch.int32) for name, ids in split.items()}
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tokenizer_file))
    save_file(tokens, tokens_file)
    return {**info, **tokens, "vocab_size": tokenizer.get_vocab_size()}


class Sequences:
    """Token ids cut into sequences of ``seq_len``; batch ``b`` of the run is sequences ``[b*n, (b+1)*n)`` of the
    order, which is a fresh permutation of every sequence per epoch (from ``seed`` and the epoch)."""

    def __init__(self, ids: torch.Tensor, seq_len: int, seed: int):
        self.count = ids.numel() // seq_len
        if self.count == 0:
            raise ValueError(f"{ids.numel()} tokens make no sequence of {seq_len}")
        self.rows = ids[: self.count * seq_len].view(self.count, seq_len).long()
        self.seed, self._orders = seed, {}

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: torch.randperm(self.count, generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + epoch))}
        return self._orders[epoch]

    def batch(self, index: int, size: int) -> torch.Tensor:
        picks = [index * size + j for j in range(size)]
        return self.rows[torch.stack([self.order(i // self.count)[i % self.count] for i in picks])]


# -- model -------------------------------------------------------------------------------------------------------

class RouterLogits:
    """Every router's logits of ``model``'s last forward, for the auxiliary loss: each router's forward hook keeps
    its output on the router module. (An attribute store, which a compiled layer replays without a guard on what it
    held; appending to one shared list made each decoder layer's compiled frame guard on the list's length, so that
    each layer compiled an entry of its own and the layers past dynamo's recompile limit, 8, ran eagerly.)"""

    ATTR = "_megamoe_train_logits"

    def __init__(self, model):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
        self.clear()
        for router in self.routers:
            router.register_forward_hook(_keep_router_logits)

    def take(self) -> list[torch.Tensor]:
        """The logits of the last forward, router by router; forgotten by the routers."""
        logits = [getattr(router, self.ATTR) for router in self.routers]
        self.clear()
        if any(x is None for x in logits):
            raise RuntimeError("a router did not run in the last forward: no logits to take")
        return logits

    def clear(self) -> None:
        for router in self.routers:
            setattr(router, self.ATTR, None)


def _keep_router_logits(module, _inputs, outputs):
    setattr(module, RouterLogits.ATTR, outputs[0])


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int,
                        top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(The router's auxiliary load-balancing loss as transformers' Qwen3-MoE computes it, ``E * sum_e f_e * P_e``
    over every layer's rows: f the fraction of top-k assignments, P the mean router probability of expert e; each
    router's top-k assignments per expert, (routers, E) fp32). The assignments are counted by ``scatter_add``:
    transformers' ``torch.bincount`` waits for the GPU (its output size depends on the data), which would stall
    every step."""
    counts = torch.zeros(len(router_logits), num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=counts.device)
    rows = 0
    for layer, logits in enumerate(router_logits):
        weights = torch.softmax(logits, dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        counts[layer].scatter_add_(0, chosen, torch.ones_like(chosen, dtype=counts.dtype))
        probs = probs + weights.float().sum(dim=0)
        rows += weights.shape[0]
    return num_experts * torch.sum((counts.sum(dim=0) / rows) * (probs / rows)), counts


def expert_load(counts: torch.Tensor) -> torch.Tensor:
    """Each router's most-loaded expert over the mean, from its assignments per expert (..., E): 1 when balanced,
    E / top-k when every token picks the same top-k experts."""
    return counts.amax(dim=-1) / counts.mean(dim=-1)


def _no_experts(self, hidden_states, top_k_index, top_k_weights):
    return hidden_states * 0 + top_k_weights.sum() * 0  # the routing stays in the graph; the experts cost nothing


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward, no recompute): 6 per active parameter of the attention
    projections, router, routed experts and LM head, and 6·S·H·hd of causal attention per layer."""
    d, h, kv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_layer = (2 * d * h * hd + 2 * d * kv * hd + d * config.num_experts
                 + config.num_experts_per_tok * 3 * d * config.moe_intermediate_size)
    params = config.num_hidden_layers * per_layer + d * config.vocab_size
    return 6 * params + config.num_hidden_layers * 6 * seq_len * h * hd


def mfu(flops_per_step: float, step_ms: float) -> float:
    """The fraction of PEAK_TFLOPS that ``flops_per_step`` in ``step_ms`` is."""
    return flops_per_step / step_ms / 1e9 / PEAK_TFLOPS


def prepare(model, experts: str, compile_mode: str | None, mesh, ep_group, precision: str = "bf16"):
    """``model`` with ``experts``'s implementation (megamoe's GEMMs in ``precision``), full activation
    checkpointing, (expert parallelism and FSDP2 when distributed) and compiled as ``compile_mode`` says
    (:data:`megamoe.models.COMPILE_MODES`, or None). Returns the expert parameters (their gradients are divided by
    the ep size)."""
    model.set_experts_implementation(experts)
    if experts == "megamoe":
        set_precision(model, precision)
    enable_activation_checkpointing(model, megamoe.checkpoint_context if experts == "megamoe" else None)
    if ep_group is not None:
        shard_experts(model, ep_group)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            if ep_group is not None:  # each rank's own experts, sharded over the ranks that hold the same ones
                fully_shard(layer.mlp.experts, mesh=mesh["dp"])
            fully_shard(layer, mesh=mesh["world"])
        fully_shard(model, mesh=mesh["world"])
    expert_params = [p for layer in model.model.layers for p in layer.mlp.experts.parameters()] if ep_group else []
    if compile_mode is not None:
        # The routers' hooks (RouterLogits) store onto the routers inside checkpointed layers, a side effect
        # dynamo refuses in a compiled checkpoint unless it may leave it out of the backward's recompute, which
        # the loop wants anyway (the loss takes the forward's logits).
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        compile_model(model, compile_mode)
    return expert_params


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_gradients(params, expert_params, max_norm: float, ep_group, expert_divisor: int = 1) -> torch.Tensor:
    """Divides the expert gradients by ``expert_divisor`` and then scales every gradient so that their global norm
    is at most ``max_norm``; returns the norm before the scaling. The division is folded into the norm and the
    scaling, not a pass of its own. Under expert parallelism each rank's expert gradients are its own experts':
    their squares are summed over the ep group; everything else is a DTensor (FSDP2) or the whole model."""
    experts = {id(p) for p in expert_params}
    others = [p.grad for p in params if p.grad is not None and id(p) not in experts]
    expert_grads = [p.grad for p in expert_params if p.grad is not None]
    groups = ((others, 1), (expert_grads, expert_divisor))
    squares = []
    for grads, divisor in groups:
        if not grads:
            continue
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append((norm.float() / divisor).square())
    total = torch.stack(squares).sum()
    if ep_group is not None and len(squares) == 2:
        expert_sq = squares[1].clone()
        dist.all_reduce(expert_sq, group=ep_group)
        total = squares[0] + expert_sq
    total = total.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads, divisor in groups:
        if grads:
            scale_([_local(g) for g in grads], scale / divisor)  # shards of two meshes
    return total


# -- checkpoints -------------------------------------------------------------------------------------------------

def _optimizer_params(model, opt) -> list[tuple[str, torch.Tensor]]:
    """(name, the optimizer's parameter object) in the optimizer's order. By position, not by object: FSDP2 may
    register new parameter objects (on the same storage) at its first forward, after the optimizer was made."""
    held = [p for group in opt.param_groups for p in group["params"]]
    names = [n for n, _ in model.named_parameters()]
    if len(held) != len(names):
        raise RuntimeError(f"the optimizer holds {len(held)} parameters, the model has {len(names)}")
    return list(zip(names, held))


def save_checkpoint(folder: Path, model, opt, step: int, rank: int, meta: dict) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model/{n}": _local(p.detach()) for n, p in model.named_parameters()}
    for name, p in _optimizer_params(model, opt):
        for key, value in opt.state.get(p, {}).items():
            tensors[f"optim/{name}/{key}"] = _local(value)
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, folder / f"rank{rank}.safetensors")
    if rank == 0:
        (folder / "state.json").write_text(json.dumps({**meta, "step": step}, indent=1) + "\n")


# What a checkpoint written before a run setting was recorded ran with (--micro-batches: one per step).
_BEFORE_THE_KEY = {"micro_batches": 1}


def load_checkpoint(folder: Path, model, opt, rank: int, expect: dict) -> int:
    """Loads what :func:`save_checkpoint` wrote into ``model`` and ``opt``; returns the next step."""
    from safetensors.torch import load_file

    state = {**_BEFORE_THE_KEY, **json.loads((folder / "state.json").read_text())}
    for key, value in expect.items():
        if state.get(key) != value:
            raise ValueError(f"--resume {folder}: the checkpoint has {key}={state.get(key)!r}, this run {value!r}")
    tensors = load_file(folder / f"rank{rank}.safetensors")
    with torch.no_grad():
        for name, p in model.named_parameters():
            _local(p).copy_(tensors[f"model/{name}"])
        for name, p in _optimizer_params(model, opt):
            keys = [k for k in tensors if k.startswith(f"optim/{name}/")]
            entry = {}
            for key in keys:
                value, field = tensors[key], key.rsplit("/", 1)[1]
                if value.dim() == 0:  # AdamW's step count: where the optimizer keeps it (fused: on the device)
                    entry[field] = value.to(_local(p).device) if opt.defaults["fused"] else value.clone()
                else:
                    entry[field] = torch.zeros_like(p)
                    _local(entry[field]).copy_(value)
            if entry:
                opt.state[p] = entry
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    return state["step"]


# -- the run -----------------------------------------------------------------------------------------------------

def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_args(argv=None, cuda: bool | None = None):
    """The parsed arguments, with the device's defaults filled in (``cuda``: whether a GPU runs this; default:
    whether one is visible) and ``args.device_note``: what was chosen for the device, to print (or None).
    Arguments that cannot run here end the program with one line (argparse's error)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    p = argparse.ArgumentParser(prog="python -m megamoe.train", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--preset", choices=sorted(ATTENTION),
                   help=f"layer dimensions (tiny: a test-sized model; default: {GPU_DEFAULTS['preset']}, "
                        f"without a GPU {CPU_DEFAULTS['preset']})")
    p.add_argument("--layers", type=positive_int,
                   help="decoder layers (default: what fits one 141 GB H200 with bf16 AdamW, estimated from the "
                        "measured peak of a 2-layer run: 16 at the 30B dims, 10.6 G parameters; 4 at the 235B "
                        "dims, 11.2 G; 2 for tiny)")
    p.add_argument("--experts", choices=EXPERTS, default="megamoe",
                   help="experts implementation (sonicmoe: the installed package, on a GPU)")
    for name, what in (("steps", "optimizer steps"), ("seq_len", "tokens per sequence"),
                       ("seqs_per_step", "sequences per step (per rank)")):
        p.add_argument(_option(name), type=positive_int,
                       help=f"{what} (default: {GPU_DEFAULTS[name]}, without a GPU {CPU_DEFAULTS[name]})")
    p.add_argument("--micro-batches", type=positive_int, default=1,
                   help="forward+backward passes per optimizer step (gradient accumulation), each on --seqs-per-step "
                        "sequences: the step's loss and gradients are their mean")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="megamoe's expert GEMMs: bf16, or fp8 (blockwise FP8, DeepSeek-V3's recipe; the weights' bf16 "
                        "master copy kept; --experts megamoe, layer dims multiples of 128; with --ep the rows cross "
                        "in FP8)")
    p.add_argument("--fp8-weight-cache", choices=FP8_WEIGHT_CACHES,
                   help="with --precision fp8, how long the expert weights' FP8 copies live (megamoe."
                        "set_fp8_weight_cache; default: MEGAMOE_FP8_WEIGHT_CACHE, else step): step, until the "
                        "optimizer changes the weights (every layer's copies held at once: 2 bytes per expert weight "
                        "element); ahead, the same, made again right after each optimizer step on a CUDA stream of "
                        "their own, beside the next forward's first layers; or call, made in every forward and "
                        "backward and held by none (a quantisation in each; what FSDP2 runs of many layers need)")
    p.add_argument("--lr", type=positive_float, default=3e-4, help="peak learning rate")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                   help="torch's AdamW implementation: fused (default) or foreach")
    p.add_argument("--warmup", type=non_negative_int,
                   help=f"warm-up steps (default: {GPU_DEFAULTS['warmup']}, without a GPU {CPU_DEFAULTS['warmup']})")
    p.add_argument("--seed", type=int, default=0, help="weights and data order")
    add_compile_mode(p, COMPILE_MODES)
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel ranks (divides the world size; megamoe only)")
    p.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                   help="folder whose *.py files are the text (default: this Python's standard library)")
    p.add_argument("--vocab-size", type=positive_int, default=32768, help="BPE tokenizer vocabulary")
    p.add_argument("--eval-every", type=positive_int, default=50, help="eval every N steps (and after the last)")
    p.add_argument("--eval-seqs", type=positive_int, help="held-out sequences per eval (default: all of them, at most 8)")
    p.add_argument("--log-every", type=positive_int, default=10, help="progress-bar update every N steps (syncs)")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=0, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="write no checkpoint files (for resuming; activation checkpointing is always on)")
    p.add_argument("--resume", type=Path, help="a checkpoint folder to continue from")
    p.add_argument("--stop-after", type=positive_int, help="leave after this step (the schedule still spans --steps)")
    p.add_argument("--moe-share-steps", type=non_negative_int, default=0,
                   help="after training: time this many steps with and without the experts (moe_share; GPU only)")
    p.add_argument("--profile", type=step_range, metavar="A-B",
                   help="run torch.profiler over steps A to B (counted from 1; A alone: one step) and write where "
                        "their device time went, per part of the step and per kernel, to profile.json beside log.json "
                        "(megamoe.profiling); those steps run slower, and count in the log's times")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/train"), help="runs and the data cache")
    p.add_argument("--name", help="run folder name (default: from preset, experts, seq-len, seed)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--plot", nargs="+", type=Path, metavar="LOG_JSON",
                   help="train nothing: draw these runs' loss curves on one plot, into --out (a .png path)")
    args = p.parse_args(argv)
    if args.plot:
        if args.out.suffix != ".png":
            p.error(f"--plot draws into --out, which must then be a .png path (got {args.out})")
        return args
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.moe_share_steps and not cuda:
        p.error("--moe-share-steps times the step on a GPU (CUDA events); this machine has none")
    if args.resume is not None and not args.resume.is_dir():
        p.error(f"--resume {args.resume}: no such checkpoint folder")
    if world == 1 and args.ep != 1:
        p.error("--ep needs several processes (torchrun --nproc-per-node N)")
    if world % args.ep:
        p.error(f"--ep {args.ep} does not divide the world size {world}")
    if args.ep > 1 and args.experts != "megamoe":
        p.error("--ep runs the megamoe experts (transformers' own have no token exchange)")
    if args.fp8_weight_cache and args.precision != "fp8":
        p.error("--fp8-weight-cache sets how FP8 experts keep their weight copies: it needs --precision fp8")
    if args.precision == "fp8":
        dim, inter = PRESETS[args.preset or (GPU_DEFAULTS if cuda else CPU_DEFAULTS)["preset"]][:2]
        if args.experts != "megamoe":
            p.error("--precision fp8 runs megamoe's experts (--experts megamoe)")
        if dim % 128 or inter % 128:
            p.error(f"--precision fp8 needs the layer's hidden and expert sizes to be multiples of 128 (FP8's "
                    f"scale groups); this preset's are {dim} and {inter}")
    problem = experts_problem([args.experts], cuda)
    if problem:
        p.error(problem)
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    taken = [name for name in defaults if getattr(args, name) is None]
    for name in taken:
        setattr(args, name, defaults[name])
    if args.layers is None:
        args.layers = DEFAULT_LAYERS[args.preset]
    args.device_note = None
    if not cuda:
        note = "No CUDA GPU: training on the CPU in fp32"
        if taken:
            note += ", with the CPU's defaults " + " ".join(f"{_option(n)} {CPU_DEFAULTS[n]}" for n in taken)
        tokens = args.steps * args.seq_len * args.seqs_per_step
        if args.preset != "tiny" or tokens > math.prod(CPU_DEFAULTS[n] for n in ("steps", "seq_len", "seqs_per_step")):
            suggestion = " ".join(f"{_option(n)} {v}" for n, v in CPU_DEFAULTS.items() if n != "warmup")
            note += f". This setting will be slow on a CPU; `{suggestion}` takes about a minute on 2 cores."
        else:
            note += " (about a minute on 2 cores, and the first run trains the tokenizer)."
        args.device_note = note
    return args


def setup_distributed(args):
    """(rank, world, device, mesh, ep_group) from torchrun's environment; a single process without it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return 0, 1, torch.device("cuda" if cuda else "cpu"), None, None
    from torch.distributed.device_mesh import init_device_mesh

    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    kind = "cuda" if cuda else "cpu"
    mesh = {"world": init_device_mesh(kind, (world,))}
    ep_group = None
    if args.ep > 1:
        grid = init_device_mesh(kind, (world // args.ep, args.ep), mesh_dim_names=("dp", "ep"))
        mesh["dp"], ep_group = grid["dp"], grid["ep"].get_group()
    return rank, world, torch.device(kind, torch.cuda.current_device()) if cuda else torch.device("cpu"), mesh, \
        ep_group


def all_mean(values: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        values = values.clone()
        dist.all_reduce(values)
        values /= world
    return values


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.plot:
        runs = [json.loads(path.read_text()) for path in args.plot]
        plot_runs(runs, args.out, labels=[f"{r['experts']}{precision_label(r)}, seed {r['seed']}: eval "
                                          f"{r['final_eval_loss']:.3f}" for r in runs])
        print(f"wrote {args.out}")
        return None
    rank, world, device, mesh, ep_group = setup_distributed(args)
    cuda = device.type == "cuda"
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.device_note:
        say(args.device_note)
    accumulated = f"x{args.micro_batches}" if args.micro_batches > 1 else ""
    name = args.name or (f"{args.preset}-l{args.layers}-{args.experts}{'-fp8' if args.precision == 'fp8' else ''}"
                         f"-s{args.seq_len}x{args.seqs_per_step}{accumulated}-seed{args.seed}")
    run_dir = args.out / name
    data = load_corpus(args.corpus, args.vocab_size, args.out / "cache", log=say)
    train, held_out = Sequences(data["train"], args.seq_len, args.seed), Sequences(data["eval"], args.seq_len, 0)
    if args.eval_seqs is None:
        args.eval_seqs = min(8, held_out.count)
    if held_out.count < args.eval_seqs:
        raise ValueError(f"the held-out split has {held_out.count} sequences of {args.seq_len}, --eval-seqs "
                         f"{args.eval_seqs}")
    dtype = torch.bfloat16 if cuda else torch.float32
    vocab = data["vocab_size"] if args.preset == "tiny" else QWEN3_VOCAB
    model = build(args.preset, args.layers, vocab, dtype, device, seed=args.seed)
    router_logits = RouterLogits(model)
    params_total = sum(p.numel() for p in model.parameters())
    flops_per_token = model_flops_per_token(model.config, args.seq_len)
    model.train()
    expert_params = prepare(model, args.experts, args.compile_mode, mesh, ep_group, args.precision)
    if args.fp8_weight_cache:
        megamoe.set_fp8_weight_cache(args.fp8_weight_cache)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **{args.optimizer: True})
    meta = {"preset": args.preset, "layers": args.layers, "experts": args.experts,
            "expert_precision": args.precision, "seq_len": args.seq_len,
            "seqs_per_step": args.seqs_per_step, "micro_batches": args.micro_batches, "world": world, "ep": args.ep,
            "seed": args.seed,
            "steps": args.steps, "corpus_digest": data["digest"]}
    start = 0
    if args.resume:
        start = load_checkpoint(args.resume, model, opt, rank, {k: meta[k] for k in meta if k != "experts"})
        say(f"resumed from {args.resume} at step {start}")
    say(f"{args.preset}, {args.layers} layers, {params_total / 1e9:.3f} G parameters, experts {args.experts}, "
        f"{world} rank(s), ep {args.ep}; {train.count} training sequences of {args.seq_len} tokens "
        f"({data['documents']} documents, tokenizer vocab {data['vocab_size']})")
    if args.precision == "fp8":
        say(fp8_copies_line(model))

    def step_loss(ids):  # (the loss to train on, the language-model loss alone, assignments per router and expert)
        lm_loss = model(input_ids=ids, labels=ids).loss
        aux, counts = load_balancing_loss(router_logits.take(), model.config.num_experts,
                                          model.config.num_experts_per_tok)
        return lm_loss + AUX_LOSS_COEF * aux, lm_loss.detach(), counts

    def evaluate() -> float:  # every rank runs every held-out sequence (FSDP2 and EP exchange in lockstep)
        losses = []
        with torch.no_grad():
            for i in range(args.eval_seqs):
                ids = held_out.batch(i, 1).to(device)
                losses.append(model(input_ids=ids, labels=ids).loss)  # the language-model loss alone
                router_logits.clear()
        return torch.stack(losses).float().mean().item()

    tokens_per_step = args.seq_len * args.seqs_per_step * args.micro_batches * world
    stop = min(args.steps, args.stop_after if args.stop_after is not None else args.steps)
    log = {"losses": [], "grad_norms": [], "eval": [], "step_ms": [], "passes_ms": [], "clip_ms": [], "optimizer_ms": [],
           "host_ms": [], "expert_load": [], "expert_counts": None}
    pending = []
    bar = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=stop - start, desc=name, unit="step", dynamic_ncols=True, file=sys.stdout)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def flush():
        if not pending:
            return
        _wait(pending[-1].marks[-1])  # the last step's end
        losses = all_mean(torch.stack([p.lm_loss for p in pending]).float(), world).tolist()
        norms = torch.stack([p.norm for p in pending]).float().tolist()
        counts = all_mean(torch.stack([p.counts for p in pending]), world)  # per rank, averaged over the ranks
        loads = expert_load(counts).tolist()  # every rank's tokens
        log["expert_counts"] = (counts[-1] * world).round().int().tolist()  # the latest step's, every rank's tokens
        for p, loss, norm, load in zip(pending, losses, norms, loads):
            log["losses"].append(loss)
            log["grad_norms"].append(norm)
            log["expert_load"].append([round(x, 4) for x in load])
            log["host_ms"].append(p.host_ms)
            log["step_ms"].append(_elapsed_ms(p.marks[0], p.marks[-1]))
            for key, begin, end in zip(("passes_ms", "clip_ms", "optimizer_ms"), p.marks, p.marks[1:]):
                log[key].append(_elapsed_ms(begin, end))
        if bar is not None:
            ms = log["step_ms"][-1]
            postfix = {"loss": f"{losses[-1]:.3f}", "tok/s": f"{tokens_per_step / ms * 1e3:,.0f}",
                       "load": f"{max(loads[-1]):.2f}"}
            if cuda:
                postfix["MFU"] = f"{mfu(flops_per_token * tokens_per_step, ms):.1%}"
                postfix["mem"] = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}G"
            bar.set_postfix(postfix)
            bar.update(len(pending))
        pending.clear()

    allocator = {}  # the CUDA caching allocator's counts at the first timed step (cudaMalloc / cudaFree / retries)
    if args.profile and not start < args.profile[0] <= args.profile[1] <= stop:
        raise ValueError(f"--profile {args.profile[0]}-{args.profile[1]}: this run trains steps {start + 1} to {stop}")
    profiler = StepProfiler(args.profile, cuda)
    for step in range(start, stop):
        if cuda and step == start + TIMING_SKIP:
            allocator = allocator_counts(device)
        profiler.begin(step)
        host_start = time.perf_counter()
        marks = [_mark(cuda)]
        with profiler.phase("passes"):
            lm_loss, counts = step_passes(model, train, args, step, world, rank, device, step_loss, mesh)
        marks.append(_mark(cuda))
        # the expert gradients are summed over the ep ranks' tokens; the loss is their mean
        with profiler.phase("clip"):
            norm = clip_gradients(params, expert_params, 1.0, ep_group, expert_divisor=args.ep)
        marks.append(_mark(cuda))
        with profiler.phase("optimizer"):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            opt.step()
            opt.zero_grad(set_to_none=True)
        marks.append(_mark(cuda))
        profiler.end(step)
        pending.append(_Pending(lm_loss, norm.detach(), counts, tuple(marks), (time.perf_counter() - host_start) * 1e3))
        last = step == stop - 1
        if (step + 1) % args.log_every == 0 or last:
            flush()
        if (step + 1) % args.eval_every == 0 or last:
            flush()
            log["eval"].append({"step": step + 1, "loss": evaluate()})
            if bar is not None:
                bar.write(f"step {step + 1}: eval loss {log['eval'][-1]['loss']:.4f}")
        if not args.no_checkpoint and (last or (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)):
            save_checkpoint(run_dir / f"checkpoint-{step + 1}", model, opt, step + 1, rank, meta)
    flush()
    if bar is not None:
        bar.close()
    result = summary(args, meta, log, start, tokens_per_step, flops_per_token, params_total, device)
    if allocator:  # over the timed steps (and the evals among them)
        result["allocator_timed_steps"] = {k: v - allocator[k] for k, v in allocator_counts(device).items()}
    if args.moe_share_steps:
        result.update(moe_share(model, train, args, device, world, rank, step_loss, mesh))
        if result["step_ms_median"]:  # of the whole training step (clipping and the optimizer step included)
            result["moe_share_of_step"] = result["moe_ms"] / result["step_ms_median"]
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "log.json").write_text(json.dumps(result, indent=1) + "\n")
        plot_runs([result], run_dir / "loss.png")
        if profiler.summary is not None:
            provenance = {key: result[key] for key in PROFILE_PROVENANCE}
            (run_dir / "profile.json").write_text(json.dumps({**provenance, **profiler.summary}, indent=1) + "\n")
        written = run_dir.resolve()
        checkpoints = sorted(written.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
        say(f"done: final eval loss {result['final_eval_loss']:.4f}, {result['tokens_per_s'] or 0:,.0f} tokens/s\n"
            f"  log:        {written / 'log.json'}\n  loss curve: {written / 'loss.png'}\n"
            f"  checkpoint: {checkpoints[-1] if checkpoints and not args.no_checkpoint else 'none (--no-checkpoint)'}"
            + (f"\n  profile:    {written / 'profile.json'}" if profiler.summary is not None else ""))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return result


class _Pending(NamedTuple):
    """A training step's results until :func:`main`'s ``flush`` reads them: its language-model loss, gradient norm
    and expert counts (on the device); its marks (:func:`_mark`) at its start, after its passes, after clipping
    and at its end; the host's milliseconds for the step."""

    lm_loss: torch.Tensor
    norm: torch.Tensor
    counts: torch.Tensor
    marks: tuple
    host_ms: float


def _mark(cuda: bool):
    """A point in a training step: on a GPU a CUDA event recorded on the stream (read after the step, no sync), on
    CPU the host's clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(begin, end) -> float:
    return begin.elapsed_time(end) if isinstance(begin, torch.cuda.Event) else (end - begin) * 1e3


def _wait(mark) -> None:
    """Waits until a :func:`_mark` is reached (on CPU it has been)."""
    if isinstance(mark, torch.cuda.Event):
        mark.synchronize()


def allocator_counts(device) -> dict:
    """The CUDA caching allocator's cumulative counts: segments it got from the driver (``cudaMalloc``) and gave back
    (``cudaFree``), and the allocations that failed and freed its whole cache to retry."""
    stats = torch.cuda.memory_stats(device)
    return {"cuda_mallocs": stats.get("num_device_alloc", 0), "cuda_frees": stats.get("num_device_free", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def summary(args, meta, log, start, tokens_per_step, flops_per_token, params_total, device) -> dict:
    import transformers
    import triton

    cuda = device.type == "cuda"

    def timed_median(values):  # over the steps after the first TIMING_SKIP, or all of a shorter run's
        timed = values[TIMING_SKIP:] or values
        return statistics.median(timed) if timed else None

    medians = {f"{key}_median": timed_median(log[key])
               for key in ("step_ms", "host_ms", "passes_ms", "clip_ms", "optimizer_ms")}
    step_ms = medians["step_ms_median"]
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__, "megamoe": megamoe.__version__,
        "commit": git_commit(),
        "source_sha256": source_digest(), "date": utc_now("seconds"),
        "command": "python -m megamoe.train " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        **meta, "compile_mode": args.compile_mode, "params": params_total, "precision": "bf16" if cuda else "fp32",
        # FP8 experts' weight gradients in FP8 (``MEGAMOE_FP8_WGRAD``) or in bf16; None for bf16 experts
        "fp8_weight_gradients": megamoe.autograd.FP8_WGRAD if args.precision == "fp8" else None,
        # and with FP8 ones, x's scales in dW13 (``MEGAMOE_FP8_WGRAD_X_SCALES``: the recipe's "tile", "layer", "expert")
        "fp8_wgrad_x_scales": (megamoe.autograd.FP8_WGRAD_X_SCALES
                               if args.precision == "fp8" and megamoe.autograd.FP8_WGRAD else None),
        # and how long their weights' FP8 copies live (``megamoe.set_fp8_weight_cache``)
        "fp8_weight_cache": fp8_weight_cache() if args.precision == "fp8" else None,
        "optimizer": f"AdamW ({args.optimizer}), " + ("bf16 states" if cuda else "fp32"),
        "first_step": start, "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / step_ms * 1e3 if step_ms else None, **medians,
        "mfu": mfu(flops_per_token * tokens_per_step, step_ms) if cuda and step_ms else None,
        "mfu_flops_per_token": flops_per_token, "mfu_peak_tflops": PEAK_TFLOPS,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "final_eval_loss": log["eval"][-1]["loss"] if log["eval"] else None,
        "moe_share": None, "moe_ms": None, "moe_share_of_step": None, "allocator_timed_steps": None, **log,
    }


def moe_share(model, train, args, device, world, rank, step_loss, mesh=None) -> dict:
    """Times ``--moe-share-steps`` steps' forward+backward passes (:func:`step_passes`, no optimizer step) of the
    training loss ``step_loss`` with the run's experts, then with the experts replaced by zeros: the experts' share
    of the step."""
    from transformers.integrations import moe as hf_moe

    hf_moe.ExpertsInterface.register(NO_EXPERTS, _no_experts)

    def median_ms() -> float:
        times = []
        for i in range(args.moe_share_steps + 3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # the FP8 experts' weight copies dropped (and under "ahead" made again), as by the optimizer step before
            # every training step: the step's quantisation timed with its experts, not the last timed step's copies
            clear_weight_cache()
            make_weight_copies_ahead(model.parameters())
            begin.record()
            step_passes(model, train, args, i, world, rank, device, step_loss, mesh)
            end.record()
            end.synchronize()
            model.zero_grad(set_to_none=True)
            times.append(begin.elapsed_time(end))
        return statistics.median(times[3:])

    copies = ", the FP8 weight copies made in each" if args.precision == "fp8" else ""
    with_experts = median_ms()
    model.set_experts_implementation(NO_EXPERTS)
    without = median_ms()
    model.set_experts_implementation(args.experts)
    return {"moe_share": 1 - without / with_experts, "moe_ms": with_experts - without, "moe_share_method":
            f"ablation: median of {args.moe_share_steps} steps' forward+backward passes ({args.micro_batches} a "
            f"step{copies}) with the experts ({with_experts:.2f} ms) and with the experts replaced by zeros "
            f"({without:.2f} ms)"}


def step_passes(model, train, args, step, world, rank, device, step_loss, mesh=None):
    """The forward+backward passes of training step ``step`` (its ``--micro-batches``; the gradient their mean),
    without the optimizer step; returns the step's language-model loss and expert counts."""
    lm_loss = counts = 0.0
    for micro in range(args.micro_batches):
        if mesh is not None:  # FSDP2 reduces the gradients after the last micro-batch only
            model.set_requires_gradient_sync(micro == args.micro_batches - 1)
        index = (step * args.micro_batches + micro) * world + rank
        ids = train.batch(index, args.seqs_per_step).to(device, non_blocking=True)
        loss, micro_lm_loss, micro_counts = step_loss(ids)
        (loss / args.micro_batches).backward()
        lm_loss = lm_loss + micro_lm_loss / args.micro_batches
        counts = counts + micro_counts
    return lm_loss, counts


def fp8_copies_line(model) -> str:
    """What the FP8 experts' weight copies hold on this rank under the policy in force
    (``megamoe.set_fp8_weight_cache``), in one line for the run's start."""
    held = sum(weight_copies_bytes(p) for layer in model.model.layers for p in layer.mlp.experts.parameters())
    if fp8_weight_cache() != "call":
        ahead = ", made right after each optimizer step" if fp8_weight_cache() == "ahead" else ""
        return (f"FP8 expert weights: their copies held through each step{ahead}, {held / 2**30:.2f} GiB on this rank "
                "(--fp8-weight-cache call: none held, quantised in every forward and backward)")
    return (f"FP8 expert weights: copies made in every forward and backward, none held ({held / 2**30:.2f} GiB "
            "with --fp8-weight-cache step)")


def precision_label(run: dict) -> str:
    """`` (FP8)`` for a run with FP8 experts, saying whether their weight gradients were FP8 (``FP8 dW``) or bf16
    where its log records it, and x's dW13 scales where they were an option's (``x over the layer``, ``x per
    expert``); empty for bf16 experts."""
    if run.get("expert_precision") != "fp8":
        return ""
    wgrad = run.get("fp8_weight_gradients")
    if wgrad is None:
        return " (FP8)"
    name = FP8_WGRAD_X_SCALES_NAMES.get(run.get("fp8_wgrad_x_scales"))
    option = f", x {name}" if name else ""
    return f" (FP8, {'FP8' if wgrad else 'bf16'} dW{option})"


def plot_runs(runs: list[dict], path: Path, labels: list[str] | None = None) -> None:
    """Training loss (and eval loss, dots) against step for each run, on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        label = labels[i] if labels else f"{run['experts']} seed {run['seed']}"
        steps = range(run["first_step"] + 1, run["first_step"] + len(run["losses"]) + 1)
        (line,) = ax.plot(steps, run["losses"], lw=0.8, alpha=0.8, label=label)
        ax.plot([e["step"] for e in run["eval"]], [e["loss"] for e in run["eval"]], "o", color=line.get_color(),
                ms=4)
    first = runs[0]
    ax.set(xlabel="step", ylabel="loss (dots: held-out)", title=f"{first['preset']}, {first['layers']} layers, "
           f"{first['seq_len']}x{first['seqs_per_step']} tokens per step, {first['gpu']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
