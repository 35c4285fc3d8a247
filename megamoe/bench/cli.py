"""``python -m megamoe.bench``: the layer benchmark (:mod:`megamoe.bench.layer`) and, with ``--ep``, the
expert-parallel benchmark (:mod:`megamoe.bench.ep`). Without a GPU both run a small correctness check instead
and say that timings need a GPU."""

from __future__ import annotations

import argparse
import importlib.util

import torch

from megamoe.arguments import HelpFormatter, csv_of, non_negative_int, positive_int
from megamoe.bench import ep, layer
from megamoe.bench.common import PRESETS, ROUTINGS

# Where results go unless --out says otherwise: an ignored folder, so that a run never overwrites the
# committed results behind the README's tables (benchmarks/results/).
DEFAULT_OUT = "benchmarks/out"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megamoe.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", type=csv_of(PRESETS), default="qwen3-30b-a3b",
                   help=f"one or more (comma-separated) of {sorted(PRESETS)}")
    p.add_argument("--tokens", type=csv_of(positive_int), default="16384", help="tokens per step (T), comma-separated")
    p.add_argument("--routing", type=csv_of(ROUTINGS), default="random", help=f"comma-separated, from {ROUTINGS}")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated, from {layer.IMPLS} (default: {layer.DEFAULT_IMPLS}; 'loop' is slow: opt "
                        f"in; 'liger' needs liger-kernel; 'sonicmoe' needs sonic-moe, and is skipped with a message "
                        f"where it is not importable; megamoe_fp8[_saved]_x_layer and _x_expert: FP8 with that "
                        f"option of x's dW13 scales, MEGAMOE_FP8_WGRAD_X_SCALES, beside the recipe in one process); "
                        f"with --ep from {ep.EP_IMPLS} (default: all)")
    p.add_argument("--sonicmoe-autotune", action="store_true",
                   help="let SonicMoE's QuACK GEMMs autotune (default: pinned to their default config; autotuning one "
                        "layer shape took more than 9 minutes on an H200)")
    p.add_argument("--ep", action="store_true",
                   help="expert-parallel benchmark over the torchrun ranks (see megamoe/bench/ep.py); --tokens is "
                        "per rank")
    p.add_argument("--ep-iters", type=positive_int, default=20, help="timed iterations per measurement with --ep")
    p.add_argument("--loopback", type=non_negative_int, default=0, metavar="R",
                   help="with --ep: R virtual ranks on one device (no torchrun): the fused protocol against the "
                        "plain one-device layer, and in blockwise FP8 against the bf16 loopback where D and I are "
                        "multiples of 128; 0: the ranks torchrun started")
    p.add_argument("--comm-sms", type=csv_of(positive_int), default=[], metavar="N[,N...]",
                   help="with --ep: also the fused protocol sending rows from N programs of the expert kernels' "
                        "launches (impl fused_smsN; with --loopback R > 1 each rank's senders run before every GEMM, so "
                        "only R = 1 overlaps)")
    p.add_argument("--comm-sms-split", type=csv_of(_split_of_senders),
                   default=[], metavar="F:B[,F:B...]",
                   help="with --ep on real ranks: also the fused protocol with F sending programs in the forward and "
                        "B in the backward (impl fused_smsF_B; 0: a dispatch kernel of its own)")
    p.add_argument("--profile", action="store_true",
                   help="also write each impl's (with --ep --loopback: each variant's) per-kernel CUDA times of "
                        "forward+backward (torch.profiler) next to the JSON; CUDA-graph impls share their eager "
                        "twin's table. With --ep on real ranks: each fused impl's forward and the overlap figure's "
                        "two halves (compute only, comm only), one file per rank")
    p.add_argument("--seed", type=int, default=0, help="seed of the problem's inputs and routing")
    p.add_argument("--rep-ms", type=positive_int, default=500, help="do_bench repetition budget per measurement (ms)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="the layer benchmark's timed rounds: with N > 1 every impl is set up first, then timed once "
                        "in each of N rounds, the impls taking turns, and each time is the median of its N medians "
                        "(all kept in the JSON), so that the GPU's clock drifting over the run meets every impl "
                        "alike; costs N times the timing and holds every impl's weights at once")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="folder for the JSON and PNG (benchmarks/results holds the committed ones)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (the expert-parallel benchmark writes none)")
    args = p.parse_args(argv)  # argparse applies ``type`` to string defaults too
    defaults = vars(p.parse_args([]))
    args.explicit = {name for name, value in vars(args).items() if value != defaults[name]}  # what the caller set
    if args.ep and args.rounds != 1:
        p.error("--rounds is the layer benchmark's (with --ep, --ep-iters sets the timed iterations)")
    layer_only = sorted(args.explicit & {"rep_ms", "sonicmoe_autotune"})
    if layer_only and args.ep:
        p.error(f"{', '.join('--' + name.replace('_', '-') for name in layer_only)}: the layer benchmark's options "
                "(the expert-parallel benchmark times with --ep-iters and runs no SonicMoE)")
    real_ranks_only = sorted(args.explicit & {"impls", "ep_iters", "comm_sms_split"})
    if real_ranks_only and args.ep and args.loopback:
        p.error(f"{', '.join('--' + name.replace('_', '-') for name in real_ranks_only)}: options of the "
                "expert-parallel benchmark on torchrun's ranks, not of --loopback (which times its fixed variants "
                "with do_bench)")
    ep_only = sorted(args.explicit & {"ep_iters", "loopback", "comm_sms", "comm_sms_split"})
    if ep_only and not args.ep:
        p.error(f"{', '.join('--' + name.replace('_', '-') for name in ep_only)}: the expert-parallel benchmark's "
                f"options (add --ep)")
    if args.impls is not None:
        allowed = ep.EP_IMPLS if args.ep else layer.IMPLS
        names = [name.strip() for name in args.impls.split(",") if name.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            p.error(f"--impls: {unknown} not among the {'expert-parallel' if args.ep else 'layer'} benchmark's "
                    f"{list(allowed)}")
    if not args.ep and not args.no_plot and importlib.util.find_spec("matplotlib") is None and \
            torch.cuda.is_available():
        p.error("the PNG needs matplotlib: pip install -e '.[bench]', or pass --no-plot")
    return args


def _split_of_senders(pair: str) -> tuple[int, int]:
    """argparse type of ``--comm-sms-split``'s items: "F:B", the sending programs of the forward and the backward."""
    parts = pair.split(":")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{pair!r} is not F:B")
    return non_negative_int(parts[0]), non_negative_int(parts[1])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.ep:
        ep.main(args)
    else:
        layer.main(args)
