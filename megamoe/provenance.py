"""What every result records about the code that made it (training runs and benchmarks): the commit, a digest
of the package's sources, and the date. The GPU and library versions are read where a result is written."""

from __future__ import annotations

import datetime
import hashlib
import os
import subprocess
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def source_digest() -> str:
    """sha256 over the megamoe package's sources (paths and bytes): identifies the code that ran even
    where the checkout's git metadata is stale (a copy of the working tree run on another machine
    whose .git can lag behind). Recompute on any commit with the same function to match a result."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def utc_now(timespec: str = "milliseconds") -> str:
    """The time in UTC, ISO 8601: a result's ``date`` (seconds) and its timing windows (milliseconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec=timespec)


def git_commit() -> str | None:
    """HEAD of the checkout the running megamoe package belongs to ("-dirty" with uncommitted changes), or
    None when the package is not that checkout's own: a copied working tree, or a copy of another branch
    inside this checkout (an ``_exp/B`` folder, say), whose enclosing repository's HEAD
    would name code that did not run."""
    root = PACKAGE.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=root).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None  # not a git checkout


def gpu_record(command: str) -> dict:
    """What a result measured on the GPU records first: the GPU, the torch and Triton versions, the commit, the
    source digest, the date (UTC, seconds), ``command``, the command line that made it, and the ``MEGAMOE_*``
    environment switches it ran under (docs/USAGE.md)."""
    import torch
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit(), "source_sha256": source_digest(), "date": utc_now("seconds"), "command": command,
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MEGAMOE_")}}


def write_record(folder: Path, name: str, command: str, **fields) -> Path:
    """``gpu_record(command)`` and ``fields`` as JSON into ``folder``/``name`` (the folder made if need be); prints and
    returns the path."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps({**gpu_record(command), **fields}, indent=1))
    print(f"wrote {path}")
    return path
