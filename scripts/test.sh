#!/usr/bin/env bash
# Set up (see setup.sh) and run the test suite. Extra arguments go to pytest (e.g. -m gpu). Without a GPU the
# Triton kernels run in the interpreter and GPU-marked tests are skipped; the files run two at a time, one per
# process (pytest-xdist; `-n 0` after the command: one process). With a GPU, one process: its tests measure
# memory and time on the one device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
if ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "the tests need the dev extras in $PY's environment: $PY -m pip install -e '.[dev]'" >&2
    exit 1
fi
workers=()
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    workers=(-n 2 --dist loadfile)
    # One thread per worker for torch and numpy's BLAS (the interpreter's matmuls): two workers on two cores with
    # a pool of threads each spent ~40% of the suite's CPU time spinning (1 050 s -> 630 s on a 2-core machine).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
set +e
"$PY" -m pytest -q "${workers[@]}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "no tests were collected: failing" >&2
    exit 1
fi
exit "$rc"
