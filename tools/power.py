"""The layer's forward+backward timed back to back and after idle gaps: how much of each impl's time is the SM clock
that the power cap leaves it (docs/FACTS.md: the GEMMs run power-capped, and a GEMM's power follows its data).

    python -m tools.power [--preset qwen3-30b-a3b] [--impls megamoe,megamoe_fp8] [--gaps-ms 0,2,10,50] [--calls 30]
                          [--json PATH]

In the layer benchmark's tight loop the GPU sits at its power limit; in a training step the experts run between
attention, dense GEMMs and memory-bound kernels. In training, bf16's expert GEMMs took 6-17% less than the per-kernel
tools measure, FP8's about what they measure (docs/PERFORMANCE.md, "FP8's experts in training, kernel by kernel"). If
bf16's forward+backward shortens after an idle gap more than FP8's, the benchmark's FP8-over-bf16 ratio overstates
what training sees.

Each impl of the layer benchmark (``megamoe.bench``'s names; random routing, the preset's dims, 16 384 tokens by
default) runs ``--calls`` timed forward+backward calls per gap, the impls taking turns at each gap. Gap 0: the calls
back to back, as ``do_bench`` runs them. Gap G > 0: before each call the device idles G ms (a sync, then the host
sleeps), then a spin kernel of ~1 ms holds the stream while the host queues the call, so that its launches are not
timed. Per impl and gap: the median, the minimum and each call's time (CUDA events around the call alone). Needs a
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
from megamoe.bench.common import make_problem
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
    p.add_argument("--calls", type=positive_int, default=30, help="timed calls per impl and gap")
    p.add_argument("--json", type=Path, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools.power times the layer on a CUDA GPU; this machine has none")
    dim, inter, num_experts, top_k = PRESETS[args.preset]
    problem = make_problem(args.tokens, dim, inter, num_experts, top_k, "random", torch.bfloat16, "cuda", 0)
    leaves = leaf_copies(problem)
    timed = [set_up(impl, problem, leaves) for impl in make_impls(args.impls.split(","), torch.device("cuda"))]
    rows = []
    for gap in args.gaps_ms:
        for t in timed:
            timed_calls(t.fwd_bwd, leaves, gap, 3)  # warm-up at this gap
            started = utc_now()
            ms = timed_calls(t.fwd_bwd, leaves, gap, args.calls)
            rows.append({"variant": t.impl.name, "gap_ms": gap, "median_ms": statistics.median(ms), "min_ms": min(ms),
                         "calls_ms": ms, "timed_utc": [started, utc_now()]})
            print(f"gap {gap:5.1f} ms  {t.impl.name:24s} median {rows[-1]['median_ms']:7.3f} ms  "
                  f"min {rows[-1]['min_ms']:7.3f} ms", flush=True)
    for gap in args.gaps_ms:
        series = [r for r in rows if r["gap_ms"] == gap]
        print(f"gap {gap:5.1f} ms  " + "  ".join(f"{r['variant']} {series[0]['median_ms'] / r['median_ms']:.3f}x"
                                                 for r in series[1:]) + f" (over {series[0]['variant']})")
    if args.json:
        command = "python -m tools.power " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        args.json.write_text(json.dumps({**gpu_record(command), "preset": args.preset, "tokens": args.tokens,
                                         "routing": "random", "calls": args.calls, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
