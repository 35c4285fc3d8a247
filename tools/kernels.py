"""Per-kernel times of the fused path (where the layer's time goes), optionally sweeping tile configs.

``python -m tools.kernels --preset qwen3-30b-a3b [--sweep]`` on a GPU. Each stage is timed alone
with ``do_bench`` (median) on the same inputs as the layer benchmark; TFLOP/s from the stage's FLOPs.
On an sm90 GPU the up kernel, dh', the act kernel and the weight gradients run their warp-specialized Gluon
kernels (``kernels.gluon_sm90``: one tile each, not autotuned, not swept; their records read ``WARP_SPECIALIZED``).
Without ``--sweep`` the kernels run as the layer runs them (autotuned unless ``MEGAMOE_AUTOTUNE=0``); the
config each GEMM ran with is printed and recorded.
With ``--sweep`` every config of a wider list is timed for each kernel (autotuning off) and the table
shows the best next to the default. Beside each GEMM, cuBLAS's rate on the same work as one batched matmul
(``dense_shapes``), measured in the same process. On sm90 the weight gradients also run with their blocks in the
orders the layer does not run them in (``ORDERS``: in expert order, by size, taken in turn), each checked to write
bitwise what its layer stage writes (one that differs fails the command once the JSON is written). dW13 runs both
ways the backward may order it (``BACKWARD_ORDER``: alone with dx's combine after it, the default, or with the
combine inside); the totals take the layer's. On sm90 dh' also runs alone and with x's copy alone (``PARTS``), from
dy's sorted rows without the other copies that its stage makes, checked to write bitwise the stage's dh'.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from megamoe import autograd
from megamoe.arguments import HelpFormatter, positive_int
from megamoe.bench.common import PRESETS, ROUTINGS, dense_matmul_tflops, make_problem
from megamoe.kernels import expert_bwd, expert_fwd
from megamoe.kernels.combine import combine
from megamoe.kernels.gluon_sm90 import (
    ACT_CONFIG,
    UP_CONFIG,
    WGRAD_BY_SIZE,
    WGRAD_CONFIG,
    WGRAD_TAKEN,
    WS_CONFIG,
    dh_ws,
    expert_wgrad_ws,
    ws_supported,
)
from megamoe.kernels.plan import BLOCK_M, build_plan
from megamoe.kernels.tuning import TunedKernel
from megamoe.provenance import utc_now, write_record


def grid_of(**axes):
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*axes.values())]


SWEEPS = {
    expert_fwd.UP: grid_of(BM=[64, 128], BN=[128], BK=[64], num_warps=[8], num_stages=[3, 4])
    + grid_of(BM=[128], BN=[64, 128], BK=[32, 128], num_warps=[8], num_stages=[3]),
    # (and BK 32 in 6 stages: the same ring bytes in finer stages, as gluon_sm90.WGRAD_TILE's)
    expert_fwd.DOWN: grid_of(BM=[64, 128], BN=[128, 256], BK=[64, 128], num_warps=[8], num_stages=[3],
                             PERSISTENT=[False, True])
    + grid_of(BM=[128], BN=[256], BK=[32], num_warps=[8], num_stages=[6], PERSISTENT=[False, True]),
    expert_bwd.DH: grid_of(BM=[64, 128], BN=[128, 256], BK=[64], num_warps=[8], num_stages=[3, 4],
                           PERSISTENT=[False, True]),
    expert_bwd.ACT_BWD: grid_of(BM=[64, 128], BN=[64, 128], BK=[64], num_warps=[8], num_stages=[3, 4])
    + grid_of(BM=[128], BN=[64, 128], BK=[32, 128], num_warps=[8], num_stages=[3]),
    expert_bwd.DX: grid_of(BM=[64, 128], BN=[128, 256], BK=[64, 128], num_warps=[8], num_stages=[3, 4],
                           PERSISTENT=[False, True])
    + grid_of(BM=[128], BN=[256], BK=[32], num_warps=[8], num_stages=[6, 8], PERSISTENT=[False, True]),
    expert_bwd.WGRAD: grid_of(BM=[128], BN=[128, 256], BK=[64, 128], num_warps=[8], num_stages=[3, 4])
    + grid_of(BM=[64], BN=[128, 256], BK=[64, 128], num_warps=[4, 8], num_stages=[3]),
}


# The stages that only one memory mode runs (``save_for_backward``), left out of the other mode's total.
ONE_MODE = {"none": ("fwd up+swiglu", "bwd recompute+act"),
            "preact": ("fwd up+swiglu, products stored", "bwd act on the products")}

# The stages of one backward order (``autograd.LOW_PEAK_BACKWARD``): low peak (the default), dW13 alone and dx's slot
# rows combined on their own; else dx's slot rows combined inside the dW13 kernel. Each total leaves out the other's.
BACKWARD_ORDER = {True: ("bwd dw13", "bwd dx combine"), False: ("bwd dw13, combine",)}

# The weight gradients' blocks in each order the kernels have (``gluon_sm90.WGRAD_BY_SIZE``, ``WGRAD_TAKEN``): the
# suffix of a row's name, and the launcher's arguments. The rows of the orders the layer does not run are variants of
# its stages, left out of the total, each checked to write bitwise what its stage writes.
ORDERS = {"expert": (" (blocks in expert order)", {"by_size": False, "taken": False}),
          "size": (" (blocks by size)", {"by_size": True, "taken": False}),
          "taken": (" (blocks taken in turn)", {"taken": True})}
VARIANTS = tuple(suffix for suffix, _ in ORDERS.values())
# Parts of a stage timed alone on sm90: the suffix of a row's name, and the index of the stage's output that the part
# writes (checked bitwise). Left out of the totals, as the variants.
# dh' from dy's sorted rows: without dy's sorted copy and x's (the stage's others); with x's copy beside it (the
# stage's kernel, without dy's copy ahead of it)
PARTS = {" (the GEMM alone)": 2, " (the kernel with x's copy)": 2}


def layer_order(gemm: str) -> str:
    """The key of ``ORDERS`` that the layer's bf16 weight gradient ``gemm`` ("dw13" or "dw2") runs in."""
    return "taken" if gemm in WGRAD_TAKEN else "size" if WGRAD_BY_SIZE else "expert"


