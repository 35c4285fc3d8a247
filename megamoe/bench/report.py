"""The results pages and plots, from the committed benchmark JSON files (every number comes from them; nothing
is typed in):

    python -m megamoe.bench.report [benchmarks/results] [--readme README.md] [--page benchmarks/README.md]
                                   [--no-plots]

prints the README's summary tables — one GPU (the training step of each impl per problem), megamoe beside
SonicMoE (both memory modes, with the bytes each keeps), megamoe's blockwise FP8 beside its bf16 modes and the FP8
baseline, expert parallelism on real ranks, and the training runs
(``train/``) — and (re)draws each JSON file's PNG next to it and the one-GPU summary plot
(``summary.png``). ``--readme`` writes the tables into that file between its ``<!-- report:... -->`` markers;
``--page`` writes the full results page: every row of every result, the EP machinery on virtual ranks, and each
result's provenance (GPU, versions, date, commit or source digest, command). ``--no-plots``: the tables only, the PNGs
left as they are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megamoe.bench.layer import PLOT_KEYS, X_SCALES_IMPLS, plot
from megamoe.env import FP8_WGRAD_X_SCALES_NAMES
from megamoe.parallel.fused import DEFAULT_COMM_SMS

# Impls of the README's one-GPU table, in column order, with their column names.
SUMMARY_IMPLS = {"grouped_mm": "grouped_mm", "grouped_mm_compiled": "grouped_mm compiled", "liger": "Liger",
                 "sonicmoe": "SonicMoE", "megamoe": "megamoe", "megamoe_saved": "megamoe saved"}
# ... and of its EP table: the all-to-all baselines and the fused protocol with its default senders.
EP_SUMMARY_IMPLS = {"a2a_grouped_mm": "all-to-all + grouped_mm", "a2a_grouped_mm_compiled": "... compiled",
                    f"fused_sms{DEFAULT_COMM_SMS}": "megamoe fused EP"}


def load(folder: Path) -> dict[str, list[dict]]:
    """The result files of ``folder`` by kind: "layer", "loopback", "ep" (per-kernel files and the block traces of
    ``tools.fp8_trace``, whose results are GEMMs, not impls, are skipped)."""
    runs = {"layer": [], "loopback": [], "ep": []}
    for path in sorted(folder.glob("*.json")):
        info = json.loads(path.read_text())
        info["_path"] = path
        if "loopback_ranks" in info:
            runs["loopback"].append(info)
        elif "tokens_per_rank" in info:
            runs["ep"].append(info)
        elif "results" in info and "routing" in info and all("impl" in r for r in info["results"]):
            runs["layer"].append(info)
    return runs


def table(runs: list[dict]) -> str:
    lines = [("| problem | impl | fwd ms | fwd+bwd ms | AC step ms | TFLOP/s | of dense | kept MiB | "
              "AC-step speed-up vs compiled |"), "|---|---|---|---|---|---|---|---|---|"]
    for info in runs:
        option = _x_scales_option(info.get("megamoe_fp8_wgrad_x_scales"), "x's FP8 dW13 scales")
        problem = f"{info['preset']} T={info['tokens']} {info['routing']} ({_gpu(info)}{option})"
        for r in info["results"]:
            sp = r.get("speedup_vs_grouped_mm_compiled", {}).get("ac_step_ms")
            lines.append(f"| {problem} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                         f"{r['ac_step_ms']:.2f} | {r['tflops']:.0f} | {r['tflops'] / info['matmul_tflops']:.0%} | "
                         f"{r['saved_activation_bytes'] / 2**20:.0f} | {'' if sp is None else f'{sp:.2f}x'} |")
    ceilings = [info["matmul_tflops"] for info in runs] or [0]
    lines.append("")
    lines.append(f"{_versions(runs)}; \"of dense\" is against the dense bf16 matmul measured in the same run "
                 f"({min(ceilings):.0f}-{max(ceilings):.0f} TFLOP/s).")
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


def _versions(runs: list[dict]) -> str:
    """GPUs (each that ran one of ``runs``), versions and dates of ``runs``, as one line."""
    first = runs[0] if runs else {}
    gpus = " and ".join(dict.fromkeys(info.get("gpu", "?") for info in runs)) or "?"
    dates = sorted(info.get("date", "?")[:10] for info in runs) or ["?"]
    versions = ", ".join(f"{lib} {first[lib]}" for lib in ("torch", "triton") if lib in first)
    return f"{gpus}, {versions}, {dates[0]}{'' if dates[0] == dates[-1] else ' to ' + dates[-1]}"


def _gpu(info: dict) -> str:
    """A run's GPU, short: "H200" for "NVIDIA H200", "H100" for "NVIDIA H100 80GB HBM3"."""
    return (info.get("gpu") or "?").removeprefix("NVIDIA ").split()[0]


