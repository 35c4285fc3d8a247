"""The results tables in the README are the report's output on the committed JSON files (no number typed
in by hand), the report draws a plot for each file, and a result names the commit of the code that ran."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from megamoe.bench import report

ROOT = Path(__file__).resolve().parent.parent


def test_readme_tables_are_the_reports_output_and_every_result_is_plotted(tmp_path, capsys):
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        shutil.copy(path, tmp_path)  # the report redraws PNGs next to the JSONs: not in the checkout
    report.main([str(tmp_path)])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(printed) > 4 and any("virtual ranks" in line for line in printed)
    missing = [line for line in printed if line not in readme]
    assert not missing, f"README rows out of date with benchmarks/results (python -m megamoe.bench.report): {missing}"
    results = {p.stem for pattern in ("*-ep*.json", "*-loopback*.json") for p in tmp_path.glob(pattern)}
    assert results and results == {p.stem for p in tmp_path.glob("*.png")}


def test_readme_option_rewrites_stale_tables_and_footer(tmp_path):
    """``--readme`` puts the report's tables (and the layer table's footer line) in place of stale ones:
    a README with one row and the footer changed comes back equal to the committed README."""
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        shutil.copy(path, tmp_path)
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| qwen3-30b-a3b T=16384 random | megamoe |"))
    footer = next(line for line in readme.splitlines() if "dense bf16 matmul" in line)
    stale = readme.replace(row, row.replace("| megamoe |", "| megamoe | 0.01 |", 1)).replace(footer, "old footer")
    assert stale != readme
    target = tmp_path / "README.md"
    target.write_text(stale)
    report.main([str(tmp_path), "--readme", str(target)])
    assert target.read_text() == readme


def test_results_name_a_commit_only_for_the_checkouts_own_package(tmp_path):
    """A result's ``commit`` is the HEAD of the checkout whose megamoe package ran; a copy of another
    branch inside that checkout (``device-check.sh compare``'s ``_exp/B``) gets None, not the enclosing
    HEAD, which names code that did not run."""
    def git(*args, cwd=tmp_path):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                              capture_output=True, text=True).stdout.strip()

    def commit_seen_from(folder):
        code = "from megamoe.bench.common import git_commit; print(git_commit())"
        return subprocess.run([sys.executable, "-c", code], cwd=folder, check=True, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(folder)}).stdout.strip()

    git("init", "-q")
    for folder in (tmp_path, tmp_path / "_exp" / "b"):
        shutil.copytree(ROOT / "megamoe", folder / "megamoe", ignore=shutil.ignore_patterns("__pycache__"))
    git("add", "-A")
    git("commit", "-qm", "copy")
    assert commit_seen_from(tmp_path) == git("rev-parse", "HEAD")
    assert commit_seen_from(tmp_path / "_exp" / "b") == "None"