def same_outputs(a, b) -> bool:
    """Whether two outputs (a tensor or a tuple of them) are bitwise equal, dtypes included."""
    a, b = (t if isinstance(t, tuple) else (t,) for t in (a, b))
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                    for x, y in zip(a, b))


def dense_shapes(n_rows: int, num_experts: int, dim: int, inter: int) -> dict[str, tuple[int, int, int, int]]:
    """Each GEMM stage's equal-work dense ceiling, (batch, m, n, k) for ``bench.common.dense_matmul_tflops``: the
    experts' GEMMs as one batched cuBLAS matmul with the rows shared evenly (n_rows / E each), the weight gradients'
    K the rows. A stage with its blocks in another order (``VARIANTS``) shares its layer stage's."""
    m = max(1, round(n_rows / num_experts))
    shapes = {"fwd up+swiglu": (m, 2 * inter, dim), "fwd up+swiglu, products stored": (m, 2 * inter, dim),
              "fwd down": (m, dim, inter), "bwd gather, dh'": (m, inter, dim), "bwd recompute+act": (m, 2 * inter, dim),
              "bwd dx": (m, dim, 2 * inter), "bwd dw13": (2 * inter, dim, m), "bwd dw13, combine": (2 * inter, dim, m),
              "bwd dw2": (dim, inter, m)}
    return {name: (num_experts, *shape) for name, shape in shapes.items()}