def _present(impls: dict[str, str], runs: list[dict]) -> dict[str, str]:
    """The impls of ``impls`` (name → column) that some run measured, in order."""
    measured = {r["impl"] for info in runs for r in info["results"]}
    return {name: column for name, column in impls.items() if name in measured}


def summary_table(runs: list[dict]) -> str:
    """One GPU: per problem, each impl's training step (AC step ms: forward + forward-and-backward for an impl
    that keeps activations, forward+backward for megamoe, which keeps none) and megamoe's speed-up over the
    compiled baseline. Only the runs that measured a grouped_mm baseline (not, say, the FP8 runs)."""
    runs = _newest_first([info for info in runs
                          if {r["impl"] for r in info["results"]} & {"grouped_mm", "grouped_mm_compiled"}])
    columns = _present(SUMMARY_IMPLS, runs)
    lines = ["| layer, tokens, routing | " + " | ".join(columns.values()) + " | megamoe vs compiled |",
             "|---|" + "---|" * (len(columns) + 1)]
    for info in runs:
        step = {r["impl"]: r["ac_step_ms"] for r in info["results"]}
        cells = [f"{step[name]:.2f}" if name in step else "" for name in columns]
        speedup = (f"**{step['grouped_mm_compiled'] / step['megamoe']:.2f}x**"
                   if {"megamoe", "grouped_mm_compiled"} <= step.keys() else "")
        lines.append(f"| {_problem(info)} | " + " | ".join(cells) + f" | {speedup} |")
    lines += ["", (f"Training-step ms (AC step), {_versions(runs)}; all impls in the same process per run; each "
                   "problem's newest run first.")]
    return "\n".join(lines)


SONIC_IMPLS = ("sonicmoe", "megamoe", "megamoe_saved", "megamoe_fp8", "megamoe_fp8_saved")


def _newest_first(runs: list[dict]) -> list[dict]:
    """``runs`` grouped by problem (preset, tokens, routing), each problem's newest run first: the current numbers
    lead, the older runs below them are the history (docs/PERFORMANCE.md says what changed between them)."""
    by_date = sorted(runs, key=lambda info: info.get("date", ""), reverse=True)
    return sorted(by_date, key=lambda info: (info["preset"], info["tokens"], info["routing"]))


def _x_scales_option(value: str | None, what: str) -> str:
    """``", {what} over the layer"`` or ``", {what} per expert"`` for a run with that option of the FP8 recipe
    (``MEGAMOE_FP8_WGRAD_X_SCALES``, ``value``), else empty."""
    name = FP8_WGRAD_X_SCALES_NAMES.get(value)
    return f", {what} {name}" if name else ""


def _recipes(info: dict) -> bool:
    """Whether a run ran the FP8 recipe as it stands by default (not an option of it such as x's weight-gradient
    scales over the layer, ``MEGAMOE_FP8_WGRAD_X_SCALES``): only those stand for the layer in the README."""
    return info.get("megamoe_fp8_wgrad_x_scales", "tile") == "tile"


def _newest_per_problem(runs: list[dict], also=None) -> list[dict]:
    """Each problem's newest run on each GPU (a newer run on another GPU does not hide the last one on this) and,
    where ``also(run)`` holds for an older run but not the newest, the newest such run too (a baseline the newest run
    did not measure), in ``_newest_first``'s order, of the runs of the default recipe (``_recipes``): the README's
    tables; the history is on the results page and in docs/PERFORMANCE.md."""
    kept, seen = [], set()
    for info in _newest_first([info for info in runs if _recipes(info)]):
        problem = (info["preset"], info["tokens"], info["routing"], _gpu(info))
        first = problem not in seen
        if first or (also is not None and also(info) and (problem, "also") not in seen):
            kept.append(info)
            seen.add(problem)
            if also is not None and also(info):
                seen.add((problem, "also"))
    return kept


