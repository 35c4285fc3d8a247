"""A transformers Qwen3-MoE model's training step with each experts implementation, side by side:

    python -m megamoe.bench.model [--preset qwen3-30b-a3b] [--layers 2] [--tokens 16384] [--experts megamoe,grouped_mm]
                                  [--checkpoint] [--compile]

The model is built from a config at the preset's layer dimensions (hidden size, heads, experts, top-k, expert
width) with ``--layers`` decoder layers and a small vocabulary, bf16, random weights (no download). A step is
forward + backward of the causal-LM loss on ``--tokens`` tokens (one sequence), gradients dropped after it (no
optimizer). ``--checkpoint``: full activation checkpointing of every decoder layer — with
``megamoe.checkpoint_context`` for megamoe (its forward is not recomputed), plain for the others, as users run
them. ``--compile``: ``torch.compile`` of every decoder layer. Medians of CUDA-event timings over ``--iters`` steps
after warm-up; the JSON records the GPU, versions, date, commit and command. Without a GPU: one forward+backward
of the tiny preset's model per implementation, its loss and gradients compared with the first's, and no timings.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

import megamoe
from megamoe.bench.common import csv_of
from megamoe.integrations.transformers import (
    enable_activation_checkpointing,  # registers "megamoe" too
)
from megamoe.models import ATTENTION, build
from megamoe.provenance import git_commit, source_digest, utc_now

EXPERTS = ("megamoe", "grouped_mm", "eager")


def prepared(model, experts: str, checkpoint: bool, compile_layers: bool):
    """A copy of ``model`` with ``experts``'s implementation, checkpointing and compilation as asked."""
    model = copy.deepcopy(model)
    model.set_experts_implementation(experts)
    model.train()
    if checkpoint:  # megamoe under its own policy; the others plainly, as users run them
        enable_activation_checkpointing(model, megamoe.checkpoint_context if experts == "megamoe" else None)
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    return model


def step_fn(model, input_ids):
    def step():
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.detach()

    return step


def loss_and_grads(model, input_ids) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward+backward of the causal-LM loss: the loss and every parameter's gradient."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def check_on_cpu(experts: list[str], checkpoint: bool) -> int:
    """Without a GPU: one forward+backward of the tiny preset's model (fp32) per implementation, its loss and
    gradients compared with the first implementation's. Returns the exit status (1 if they disagree)."""
    print(f"No CUDA GPU: timings need a GPU. Instead, one forward+backward of the tiny preset's model (fp32, "
          f"32 tokens{', checkpointed' if checkpoint else ''}) per implementation: its loss, and its loss and "
          f"gradients against {experts[0]}'s.")
    model = build("tiny", 2, 128, torch.float32, "cpu")
    input_ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    runs = {e: loss_and_grads(prepared(model, e, checkpoint, False), input_ids) for e in experts}
    first_loss, first_grads = runs[experts[0]]
    print(f"  {'experts':12s} {'loss':>10s} {'|loss diff|':>12s} {'max grad diff':>14s}  (per parameter, relative to its "
          "largest gradient)")
    failed = False
    for e, (loss, grads) in runs.items():
        if e == experts[0]:
            print(f"  {e:12s} {loss:10.6f}")
            continue
        loss_diff = abs(loss - first_loss)
        grad_diff = max(((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
                        for n, g in first_grads.items())
        failed |= loss_diff > 1e-4 * abs(first_loss) or grad_diff > 1e-3 or grads.keys() != first_grads.keys()
        print(f"  {e:12s} {loss:10.6f} {loss_diff:12.2e} {grad_diff:14.2e}")
    if failed:
        print("FAILED: the implementations disagree (tolerance: 1e-4 relative for the loss, 1e-3 for gradients)")
        return 1
    print("OK: the implementations agree. Run on a CUDA GPU for timings.")
    return 0


def timed(step, iters: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megamoe.bench.model", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(ATTENTION), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (one sequence)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    p.add_argument("--experts", type=csv_of(EXPERTS), default="megamoe,grouped_mm", help=f"from {EXPERTS}")
    p.add_argument("--checkpoint", action="store_true", help="full activation checkpointing of every layer")
    p.add_argument("--compile", action="store_true", help="torch.compile every decoder layer")
    p.add_argument("--iters", type=int, default=10, help="timed steps per implementation")
    p.add_argument("--out", default="benchmarks/out", help="folder for the JSON")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        if check_on_cpu(args.experts, args.checkpoint):
            sys.exit(1)
        return
    import triton

    device = torch.device("cuda")
    model = build(args.preset, args.layers, args.vocab, torch.bfloat16, device)
    input_ids = torch.randint(0, args.vocab, (1, args.tokens), device=device,
                              generator=torch.Generator(device=device).manual_seed(0))
    results = []
    for experts in args.experts:
        ms = timed(step_fn(prepared(model, experts, args.checkpoint, args.compile), input_ids), args.iters)
        results.append({"experts": experts, "step_ms": ms, "tokens_per_s": args.tokens / ms * 1e3})
        print(f"  {experts:12s} step {ms:8.3f} ms  {args.tokens / ms * 1e3:10.0f} tokens/s", flush=True)
    info = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit(), "source_sha256": source_digest(), "date": utc_now("seconds"),
            "command": "python -m megamoe.bench.model " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "preset": args.preset, "layers": args.layers, "tokens": args.tokens, "vocab": args.vocab,
            "checkpoint": args.checkpoint, "compile": args.compile,
            "parameters": sum(p.numel() for p in model.parameters()), "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"model-{args.preset}-l{args.layers}-t{args.tokens}{'-ckpt' if args.checkpoint else ''}.json"
    path.write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
