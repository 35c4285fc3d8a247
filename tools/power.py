"""The layer's forward+backward as training meets it: back to back and after idle gaps (how much of each impl's time
is the SM clock that the power cap leaves it), and on the routing of a training run's step beside the benchmark's.

    python -m tools.power [--preset qwen3-30b-a3b] [--impls megamoe,megamoe_fp8] [--gaps-ms 0,2,10,50] [--calls 30]
                          [--routing random] [--counts LOG_JSON[:LAYER]] [--json PATH]

In training, bf16's expert GEMMs took 6-17% less than the per-kernel tools measure, FP8's about what they measure
(docs/PERFORMANCE.md, "FP8's experts in training, kernel by kernel"). Two differences could explain it. The power
cap: in the layer benchmark's tight loop the GPU sits at its power limit (docs/FACTS.md: the GEMMs run power-capped),
while in a training step the experts run between attention, dense GEMMs and memory-bound kernels. The routing: the
benchmark's random routing spreads the rows over all experts, while a young model's router sends most tokens to a
few (``megamoe.train``'s ``expert_load`` ~16 in most layers of its first steps: one expert takes nearly every token).
If bf16's forward+backward shortens after an idle gap, or on the training's routing, more than FP8's, the benchmark's
FP8-over-bf16 ratio overstates what training sees.

Each impl of the layer benchmark (``megamoe.bench``'s names; the preset's dims, 16 384 tokens by default) runs
``--calls`` timed forward+backward calls per routing and gap, the impls taking turns at each gap. Gap 0: the calls
back to back, as ``do_bench`` runs them. Gap G > 0: before each call the device idles G ms (a sync, then the host
sleeps), then a spin kernel of ~1 ms holds the stream while the host queues the call, so that its launches are not
timed. ``--counts``: also the routing of a ``megamoe.train`` log's last step (its ``expert_counts``) at decoder layer
LAYER (default: the layer of the median load), with the same x, weights and dy (:func:`routing_from_counts`). Per
impl, routing and gap: the median, the minimum and each call's time (CUDA events around the call alone). Needs a
CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from megamoe.arguments import positive_int
from megamoe.bench.common import ROUTINGS, make_problem
from megamoe.bench.layer import leaf_copies, make_impls, set_up
from megamoe.models import PRESETS
from megamoe.provenance import gpu_record, utc_now

SPIN_CYCLES = 2_000_000  # the spin kernel ahead of a call after a gap: ~1 ms at the H100's and H200's clocks


def timed_calls(fn, leaves, gap_ms: float, calls: int, cuda=torch.cuda, sleep=time.sleep) -> list[float]:
    """``calls`` timed calls of ``fn`` (milliseconds each), each after an idle gap of ``gap_ms`` (0: back to back),
    the gradients of ``leaves`` cleared before each call; one sync at the end (and one per gap). ``cuda`` and
    ``sleep``: torch.cuda and time.sleep (the tests pass stand-ins)."""
    if gap_ms < 0 or calls < 1:
        raise ValueError(f"timed_calls: a gap of at least 0 ms and at least one call, got {gap_ms} ms, {calls}")
    marks = []
    for _ in range(calls):
        for t in leaves:
            t.grad = None
        if gap_ms:
            cuda.synchronize()
            sleep(gap_ms / 1e3)
            cuda._sleep(SPIN_CYCLES)
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        marks.append((start, end))
    cuda.synchronize()
    return [start.elapsed_time(end) for start, end in marks]


def routing_from_counts(counts, num_tokens: int, top_k: int, device, generator) -> tuple:
    """(topk_idx int64, topk_weights fp32) in which expert e takes ``counts[e]`` of the ``num_tokens * top_k`` rows and
    no token picks an expert twice: the experts' rows laid out one expert after another over the slots taken pick by
    pick (slot j: token j mod T, its pick j div T), so that an expert's at most T consecutive slots fall on distinct
    tokens; then the tokens shuffled. Each token's weights: a softmax over N(0, 1) logits of its picks (the
    renormalised top-k of a softmax router)."""
    counts = torch.as_tensor(counts, dtype=torch.int64)
    if counts.dim() != 1 or int(counts.sum()) != num_tokens * top_k or bool((counts < 0).any()) \
            or bool((counts > num_tokens).any()):
        raise ValueError(f"routing_from_counts: counts must be one per expert, each 0 to {num_tokens}, summing to "
                         f"{num_tokens} tokens x top-{top_k} = {num_tokens * top_k}; got {counts.tolist()}")
    expert_of_slot = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    topk_idx = expert_of_slot.view(top_k, num_tokens).t().to(device)
    topk_idx = topk_idx[torch.randperm(num_tokens, device=device, generator=generator)].contiguous()
    logits = torch.randn(num_tokens, top_k, device=device, generator=generator)
    return topk_idx, torch.softmax(logits, dim=-1)


def counts_of(spec: str) -> tuple[str, int, list[int]]:
    """``--counts LOG_JSON[:LAYER]``: (the source, the layer, its expert counts) from a ``megamoe.train`` log.json's
    ``expert_counts`` (the last step's assignments per decoder layer and expert); LAYER counted from 0, by default
    the layer whose load (most-loaded expert over the mean) is the median of the layers'."""
    path, _, layer = spec.partition(":")
    try:
        log = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--counts: cannot read {path}: {e}") from None
    layers = log.get("expert_counts")
    if not layers:
        raise argparse.ArgumentTypeError(f"--counts: {path} holds no expert_counts (megamoe.train's log.json records "
                                         "the last step's)")
    if layer:
        if not layer.isdigit() or int(layer) >= len(layers):
            raise argparse.ArgumentTypeError(f"--counts: layer {layer!r}: {path} has layers 0 to {len(layers) - 1}")
        index = int(layer)
    else:
        loads = [max(c) * len(c) / sum(c) for c in layers]
        index = sorted(range(len(layers)), key=lambda i: loads[i])[len(layers) // 2]
    return f"{path}:{index}", index, layers[index]


def gaps_of(text: str) -> list[float]:
    """``--gaps-ms``: comma-separated milliseconds, each at least 0."""
    try:
        gaps = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gaps-ms takes comma-separated milliseconds, got {text!r}") from None
    if not gaps or any(g < 0 for g in gaps):
        raise argparse.ArgumentTypeError(f"--gaps-ms takes milliseconds of at least 0, got {text!r}")
    return gaps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.power", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS), help="the layer's dims")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens of the layer's batch")
    p.add_argument("--impls", default="megamoe,megamoe_fp8", help="the layer benchmark's impls (comma-separated)")
    p.add_argument("--gaps-ms", type=gaps_of, default=[0.0, 2.0, 10.0, 50.0], metavar="G[,G...]",
                   help="device idle time before each call, per series (0: back to back)")
    p.add_argument("--calls", type=positive_int, default=30, help="timed calls per impl, routing and gap")
    p.add_argument("--routing", choices=ROUTINGS, default="random", help="the benchmark's routing")
    p.add_argument("--counts", type=counts_of, metavar="LOG_JSON[:LAYER]",
                   help="also the routing of a megamoe.train log's last step at this decoder layer (see above)")
    p.add_argument("--json", type=Path, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools.power times the layer on a CUDA GPU; this machine has none")
    dim, inter, num_experts, top_k = PRESETS[args.preset]
    problem = make_problem(args.tokens, dim, inter, num_experts, top_k, args.routing, torch.bfloat16, "cuda", 0)
    problems = {args.routing: problem}
    if args.counts:
        source, _, counts = args.counts
        if len(counts) != num_experts or sum(counts) != args.tokens * top_k:
            raise SystemExit(f"--counts {source}: {len(counts)} experts and {sum(counts)} rows, where the "
                             f"{args.preset} layer at --tokens {args.tokens} has {num_experts} and "
                             f"{args.tokens * top_k}")
        generator = torch.Generator(device="cuda").manual_seed(1)
        x, _, _, w13, w2, dy = problem
        problems[f"trained ({source})"] = (x, *routing_from_counts(counts, args.tokens, top_k, "cuda", generator),
                                           w13, w2, dy)
    rows = []
    for routing, routed in problems.items():
        leaves = leaf_copies(routed)
        timed = [set_up(impl, routed, leaves) for impl in make_impls(args.impls.split(","), torch.device("cuda"))]
        for gap in args.gaps_ms:
            for t in timed:
                timed_calls(t.fwd_bwd, leaves, gap, 3)  # warm-up at this gap
                started = utc_now()
                ms = timed_calls(t.fwd_bwd, leaves, gap, args.calls)
                rows.append({"variant": t.impl.name, "routing": routing, "gap_ms": gap,
                             "median_ms": statistics.median(ms), "min_ms": min(ms), "calls_ms": ms,
                             "timed_utc": [started, utc_now()]})
                print(f"{routing}, gap {gap:5.1f} ms  {t.impl.name:24s} median {rows[-1]['median_ms']:7.3f} ms  "
                      f"min {rows[-1]['min_ms']:7.3f} ms", flush=True)
        del timed, leaves
        for gap in args.gaps_ms:
            series = [r for r in rows if r["gap_ms"] == gap and r["routing"] == routing]
            print(f"{routing}, gap {gap:5.1f} ms  " + "  ".join(
                f"{r['variant']} {series[0]['median_ms'] / r['median_ms']:.3f}x" for r in series[1:])
                + f" (over {series[0]['variant']})")
    if args.json:
        command = "python -m tools.power " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        args.json.write_text(json.dumps({**gpu_record(command), "preset": args.preset, "tokens": args.tokens,
                                         "calls": args.calls, "rows": rows}, indent=1) + "\n")

if __name__ == "__main__":
    main()