def _committed(info: dict) -> bool:
    """Whether a run ran a commit as committed (else its record names its source digest)."""
    commit = info.get("commit") or ""
    return bool(commit) and not commit.endswith("-dirty")


def _code(info: dict) -> str:
    """The code a run ran, short: its commit, or "digest" and its source digest's first digits."""
    return info["commit"][:7] if _committed(info) else f"digest {info.get('source_sha256', '?')[:7]}"


def _problem(info: dict) -> str:
    """A run's problem and on what GPU, when and on what code it ran: "30b T=16384 random (H200, 2026-12-03,
    bddbc03)"."""
    return (f"{info['preset']} T={info['tokens']} {info['routing']} ({_gpu(info)}, {info.get('date', '?')[:10]}, "
            f"{_code(info)})")


def sonicmoe_table(runs: list[dict]) -> str:
    """One GPU, the runs that measured SonicMoE: its forward, forward+backward and AC step beside megamoe's two
    memory modes (and their FP8 twins where the run measured them), its peak memory over the inputs during
    forward+backward (where the run recorded it), what each keeps between forward and backward, and megamoe's speed-ups over SonicMoE."""
    lines = [("| layer, tokens, routing | impl | fwd ms | fwd+bwd ms | AC step ms | kept MiB | peak MiB | "
              "fwd+bwd vs SonicMoE | AC step vs SonicMoE |"), "|---|---|---|---|---|---|---|---|---|"]
    measured = _newest_per_problem([info for info in runs if any(r["impl"] == "sonicmoe" for r in info["results"])])
    for info in measured:
        by_impl = {r["impl"]: r for r in info["results"]}
        sonic = by_impl["sonicmoe"]
        for name in SONIC_IMPLS:
            if name not in by_impl:
                continue
            r = by_impl[name]
            vs = ("", "") if name == "sonicmoe" else (f"{sonic['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x",
                                                     f"**{sonic['ac_step_ms'] / r['ac_step_ms']:.2f}x**")
            peak = f"{r['peak_extra_bytes'] / 2**20:.0f}" if "peak_extra_bytes" in r else ""
            lines.append(f"| {_problem(info)} | {name} | {r['fwd_ms']:.2f} | "
                         f"{r['fwd_bwd_ms']:.2f} | {r['ac_step_ms']:.2f} | {r['saved_activation_bytes'] / 2**20:.0f} | "
                         f"{peak} | {vs[0]} | {vs[1]} |")
    gemms = sorted({info.get("sonicmoe_gemms", "?") for info in measured})
    lines += ["", (f"SonicMoE's GEMMs at: {', '.join(gemms)}; {_versions(measured)}; all impls in the same process "
                   "per run; each problem's newest run on each GPU (older ones: benchmarks/README.md).")]
    return "\n".join(lines)


# megamoe's blockwise FP8 beside its bf16 modes and the FP8 baseline (torchao's rowwise recipe on grouped_mm), and
# for each FP8 mode the bf16 one it replaces (the modes with an option of x's dW13 scales too, where a run has them:
# their mode's twin).
_MEGAMOE_MODES = {"megamoe": None, "megamoe_fp8": "megamoe", "megamoe_fp8_optstep": "megamoe", "megamoe_saved": None,
                  "megamoe_fp8_saved": "megamoe_saved"}
FP8_IMPLS = {**_MEGAMOE_MODES, **{name: _MEGAMOE_MODES[mode] for name, (mode, _) in X_SCALES_IMPLS.items()},
             "grouped_mm_fp8_compiled": None}


