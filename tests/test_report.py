"""The results tables in the README and the results page are the report's output on the committed JSON files
(no number typed in by hand), every result has its plot, drawn by the report, and a result names the commit of the
code that ran."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megamoe.bench import report

ROOT = Path(__file__).resolve().parent.parent


def copy_results(tmp_path):
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        shutil.copy(path, tmp_path)  # the report redraws PNGs next to the JSONs: not in the checkout
    shutil.copytree(ROOT / "benchmarks" / "results" / "train", tmp_path / "train")
    return tmp_path


def test_readme_and_results_page_are_the_reports_output(tmp_path, capsys):
    folder = copy_results(tmp_path)
    report.main([str(folder), "--no-plots"])  # the plots: the test below
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(printed) > 8 and any("EP=2" in line for line in printed)
    missing = [line for line in printed if line not in readme]
    assert not missing, f"README rows out of date with benchmarks/results (python -m megamoe.bench.report): {missing}"
    page = report.page(report.load(folder))
    assert (ROOT / "benchmarks" / "README.md").read_text() == page, \
        "benchmarks/README.md out of date (python -m megamoe.bench.report --page benchmarks/README.md)"
    assert "| `qwen3-30b-a3b-t16384-random-ep1.json` |" in page and "virtual ranks" in page


def test_every_result_has_its_plot_and_the_report_draws_each_kind(tmp_path):
    """Every committed layer, loopback and expert-parallel result has its PNG beside it, and so does the summary;
    the report draws the newest result of each kind and the summary (drawing all of them takes a minute; the
    tables above read every result's timings, which are what the plots draw)."""
    folder = ROOT / "benchmarks" / "results"
    results = {p.stem for pattern in ("*-ep*.json", "*-loopback*.json") for p in folder.glob(pattern)}
    assert results and results | {"summary"} == {p.stem for p in folder.glob("*.png")}
    newest = [max(found, key=lambda info: info["date"]) for found in report.load(folder).values() if found]
    assert len(newest) == 3, "a layer, a loopback and an expert-parallel result"
    for info in newest:
        shutil.copy(info["_path"], tmp_path)
    report.plot_all(report.load(tmp_path), tmp_path)
    assert {p.stem for p in tmp_path.glob("*.png")} == {info["_path"].stem for info in newest} | {"summary"}


def test_readme_option_rewrites_stale_sections(tmp_path):
    """``--readme`` puts the report's tables in place of stale ones between the markers, and nothing else
    changes: a README with one row and a footer changed comes back equal to the committed README."""
    folder = copy_results(tmp_path)
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| qwen3-30b-a3b T=16384 random ("))
    footer = next(line for line in readme.splitlines() if line.startswith("Training-step ms (AC step), "))
    stale = readme.replace(row, row.replace("|", "| 0.01 |", 2)).replace(footer, "old footer")
    assert stale != readme
    target = tmp_path / "README.md"
    target.write_text(stale)
    report.main([str(folder), "--readme", str(target), "--no-plots"])  # the plots: the test above
    assert target.read_text() == readme
    assert not list(folder.glob("*.png"))
    target.write_text(stale.replace("<!-- report:end -->", "", 1))
    with pytest.raises(ValueError, match="no <!-- report:end -->"):
        report.main([str(folder), "--readme", str(target), "--no-plots"])


def test_results_name_a_commit_only_for_the_checkouts_own_package(tmp_path):
    """A result's ``commit`` is the HEAD of the checkout whose megamoe package ran; a copy of another
    branch inside that checkout (an ``_exp/B`` folder) gets None, not the enclosing
    HEAD, which names code that did not run."""
    def git(*args, cwd=tmp_path):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout.strip()

    def commit_seen_from(folder):
        code = "from megamoe.provenance import git_commit; print(git_commit())"
        return subprocess.run([sys.executable, "-c", code], cwd=folder, check=True, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(folder)}).stdout.strip()

    git("init", "-q")
    for folder in (tmp_path, tmp_path / "_exp" / "b"):
        shutil.copytree(ROOT / "megamoe", folder / "megamoe", ignore=shutil.ignore_patterns("__pycache__"))
    git("add", "-A")
    git("commit", "-qm", "copy")
    assert commit_seen_from(tmp_path) == git("rev-parse", "HEAD")
    assert commit_seen_from(tmp_path / "_exp" / "b") == "None"


def test_sonicmoe_table_divides_sonicmoes_times_by_megamoes():
    def row(impl, fwd, fwd_bwd, ac, kept):
        return {"impl": impl, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "ac_step_ms": ac, "saved_activation_bytes": kept}

    info = {"preset": "p", "tokens": 8, "routing": "random", "gpu": "G", "torch": "t", "triton": "3", "date": "d",
            "commit": "0123abcdef", "sonicmoe_gemms": "default config (pinned)",
            "results": [row("grouped_mm", 9, 9, 9, 0), {**row("sonicmoe", 2, 8, 10, 2**21), "peak_extra_bytes": 3 * 2**20},
                        row("megamoe", 2, 5, 5, 0), row("megamoe_saved", 3, 4, 7, 2**21)]}
    no_sonic = {**info, "preset": "q", "results": info["results"][2:]}
    lines = report.sonicmoe_table([info, no_sonic]).splitlines()
    problem = "| p T=8 random (G, d, 0123abc)"
    assert lines[2:5] == [f"{problem} | sonicmoe | 2.00 | 8.00 | 10.00 | 2 | 3 |  |  |",
                          f"{problem} | megamoe | 2.00 | 5.00 | 5.00 | 0 |  | 1.60x | **2.00x** |",
                          f"{problem} | megamoe_saved | 3.00 | 4.00 | 7.00 | 2 |  | 2.00x | **1.43x** |"]
    assert lines[5] == "" and "default config (pinned)" in lines[6]


def test_fp8_table_divides_each_bf16_twins_and_the_fp8_baselines_times_by_megamoes_fp8():
    def row(impl, fwd, fwd_bwd, ac, kept=0):
        return {"impl": impl, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "ac_step_ms": ac, "saved_activation_bytes": kept}

    info = {"preset": "p", "tokens": 8, "routing": "random", "gpu": "G", "torch": "t", "triton": "3", "date": "d",
            "commit": "0123abcdef-dirty", "source_sha256": "feedbeefcafe",
            "results": [row("megamoe", 2, 9, 9), row("megamoe_fp8", 1, 6, 6), row("megamoe_saved", 3, 8, 11, 2**21),
                        row("megamoe_fp8_saved", 2, 5, 7, 2**21), row("grouped_mm_fp8_compiled", 5, 12, 18, 2**22),
                        row("megamoe_fp8_saved_x_expert", 2, 4, 6, 2**21)]}
    no_fp8 = {**info, "preset": "q", "results": info["results"][:1]}
    lines = report.fp8_table([info, no_fp8]).splitlines()
    problem = "p T=8 random (G, d, digest feedbee)"  # a run on uncommitted code is named by its source digest
    assert lines[2:8] == [f"| {problem} | megamoe | 2.00 | 9.00 | 9.00 | 0 |  | 2.00x |",
                          f"| {problem} | megamoe_fp8 | 1.00 | 6.00 | 6.00 | 0 | **1.50x** | 3.00x |",
                          f"| {problem} | megamoe_saved | 3.00 | 8.00 | 11.00 | 2 |  | 1.64x |",
                          f"| {problem} | megamoe_fp8_saved | 2.00 | 5.00 | 7.00 | 2 | **1.60x** | 2.57x |",
                          f"| {problem} | megamoe_fp8_saved_x_expert | 2.00 | 4.00 | 6.00 | 2 | **2.00x** | 3.00x |",
                          f"| {problem} | grouped_mm_fp8_compiled | 5.00 | 12.00 | 18.00 | 4 |  |  |"]
    assert lines[8] == ""


def test_provenance_gives_the_command_with_the_switches_it_ran_under(tmp_path):
    info = {"_path": tmp_path / "r.json", "gpu": "G", "torch": "t", "triton": "3", "date": "d",
            "commit": "0123abcdef-dirty", "source_sha256": "feedbeefcafe", "command": "python -m megamoe.bench",
            "environment": {"MEGAMOE_FP8_WGRAD_X_SCALES": "expert", "MEGAMOE_WGRAD_TAKEN": "none"}}
    lines = report.provenance([info, {**info, "environment": {}}]).splitlines()
    assert lines[2].endswith("| `MEGAMOE_FP8_WGRAD_X_SCALES=expert MEGAMOE_WGRAD_TAKEN=none python -m megamoe.bench` |")
    assert lines[3].endswith("| `python -m megamoe.bench` |")


def test_readme_tables_keep_each_problems_newest_run():
    """The README's SonicMoE and FP8 tables: each problem's newest run only (the older ones are on the results
    page); the FP8 table also the problem's newest run with the FP8 baseline where the newest run lacks it."""
    def run(preset, date, baseline=False):
        impls = ("sonicmoe", "megamoe", "megamoe_fp8") + (("grouped_mm_fp8_compiled",) if baseline else ())
        return {"preset": preset, "tokens": 8, "routing": "random", "gpu": "G", "torch": "t", "triton": "3",
                "date": date, "commit": "0123abcdef", "sonicmoe_gemms": "c",
                "results": [{"impl": impl, "fwd_ms": 1, "fwd_bwd_ms": 2, "ac_step_ms": 2, "saved_activation_bytes": 0}
                            for impl in impls]}

    runs = [run("b", "2026-01-01", baseline=True), run("a", "2026-01-01"), run("b", "2026-03-01"),
            run("a", "2026-02-01"), run("b", "2026-02-01", baseline=True)]

    def problems(table):
        firsts = [line.split(" | ")[0] for line in table.splitlines()[2:] if line.startswith("| ")]
        return list(dict.fromkeys(firsts))

    a, b, b_baseline = ("| a T=8 random (G, 2026-02-01, 0123abc)", "| b T=8 random (G, 2026-03-01, 0123abc)",
                        "| b T=8 random (G, 2026-02-01, 0123abc)")
    assert problems(report.sonicmoe_table(runs)) == [a, b]
    assert problems(report.fp8_table(runs)) == [a, b, b_baseline]


def test_readme_tables_leave_out_runs_of_a_recipe_option():
    """A newer run with an option of the FP8 recipe (x's weight-gradient scales over the layer) does not stand for
    the layer in the README's tables: the newest run of the default recipe does."""
    def run(date, x_scales=None):
        info = {"preset": "p", "tokens": 8, "routing": "random", "gpu": "G", "torch": "t", "triton": "3",
                "date": date, "commit": "0123abcdef", "sonicmoe_gemms": "c",
                "matmul_tflops": 1.0,
                "results": [{"impl": impl, "fwd_ms": 1, "fwd_bwd_ms": 2, "ac_step_ms": 2, "saved_activation_bytes": 0,
                             "tflops": 1.0} for impl in ("sonicmoe", "megamoe", "megamoe_fp8")]}
        return info if x_scales is None else {**info, "megamoe_fp8_wgrad_x_scales": x_scales}

    runs = [run("2026-01-01"), run("2026-02-01", "tile"), run("2026-03-01", "layer"), run("2026-04-01", "expert")]
    for table in (report.sonicmoe_table(runs), report.fp8_table(runs)):
        firsts = list(dict.fromkeys(line.split(" | ")[0] for line in table.splitlines()[2:] if line.startswith("| ")))
        assert firsts == ["| p T=8 random (G, 2026-02-01, 0123abc)"]
    # the results page's history keeps every run, the option's marked
    firsts = [line.split(" | ")[0] for line in report.table(runs).splitlines()[2:] if line.startswith("| ")]
    assert firsts == (["| p T=8 random (G)"] * 6 + ["| p T=8 random (G, x's FP8 dW13 scales over the layer)"] * 3
                      + ["| p T=8 random (G, x's FP8 dW13 scales per expert)"] * 3)


def test_tables_name_each_runs_gpu():
    """A table of runs on two GPUs names each row's GPU, short, lists both GPUs in full below it, and keeps each
    GPU's newest run of a problem (a newer run on one GPU does not hide the other's)."""
    def run(gpu, date):
        return {"preset": "p", "tokens": 8, "routing": "random", "gpu": gpu, "torch": "t", "triton": "3",
                "date": date, "commit": "0123abcdef", "sonicmoe_gemms": "c",
                "results": [{"impl": impl, "fwd_ms": 1, "fwd_bwd_ms": 2, "ac_step_ms": 2, "saved_activation_bytes": 0}
                            for impl in ("megamoe", "megamoe_fp8", "grouped_mm_fp8_compiled")]}

    runs = [run("NVIDIA H200", "2025-12-01"), run("NVIDIA H200", "2026-01-01"),
            run("NVIDIA H100 80GB HBM3", "2026-02-01")]
    table = report.fp8_table(runs)
    firsts = list(dict.fromkeys(line.split(" | ")[0] for line in table.splitlines()[2:] if line.startswith("| ")))
    assert firsts == ["| p T=8 random (H100, 2026-02-01, 0123abc)", "| p T=8 random (H200, 2026-01-01, 0123abc)"]
    assert "\nNVIDIA H100 80GB HBM3 and NVIDIA H200, torch t, triton 3, 2026-01-01 to 2026-02-01; " in table
    both = report._versions(runs[1:])
    assert both.startswith("NVIDIA H200 and NVIDIA H100 80GB HBM3, torch t, triton 3, 2026-01-01 to 2026-02-01")


def test_train_table_names_micro_batches_and_code(tmp_path):
    """A run that accumulates gradients over micro-batches says so in its tokens per step; one without the key
    (written before the option existed) counts as one micro-batch. Each row names the code that ran: its commit, or
    its source digest where the tree had changes (two runs of one setting and seed, at two commits, stay apart); an FP8
    run's MoE share from an ablation that reused its weight copies says so."""
    (tmp_path / "train").mkdir()
    run = json.loads((ROOT / "benchmarks" / "results" / "train" / "qwen3-30b-a3b-l2-megamoe-s0.json").read_text())
    run.pop("micro_batches", None)
    (tmp_path / "train" / "one.json").write_text(json.dumps(run))
    (tmp_path / "train" / "four.json").write_text(json.dumps({**run, "micro_batches": 4, "seed": 7,
                                                              "commit": "abcdef0123-dirty", "source_sha256": "9876543"}))
    rows = [line for line in report.train_table(tmp_path).splitlines() if line.startswith("| qwen3")]
    assert len(rows) == 2
    assert f"| 1 x {run['seq_len']} | megamoe | {run['seed']} |" in rows[0] and rows[0].endswith(f"| {run['commit'][:7]} |")
    assert f"| 4 micro-batches of 1 x {run['seq_len']} | megamoe | 7 |" in rows[1]
    assert rows[1].endswith("| digest 9876543 |")
    # runs on two GPUs name each row's; an FP8 run with x's dW13 scales over the layer says so
    (tmp_path / "train" / "h100.json").write_text(json.dumps({**run, "gpu": "NVIDIA H100 80GB HBM3", "seed": 9,
                                                              "expert_precision": "fp8", "fp8_wgrad_x_scales": "layer"}))
    rows = [line for line in report.train_table(tmp_path).splitlines() if line.startswith("| qwen3")]
    assert rows[0].startswith(f"| {run['preset']}, {run['layers']} layers ({report._gpu(run)}) |")
    assert "| megamoe (FP8, x's dW13 scales over the layer) | 9 |" in rows[1] and "layers (H100) |" in rows[1]
    # an FP8 run's share from an ablation that reused the weight copies says so; a bf16 one's needs not
    assert f"| {run['moe_share']:.3f} (copies reused) |" in rows[1] and f"| {run['moe_share']:.3f} |" in rows[0]
    (tmp_path / "train" / "h100.json").write_text(json.dumps({
        **run, "gpu": "NVIDIA H100 80GB HBM3", "seed": 9, "expert_precision": "fp8",
        "moe_share_method": "ablation: median of 5 steps' forward+backward passes (1 a step, the FP8 weight copies "
                            "made in each) with the experts (1.00 ms) and with the experts replaced by zeros (0.50 ms)"}))
    rows = [line for line in report.train_table(tmp_path).splitlines() if line.startswith("| qwen3")]
    assert f"| megamoe (FP8) | 9 | {run['steps']} | " in rows[1] and f"| {run['moe_share']:.3f} |" in rows[1]
    # a share that is no share (the model timed slower without its experts) says the ablation failed
    (tmp_path / "train" / "h100.json").write_text(json.dumps({**run, "gpu": "NVIDIA H100 80GB HBM3", "seed": 9,
                                                              "moe_share": -0.04}))
    rows = [line for line in report.train_table(tmp_path).splitlines() if line.startswith("| qwen3")]
    assert "| megamoe | 9 |" in rows[1] and "| failed |" in rows[1]
    # a run with the fused AdamW says so, beside FP8 where both hold; the older runs (foreach) need not
    (tmp_path / "train" / "h100.json").write_text(json.dumps({**run, "gpu": "NVIDIA H100 80GB HBM3", "seed": 9,
                                                              "expert_precision": "fp8",
                                                              "optimizer": "AdamW (fused), bf16 states"}))
    rows = [line for line in report.train_table(tmp_path).splitlines() if line.startswith("| qwen3")]
    assert "| megamoe (FP8, fused AdamW) | 9 |" in rows[1] and "| megamoe | 0 |" in rows[0]
    # an FP8 run whose weight copies were made ahead (or in every call) says so; the default policy needs not
    for policy, mark in (("ahead", "copies made ahead"), ("call", "copies per call")):
        (tmp_path / "train" / "h100.json").write_text(json.dumps({**run, "gpu": "NVIDIA H100 80GB HBM3", "seed": 9,
                                                                  "expert_precision": "fp8", "fp8_weight_cache": policy,
                                                                  "optimizer": "AdamW (fused), bf16 states"}))
        rows = [line for line in report.train_table(tmp_path).splitlines() if line.startswith("| qwen3")]
        assert f"| megamoe (FP8, {mark}, fused AdamW) | 9 |" in rows[1]
