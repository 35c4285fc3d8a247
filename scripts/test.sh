#!/usr/bin/env bash
# Set up (see setup.sh) and run the test suite. Without a GPU the Triton kernels run in the interpreter
# and GPU-marked tests are skipped (about 25-30 minutes on 2 cores from a fresh clone, install included). Extra arguments go to pytest (e.g. -m gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
set +e
"$PY" -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "no tests were collected: failing" >&2
    exit 1
fi
exit "$rc"