def fp8_table(runs: list[dict]) -> str:
    """One GPU, the runs that measured megamoe's FP8: each mode's forward, forward+backward and AC step beside its
    bf16 twin (speed-up of the forward+backward) and the AC step's speed-up over the compiled FP8 baseline."""
    lines = [("| layer, tokens, routing | impl | fwd ms | fwd+bwd ms | AC step ms | kept MiB | fwd+bwd vs bf16 | "
              "AC step vs grouped_mm FP8 compiled |"), "|---|---|---|---|---|---|---|---|"]
    measured = _newest_per_problem(
        [info for info in runs if any(r["impl"] == "megamoe_fp8" for r in info["results"])],
        also=lambda info: any(r["impl"] == "grouped_mm_fp8_compiled" for r in info["results"]))
    for info in measured:
        by_impl = {r["impl"]: r for r in info["results"]}
        base = by_impl.get("grouped_mm_fp8_compiled")
        for name, twin in FP8_IMPLS.items():
            if name not in by_impl:
                continue
            r = by_impl[name]
            vs_bf16 = f"**{by_impl[twin]['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x**" if twin in by_impl else ""
            vs_base = f"{base['ac_step_ms'] / r['ac_step_ms']:.2f}x" if base and name != "grouped_mm_fp8_compiled" else ""
            lines.append(f"| {_problem(info)} | {name} | {r['fwd_ms']:.2f} | "
                         f"{r['fwd_bwd_ms']:.2f} | {r['ac_step_ms']:.2f} | {r['saved_activation_bytes'] / 2**20:.0f} | "
                         f"{vs_bf16} | {vs_base} |")
    lines += ["", (f"{_versions(measured)}; all impls in the same process per run; each problem's newest run on each "
                   "GPU, and its newest with the FP8 baseline (older ones: benchmarks/README.md).")]
    return "\n".join(lines)


# an FP8 training run's weight-copy policy other than the default "step", as its row marks it
COPIES_MARKS = {"ahead": "copies made ahead", "call": "copies per call"}


