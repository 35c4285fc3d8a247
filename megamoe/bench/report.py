"""Markdown tables and PNG plots from committed benchmark JSON files.

``python -m megamoe.bench.report [benchmarks/results]`` prints one table row per (problem, impl) of the
layer benchmark, then one row per loopback run of the EP benchmark (``--ep --loopback R``), and
(re)draws each JSON file's PNG next to it. Every number comes from the JSON files; nothing is typed in.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megamoe.bench.layer import PLOT_KEYS, plot


def load(folder: Path, pattern: str = "*-ep*.json") -> list[dict]:
    runs = []
    for path in sorted(folder.glob(pattern)):
        info = json.loads(path.read_text())
        info["_path"] = path
        runs.append(info)
    return runs


def table(runs: list[dict]) -> str:
    lines = ["| problem | impl | fwd ms | fwd+bwd ms | AC step ms | TFLOP/s | AC-step speed-up vs compiled |",
             "|---|---|---|---|---|---|---|"]
    for info in runs:
        problem = f"{info['preset']} T={info['tokens']} {info['routing']}"
        for r in info["results"]:
            sp = r.get("speedup_vs_grouped_mm_compiled", {}).get("ac_step_ms")
            lines.append(f"| {problem} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                         f"{r['ac_step_ms']:.2f} | {r['tflops']:.0f} | {'' if sp is None else f'{sp:.2f}x'} |")
    first = runs[0] if runs else {}
    lines.append("")
    lines.append(f"{first.get('gpu', '?')}, torch {first.get('torch', '?')}, triton {first.get('triton', '?')}, "
                 f"{first.get('date', '?')[:10]}; dense bf16 matmul {first.get('matmul_tflops', 0):.0f} TFLOP/s.")
    return "\n".join(lines)


def loopback_table(runs: list[dict]) -> str:
    """The EP machinery's cost: the fused protocol on R virtual ranks of one GPU against the plain layer."""
    lines = ["| problem | virtual ranks | fwd ms (plain) | fwd cost | fwd+bwd ms (plain) | fwd+bwd cost |",
             "|---|---|---|---|---|---|"]
    for info in runs:
        lines.append(f"| {info['preset']} T={info['tokens_per_rank']}/rank {info['routing']} | {info['loopback_ranks']} | "
                     f"{info['loopback_fwd_ms']:.3f} ({info['plain_fwd_ms']:.3f}) | {100 * info['machinery_cost_fwd']:+.1f}% | "
                     f"{info['loopback_fwd_bwd_ms']:.3f} ({info['plain_fwd_bwd_ms']:.3f}) | "
                     f"{100 * info['machinery_cost_fwd_bwd']:+.1f}% |")
    return "\n".join(lines)


def plot_loopback(info: dict, path: Path) -> None:
    ranks = info["loopback_ranks"]
    bars = {**info, "results": [
        {"impl": "plain layer", "fwd_ms": info["plain_fwd_ms"], "fwd_bwd_ms": info["plain_fwd_bwd_ms"]},
        {"impl": f"fused EP, loopback R={ranks}", "fwd_ms": info["loopback_fwd_ms"],
         "fwd_bwd_ms": info["loopback_fwd_bwd_ms"]}]}
    plot(bars, path, keys=PLOT_KEYS[:2],
         problem=f"{info['preset']} T={info['tokens_per_rank']}/rank x {ranks} {info['routing']} routing")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else "benchmarks/results")
    runs = load(folder)
    for info in runs:
        plot(info, info["_path"].with_suffix(".png"))
    print(table(runs))
    loopback = load(folder, "*-loopback*.json")
    for info in loopback:
        plot_loopback(info, info["_path"].with_suffix(".png"))
    if loopback:
        print()
        print(loopback_table(loopback))


if __name__ == "__main__":
    main()
