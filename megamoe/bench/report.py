"""Markdown tables and PNG plots from committed benchmark JSON files.

``python -m megamoe.bench.report [benchmarks/results] [--readme README.md]`` prints one table row per
(problem, impl) of the layer benchmark, one per loopback run of the EP benchmark (``--ep --loopback R``)
and one per (problem, impl) of the multi-GPU EP benchmark (``torchrun ... --ep``), and (re)draws each
JSON file's PNG next to it. ``--readme`` also writes the tables into that file in place of the ones with
the same header (and the layer table's footer line). Every number comes from the JSON files; nothing is
typed in.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megamoe.bench.layer import PLOT_KEYS, plot


def load(folder: Path) -> dict[str, list[dict]]:
    """The result files of ``folder`` by kind: "layer", "loopback", "ep" (per-kernel files are skipped)."""
    runs = {"layer": [], "loopback": [], "ep": []}
    for path in sorted(folder.glob("*.json")):
        info = json.loads(path.read_text())
        info["_path"] = path
        if "loopback_ranks" in info:
            runs["loopback"].append(info)
        elif "tokens_per_rank" in info:
            runs["ep"].append(info)
        elif "results" in info:
            runs["layer"].append(info)
    return runs


def table(runs: list[dict]) -> str:
    lines = ["| problem | impl | fwd ms | fwd+bwd ms | AC step ms | TFLOP/s | of dense | AC-step speed-up vs compiled |",
             "|---|---|---|---|---|---|---|---|"]
    for info in runs:
        problem = f"{info['preset']} T={info['tokens']} {info['routing']}"
        for r in info["results"]:
            sp = r.get("speedup_vs_grouped_mm_compiled", {}).get("ac_step_ms")
            lines.append(f"| {problem} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                         f"{r['ac_step_ms']:.2f} | {r['tflops']:.0f} | {r['tflops'] / info['matmul_tflops']:.0%} | "
                         f"{'' if sp is None else f'{sp:.2f}x'} |")
    first = runs[0] if runs else {}
    ceilings = [info["matmul_tflops"] for info in runs] or [0]
    dates = sorted(info.get("date", "?")[:10] for info in runs) or ["?"]
    lines.append("")
    lines.append(f"{first.get('gpu', '?')}, torch {first.get('torch', '?')}, triton {first.get('triton', '?')}, "
                 f"{dates[0]}{'' if dates[0] == dates[-1] else ' to ' + dates[-1]}; \"of dense\" is against the "
                 f"dense bf16 matmul measured in the same run ({min(ceilings):.0f}-{max(ceilings):.0f} TFLOP/s).")
    return "\n".join(lines)


def loopback_table(runs: list[dict]) -> str:
    """The EP machinery's cost: the fused protocol on R virtual ranks of one GPU against the plain layer,
    with the rows sent by a kernel of their own and (``comm_sms=N``) from N programs of the expert kernels."""
    lines = ["| problem | virtual ranks | fwd ms (plain) | fwd cost | fwd+bwd ms (plain) | fwd+bwd cost |",
             "|---|---|---|---|---|---|"]
    for info in runs:
        sms = sorted(int(k.removeprefix("loopback_fwd_ms_sms")) for k in info if k.startswith("loopback_fwd_ms_sms"))
        for n, suffix in [(0, ""), *((n, f"_sms{n}") for n in sms)]:
            ranks = f"{info['loopback_ranks']}" + (f", comm_sms={n}" if n else "")
            lines.append(f"| {info['preset']} T={info['tokens_per_rank']}/rank {info['routing']} | {ranks} | "
                         f"{info['loopback_fwd_ms' + suffix]:.3f} ({info['plain_fwd_ms']:.3f}) | "
                         f"{100 * info['machinery_cost_fwd' + suffix]:+.1f}% | "
                         f"{info['loopback_fwd_bwd_ms' + suffix]:.3f} ({info['plain_fwd_bwd_ms']:.3f}) | "
                         f"{100 * info['machinery_cost_fwd_bwd' + suffix]:+.1f}% |")
    return "\n".join(lines)


def ep_table(runs: list[dict]) -> str:
    """Expert parallelism over real ranks: each impl's times (maximum over ranks), its AC-step speed-up
    over the all-to-all baselines and (fused impls) its overlap figure; then the run's exchange, compute-only
    and communication-only times."""
    lines = ["| problem | impl | fwd ms | fwd+bwd ms | AC step ms | vs a2a eager | vs a2a compiled | overlap |",
             "|---|---|---|---|---|---|---|---|"]
    for info in runs:
        problem = f"{info['preset']} T={info['tokens_per_rank']}/rank {info['routing']} EP={info['ep']}"
        base = {r["impl"]: r["ac_step_ms"] for r in info["results"]}
        for r in info["results"]:
            sp = [f"{base[b] / r['ac_step_ms']:.2f}x" if b in base else ""
                  for b in ("a2a_grouped_mm", "a2a_grouped_mm_compiled")]
            overlap = f"{r['overlap_fwd']:.2f}" if "overlap_fwd" in r else ""
            lines.append(f"| {problem} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                         f"{r['ac_step_ms']:.2f} | {sp[0]} | {sp[1]} | {overlap} |")
        extra = f"; fused protocol rows out and back {info['comm_only_fwd_ms']:.2f} ms" if "comm_only_fwd_ms" in info else ""
        lines.append(f"| {problem} | (exchange {info['exchange_fwd_ms']:.2f} ms, "
                     f"{info['exchange_gb_per_s_rank0']:.0f} GB/s; compute only fwd {info['compute_only_fwd_ms']:.2f}, "
                     f"fwd+bwd {info['compute_only_fwd_bwd_ms']:.2f} ms{extra}) | | | | | | |")
    return "\n".join(lines)


def plot_loopback(info: dict, path: Path) -> None:
    ranks = info["loopback_ranks"]
    bars = {**info, "results": [
        {"impl": "plain layer", "fwd_ms": info["plain_fwd_ms"], "fwd_bwd_ms": info["plain_fwd_bwd_ms"]},
        {"impl": f"fused EP, loopback R={ranks}", "fwd_ms": info["loopback_fwd_ms"],
         "fwd_bwd_ms": info["loopback_fwd_bwd_ms"]}]}
    plot(bars, path, keys=PLOT_KEYS[:2],
         problem=f"{info['preset']} T={info['tokens_per_rank']}/rank x {ranks} {info['routing']} routing")


def update_readme(text: str, tables: list[str]) -> str:
    """``text`` with each of its tables (a run of lines starting with "|" whose header line is the first
    line of one of ``tables``) replaced by that table's rows. A table's lines after its rows (the layer
    table's footer, after a blank line) replace the first non-empty line after the old rows."""
    by_header = {t.splitlines()[0]: t.splitlines() for t in tables}
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        new = by_header.get(lines[i])
        if new is None:
            out.append(lines[i])
            i += 1
            continue
        rows = [line for line in new if line.startswith("|")]
        footer = [line for line in new[len(rows):] if line]
        out += rows
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        if footer:
            while i < len(lines) and not lines[i]:
                out.append(lines[i])
                i += 1
            out += footer
            i += 1
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megamoe.bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", default="benchmarks/results", help="the benchmark JSON files")
    p.add_argument("--readme", type=Path, help="also write the tables into this Markdown file")
    args = p.parse_args(argv)
    runs = load(Path(args.folder))
    for info in runs["layer"]:
        plot(info, info["_path"].with_suffix(".png"))
    for info in runs["loopback"]:
        plot_loopback(info, info["_path"].with_suffix(".png"))
    for info in runs["ep"]:
        plot(info, info["_path"].with_suffix(".png"),
             problem=f"{info['preset']} T={info['tokens_per_rank']}/rank {info['routing']} routing, EP={info['ep']}")
    tables = [table(runs["layer"])]
    print(tables[0])
    for title, kind, make in (("EP machinery, loopback", "loopback", loopback_table), ("EP, real ranks", "ep", ep_table)):
        if runs[kind]:
            tables.append(make(runs[kind]))
            print(f"\n{title}:\n")
            print(tables[-1])
    if args.readme:
        args.readme.write_text(update_readme(args.readme.read_text(), tables))


if __name__ == "__main__":
    main()