def train_table(folder: Path) -> str:
    """``python -m megamoe.train`` runs (``folder``/train/*.json): per run its throughput, MFU, the experts' share of
    the step, the final eval loss and the code it ran; each run's GPU where they ran on more than one, and an FP8
    run's option of the recipe where it had one (x's dW13 scales over the layer or per expert)."""
    runs = [json.loads(path.read_text()) for path in sorted((folder / "train").glob("*.json"))]
    lines = [("| model | tokens per step | experts | seed | steps | tokens/s | step ms | MFU | MoE share | peak GiB | "
              "eval loss | code |"), "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def fp8(r):
        return r.get("expert_precision") == "fp8"

    def micro_batches(r):
        return r.get("micro_batches", 1)

    several_gpus = len({_gpu(r) for r in runs}) > 1

    for r in sorted(runs, key=lambda r: (r["preset"], micro_batches(r), -r["seq_len"], r["experts"] != "megamoe",
                                         fp8(r), r["seed"])):
        share = "" if r["moe_share"] is None else f"{r['moe_share']:.3f}"
        if share and r["moe_share"] <= 0:
            share = "failed"
        elif share and fp8(r) and "weight copies" not in r.get("moe_share_method", ""):
            share += " (copies reused)"
        option = _x_scales_option(r.get("fp8_wgrad_x_scales"), "x's dW13 scales")
        copies = COPIES_MARKS.get(r.get("fp8_weight_cache")) if fp8(r) else None
        marks = (([f"FP8{option}"] if fp8(r) else []) + ([copies] if copies else [])
                 + (["fused AdamW"] if "(fused)" in r.get("optimizer", "") else []))
        experts = f"{r['experts']} ({', '.join(marks)})" if marks else r["experts"]
        model = f"{r['preset']}, {r['layers']} layers" + (f" ({_gpu(r)})" if several_gpus else "")
        per_step = f"{r['seqs_per_step']} x {r['seq_len']}"
        if micro_batches(r) > 1:
            per_step = f"{micro_batches(r)} micro-batches of {per_step}"
        lines.append(f"| {model} | {per_step} | {experts} | "
                     f"{r['seed']} | {r['steps']} | {r['tokens_per_s']:,.0f} | {r['step_ms_median']:.1f} | "
                     f"{r['mfu']:.1%} | {share} | {r['peak_mem_bytes'] / 2**30:.1f} | {r['final_eval_loss']:.3f} | "
                     f"{_code(r)} |")
    lines += ["", (f"{_versions(runs)}; bf16 (the experts' GEMMs too, but where marked FP8: blockwise), every decoder "
                   "layer compiled and checkpointed; AdamW: torch's foreach implementation, but where marked fused "
                   "(`megamoe.train`'s default from 915bb1f); FP8 weight copies made at each layer's first use in "
                   "a step, but where marked made ahead (right after the optimizer step) or per call; tokens/s: the "
                   "median step after the first 10; MFU "
                   "against 989 TFLOP/s; MoE share: the experts' part of forward+backward, by ablation (of the whole "
                   "step, optimizer included: `moe_share_of_step` in runs that record it; \"copies reused\": an FP8 run's "
                   "ablation, before 3369c6e, that reused cached weight copies between its timed steps, leaving out "
                   "the quantisation that every training step makes; \"failed\": the ablation timed the model "
                   "without the experts slower than with them, its layers past dynamo's recompile limit run eagerly, "
                   "before bc58270); code: the commit, or the source digest of a tree with changes.")]
    return "\n".join(lines)


def ep_summary_table(runs: list[dict]) -> str:
    """Expert parallelism on real ranks: per problem, each impl's training step (AC step ms, the maximum over
    ranks) and the fused protocol's speed-up over the compiled all-to-all baseline."""
    lines = ["| layer, tokens per rank, routing, ranks | " + " | ".join(EP_SUMMARY_IMPLS.values())
             + " | fused vs compiled |", "|---|" + "---|" * (len(EP_SUMMARY_IMPLS) + 1)]
    fused = f"fused_sms{DEFAULT_COMM_SMS}"
    for info in runs:
        step = {r["impl"]: r["ac_step_ms"] for r in info["results"]}
        cells = [f"{step[name]:.2f}" if name in step else "" for name in EP_SUMMARY_IMPLS]
        speedup = (f"**{step['a2a_grouped_mm_compiled'] / step[fused]:.2f}x**"
                   if {fused, "a2a_grouped_mm_compiled"} <= step.keys() else "")
        lines.append(f"| {info['preset']} T={info['tokens_per_rank']} {info['routing']} EP={info['ep']} | "
                     + " | ".join(cells) + f" | {speedup} |")
    lines += ["", f"Training-step ms (AC step; the fused protocol keeps no activations), {_versions(runs)}."]
    return "\n".join(lines)


def plot_summary(runs: list[dict], path: Path) -> None:
    """Bars of each impl's training-step speed-up over the compiled baseline, one group per problem."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = _present(SUMMARY_IMPLS, runs)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(columns)
    for i, (name, label) in enumerate(columns.items()):
        xs, ys = [], []
        for j, info in enumerate(runs):
            step = {r["impl"]: r["ac_step_ms"] for r in info["results"]}
            if name in step and "grouped_mm_compiled" in step:
                xs.append(j + i * width)
                ys.append(step["grouped_mm_compiled"] / step[name])
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([j + width * (len(columns) - 1) / 2 for j in range(len(runs))],
                  [f"{info['preset']}\nT={info['tokens']} {info['routing']}" for info in runs], fontsize=7)
    ax.set_ylabel("training-step speed-up vs grouped_mm compiled")
    ax.set_title(f"One MoE layer, training step — {_versions(runs)}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def provenance(runs: list[dict]) -> str:
    """Per result file: what ran where, when, and how (the command with the ``MEGAMOE_*`` switches it recorded)."""
    lines = ["| file | GPU | torch, triton | date | code | command |", "|---|---|---|---|---|---|"]
    for info in runs:
        commit = info.get("commit") or ""
        code = (f"commit {commit[:10]}" if _committed(info)
                else f"source digest {info.get('source_sha256', '?')[:12]}"
                + (f" (on {commit[:10]} with changes)" if commit else ""))
        switches = "".join(f"{name}={value} " for name, value in info.get("environment", {}).items())
        lines.append(f"| `{info['_path'].name}` | {info.get('gpu', '?')} | {info.get('torch', '?')}, "
                     f"{info.get('triton', '?')} | {info.get('date', '?')} | {code} | "
                     f"`{switches}{info.get('command', '?')}` |")
    return "\n".join(lines)


PAGE_HEAD = """# Benchmark results

Generated by `python -m megamoe.bench.report --page benchmarks/README.md` from the JSON files in
`benchmarks/results/` (each written by the benchmark that measured it; nothing here is typed in). How to
measure: `python -m megamoe.bench --help` (one GPU), `--ep` under torchrun (real ranks), `--ep --loopback R`
(virtual ranks on one GPU); `bash scripts/gpu-check.sh layer` runs the README's problems.

Columns: forward, forward+backward, and the training step under full activation checkpointing (AC step:
forward + forward-and-backward for an impl that keeps activations; megamoe keeps none, so its step is its
forward+backward). TFLOP/s counts the FLOPs each impl executes in that step (24·N·D·I checkpointed,
22·N·D·I for megamoe, N routed rows); "of dense" is against the dense bf16 8192³ matmul measured in the
same run; "kept MiB" is what an impl holds between its forward and its backward beyond its inputs and output. `source digest`: the sha256 of the megamoe sources that ran (`megamoe.provenance.source_digest`),
shown where the tree had uncommitted changes; recompute it on a checkout to find the commit that ran.
"""


def page(runs: dict[str, list[dict]]) -> str:
    """The full results page (``benchmarks/README.md``)."""
    parts = [PAGE_HEAD, "## One GPU\n", table(runs["layer"]), "\n![one GPU](results/summary.png)\n"]
    if runs["ep"]:
        parts += ["## Expert parallelism, real ranks\n", ep_table(runs["ep"]), ""]
    if runs["loopback"]:
        parts += ["## The EP machinery on virtual ranks of one GPU\n",
                  ("The fused protocol on R virtual ranks of one GPU against the plain one-device layer on the same "
                   "tokens: what the counts, waits, copies and signals cost without NVLink in the way (at R > 1 the "
                   "owners' GEMMs run one after another on one device, so those rows check the protocol, not "
                   "multi-GPU speed).\n"), loopback_table(runs["loopback"]), ""]
    parts += ["## Provenance\n", provenance([*runs["layer"], *runs["ep"], *runs["loopback"]]), ""]
    return "\n".join(parts)


def update_readme(text: str, sections: dict[str, str]) -> str:
    """``text`` with the lines between each ``<!-- report:NAME -->`` marker and the next ``<!-- report:end -->``
    replaced by ``sections[NAME]``."""
    out, skipping = [], False
    for line in text.splitlines():
        if skipping:
            if line.strip() == "<!-- report:end -->":
                out.append(line)
                skipping = False
            elif line.strip().startswith("<!-- report:"):
                raise ValueError(f"{line.strip()} starts inside a section that has no <!-- report:end -->")
            continue
        out.append(line)
        name = line.strip().removeprefix("<!-- report:").removesuffix(" -->")
        if line.strip().startswith("<!-- report:") and name in sections:
            out += sections[name].splitlines()
            skipping = True
    if skipping:
        raise ValueError("the last <!-- report:... --> section has no <!-- report:end -->")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megamoe.bench.report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("folder", nargs="?", default="benchmarks/results", help="the benchmark JSON files")
    p.add_argument("--readme", type=Path, help="write the summary tables into this Markdown file's report sections")
    p.add_argument("--page", type=Path, help="write the full results page to this file")
    p.add_argument("--no-plots", action="store_true",
                   help="tables only: leave the PNGs beside the JSON files as they are (redrawing them all takes "
                        "most of the report's time)")
    args = p.parse_args(argv)
    runs = load(Path(args.folder))
    if not args.no_plots:
        plot_all(runs, Path(args.folder))
    sections = {"one-gpu": summary_table(runs["layer"]), "sonicmoe": sonicmoe_table(runs["layer"]),
                "fp8": fp8_table(runs["layer"]),
                "ep": ep_summary_table(runs["ep"]), "train": train_table(Path(args.folder))}
    print("\n\n".join(sections.values()))
    if args.readme:
        args.readme.write_text(update_readme(args.readme.read_text(), sections))
    if args.page:
        args.page.write_text(page(runs))


def plot_all(runs: dict, folder: Path) -> None:
    """A PNG beside each layer, loopback and expert-parallel result, and the summary plot in ``folder``."""
    for info in runs["layer"]:
        plot(info, info["_path"].with_suffix(".png"))
    for info in runs["loopback"]:
        plot_loopback(info, info["_path"].with_suffix(".png"))
    for info in runs["ep"]:
        plot(info, info["_path"].with_suffix(".png"),
             problem=f"{info['preset']} T={info['tokens_per_rank']}/rank {info['routing']} routing, EP={info['ep']}")
    if runs["layer"]:
        plot_summary(runs["layer"], folder / "summary.png")


if __name__ == "__main__":
    main()