def stages(problem, num_experts):
    """name → (callable, FLOPs, the GEMM's TunedKernel — or, for one that runs a ``kernels.ws`` kernel, a record
    of that kernel's fixed config — or None): the layer's stages in both memory modes (``ONE_MODE``) and, on sm90,
    the weight gradients with their blocks in the other orders (``ORDERS``), which return what their stages return.
    Both backward orders' stages (``BACKWARD_ORDER``)."""
    x, topk_idx, topk_weights, w13, w2, dy = problem
    top_k = topk_idx.shape[1]
    n_rows = int((topk_idx >= 0).sum())
    dim, inter = x.shape[1], w2.shape[2]
    unit = n_rows * dim * inter
    plan = build_plan(topk_idx, num_experts)
    h = expert_fwd.up_swiglu_fwd(x, w13, plan, top_k)
    slots = expert_fwd.down_fwd(h, w2, topk_weights, plan)
    preact = torch.empty(plan.row_slot_N.numel(), 2 * inter, device=x.device, dtype=x.dtype)  # the saved mode's
    expert_fwd.up_swiglu_fwd(x, w13, plan, top_k, preact_NH=preact)
    x_sorted, dy_sorted, dh = expert_bwd.sorted_rows_and_dh(x, dy, w2, plan, top_k)
    dz, hw, _ = expert_bwd.act_bwd(x_sorted, dh, w13, topk_weights, plan, top_k)
    dx = expert_bwd.dx_slots(dz, w13, plan)

    def tuned(kernel, gluon_config=WS_CONFIG):  # on sm90, a record of the kernels.ws kernel that runs instead
        return SimpleNamespace(last_config=gluon_config) if ws_supported(x) else kernel

    run_up = lambda: expert_fwd.up_swiglu_fwd(x, w13, plan, top_k)
    run_up_saved = lambda: expert_fwd.up_swiglu_fwd(x, w13, plan, top_k, preact_NH=preact)
    run_dh = lambda: expert_bwd.sorted_rows_and_dh(x, dy, w2, plan, top_k)
    run_act = lambda: expert_bwd.act_bwd(x_sorted, dh, w13, topk_weights, plan, top_k)
    run_dw13_alone = lambda: expert_bwd.expert_wgrad(dz, x_sorted, plan, w13.dtype, gemm="dw13")
    run_dw13 = lambda: expert_bwd.expert_wgrad_and_combine(dz, x_sorted, plan, w13.dtype, dx, topk_idx, x.dtype)
    run_dw2 = lambda: expert_bwd.expert_wgrad(dy_sorted, hw, plan, w2.dtype, gemm="dw2")
    stages = {
        "plan": (lambda: build_plan(topk_idx, num_experts), 0, None),
        "fwd up+swiglu": (run_up, 4 * unit, tuned(expert_fwd.UP, UP_CONFIG)),
        "fwd up+swiglu, products stored": (run_up_saved, 4 * unit, tuned(expert_fwd.UP, UP_CONFIG)),
        "fwd down": (lambda: expert_fwd.down_fwd(h, w2, topk_weights, plan), 2 * unit, expert_fwd.DOWN),
        "combine": (lambda: combine(slots, topk_idx, x.dtype), 0, None),
        # On sm90 the x copy runs inside the dh' kernel, and in the dx-first order (BACKWARD_ORDER) the dx combine
        # inside the dW13 kernel: timed with them.
        "bwd gather, dh'": (run_dh, 2 * unit, tuned(expert_bwd.DH)),
        "bwd recompute+act": (run_act, 4 * unit, tuned(expert_bwd.ACT_BWD, ACT_CONFIG)),
        # the saved mode's act step, on the forward's products (preact, written by the up kernel above)
        "bwd act on the products": (lambda: expert_bwd.act_bwd_from_preact(preact, dh, topk_weights, plan, top_k), 0,
                                    None),
        "bwd dx": (lambda: expert_bwd.dx_slots(dz, w13, plan), 4 * unit, expert_bwd.DX),
        "bwd dw13": (run_dw13_alone, 4 * unit, tuned(expert_bwd.WGRAD, WGRAD_CONFIG)),
        "bwd dx combine": (lambda: combine(dx, topk_idx, x.dtype), 0, None),
        "bwd dw13, combine": (run_dw13, 4 * unit, tuned(expert_bwd.WGRAD, WGRAD_CONFIG)),
        "bwd dw2": (run_dw2, 2 * unit, tuned(expert_bwd.WGRAD, WGRAD_CONFIG)),
    }
    if ws_supported(x):  # the variants and parts of the Gluon kernels' stages: first dh' without the copies beside it
        # or with x's alone
        dh_alone = torch.empty_like(dh)

        def run_dh_alone():
            dh_ws(dy_sorted, w2, dh_alone, plan, BLOCK_M)
            return dh_alone

        stages["bwd gather, dh' (the GEMM alone)"] = (run_dh_alone, 2 * unit, tuned(expert_bwd.DH))
        dh_with_x, x_copy, slot_row = torch.empty_like(dh), torch.empty_like(x_sorted), expert_bwd.slot_rows(plan)

        def run_dh_with_x():
            dh_ws(dy_sorted, w2, dh_with_x, plan, BLOCK_M, copy_x=(x, x_copy, slot_row, top_k))
            return dh_with_x

        stages["bwd gather, dh' (the kernel with x's copy)"] = (run_dh_with_x, 2 * unit, tuned(expert_bwd.DH))
        # the Gluon weight gradients with their blocks in the orders the layer does not run
        dw13, dw13_alone, dw2 = torch.empty_like(w13), torch.empty_like(w13), torch.empty_like(w2)
        combined = torch.empty_like(x)
        config = SimpleNamespace(last_config=WGRAD_CONFIG)
        for name, (suffix, order) in ORDERS.items():
            def run_dw13_alone_other(order=order):
                expert_wgrad_ws(dz, x_sorted, plan.offsets_E1, dw13_alone, **order)
                return dw13_alone

            def run_dw13_other(order=order):  # what run_dw13 returns: the gradient and the combined dx
                expert_wgrad_ws(dz, x_sorted, plan.offsets_E1, dw13, (dx, topk_idx, combined), **order)
                return dw13, combined

            def run_dw2_other(order=order):
                expert_wgrad_ws(dy_sorted, hw, plan.offsets_E1, dw2, **order)
                return dw2

            if name != layer_order("dw13"):
                stages["bwd dw13" + suffix] = (run_dw13_alone_other, 4 * unit, config)
                stages["bwd dw13, combine" + suffix] = (run_dw13_other, 4 * unit, config)
            if name != layer_order("dw2"):
                stages["bwd dw2" + suffix] = (run_dw2_other, 2 * unit, config)
    return stages


def layer_totals(rows: list[dict], low_peak: bool) -> dict[str, float]:
    """Per memory mode (``ONE_MODE``) the sum of the timed ``rows``' ms that the layer runs in that mode and in the
    backward order ``low_peak`` (``BACKWARD_ORDER``): the variants and the parts (``VARIANTS``' and ``PARTS``'
    suffixes) left out."""
    other_order = BACKWARD_ORDER[not low_peak]
    return {mode: sum(r["ms"] for r in rows if not r["stage"].endswith(VARIANTS + tuple(PARTS))
                      and r["stage"] not in other_order
                      and all(r["stage"] not in names for other, names in ONE_MODE.items() if other != mode))
            for mode in ONE_MODE}


def main(argv=None) -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(prog="python -m tools.kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b", help="the layer's D, I, E and K")
    p.add_argument("--tokens", type=positive_int, default=16384, help="tokens per step (T)")
    p.add_argument("--routing", choices=ROUTINGS, default="random", help="how the tokens pick their experts")
    p.add_argument("--top-k", type=positive_int, help="slots per token (default: the preset's K)")
    p.add_argument("--sweep", action="store_true", help="time every candidate config of each kernel")
    p.add_argument("--json", help="write the table as JSON to this path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA GPU")
    if args.sweep:
        os.environ["MEGAMOE_AUTOTUNE"] = "0"  # time each kernel's default config, which the sweep sets
    dim, inter, num_experts, top_k = PRESETS[args.preset]
    top_k = args.top_k or top_k
    problem = make_problem(args.tokens, dim, inter, num_experts, top_k, args.routing, torch.bfloat16, "cuda", 0)
    rows = []
    table = stages(problem, num_experts)
    shapes = dense_shapes(int((problem[1] >= 0).sum()), num_experts, dim, inter)
    ceilings = {}
    for name, (fn, flops, key) in table.items():
        started = utc_now()  # the timing window, to read against gpu-check's clocks.csv
        ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
        row = {"stage": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
               "config": None if key is None else key.last_config,  # autotuned or default
               "timed_utc": [started, utc_now()]}
        if args.sweep and isinstance(key, TunedKernel):
            default = key.default
            best = (ms, default)
            for cfg in SWEEPS[key]:
                key.default = cfg
                try:
                    t = do_bench(fn, warmup=25, rep=150, return_mode="median")
                except (OutOfResources, CompilationError) as exc:  # does not fit: not a candidate
                    print(f"    {name} {cfg}: {type(exc).__name__}")
                    continue
                best = min(best, (t, cfg), key=lambda b: b[0])
            key.default = default
            row.update(best_ms=best[0], best_config=best[1], best_tflops=flops / best[0] / 1e9)
        layer = name[:name.rindex(" (")] if name.endswith(VARIANTS + tuple(PARTS)) else name  # without the suffix
        part = PARTS.get(name[len(layer):])
        if part is not None:
            row.update(bitwise_as=f"{layer}, output {part}", bitwise_equal=same_outputs(fn(), table[layer][0]()[part]))
        elif name != layer:
            row.update(bitwise_as=layer, bitwise_equal=same_outputs(fn(), table[layer][0]()))
        if layer in shapes:
            if shapes[layer] not in ceilings:
                ceilings[shapes[layer]] = dense_matmul_tflops("cuda", *shapes[layer][1:], batch=shapes[layer][0])
            row["dense_bf16_tflops"] = ceilings[shapes[layer]]
        rows.append(row)
        extra = f"   best {row['best_ms']:.3f} ms {row['best_config']}" if "best_ms" in row else ""
        tf = f"{row['tflops']:6.0f}" if row["tflops"] else "     -"
        if "dense_bf16_tflops" in row:
            tf += f" (cuBLAS {row['dense_bf16_tflops']:4.0f})"
        cfg = row["config"]
        ran = "" if cfg is None else (f"   {cfg['BM']}x{cfg['BN']}x{cfg['BK']} warps {cfg['num_warps']} "
                                      f"stages {cfg['num_stages']}" + (" persistent" if cfg.get("PERSISTENT") else "")
                                      + (" warp-specialized" if cfg.get("WARP_SPECIALIZED") else ""))
        same = {True: "   bitwise as the layer's", False: "   NOT bitwise as the layer's"}.get(row.get("bitwise_equal"),
                                                                                           "")
        print(f"{name:20s} {ms:8.3f} ms {tf} TFLOP/s{ran}{extra}{same}", flush=True)
    totals = layer_totals(rows, autograd.LOW_PEAK_BACKWARD)
    order = "low-peak" if autograd.LOW_PEAK_BACKWARD else "dx-first"
    for mode, ms in totals.items():
        print(f"{'total':20s} {ms:8.3f} ms (the layer's stages, save_for_backward={mode!r}, {order} backward)")
    if args.json:
        path = Path(args.json)
        command = "python -m tools.kernels " + " ".join(sys.argv[1:] if argv is None else argv)
        write_record(path.parent, path.name, command, preset=args.preset, tokens=args.tokens, top_k=top_k,
                     routing=args.routing, low_peak_backward=autograd.LOW_PEAK_BACKWARD, total_ms=totals, stages=rows)
    differ = [r["stage"] for r in rows if r.get("bitwise_equal") is False]
    if differ:
        raise SystemExit(f"these variants do not write bitwise what the layer's stage writes: {differ}")


if __name__ == "__main__":
    main()
