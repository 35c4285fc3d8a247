#!/usr/bin/env bash
# Set up (see setup.sh) and run the layer benchmark. Arguments go to `python -m megamoe.bench` (see --help).
# Without a GPU it checks a tiny problem through the reference and the Triton interpreter instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    exec "$PY" -m megamoe.bench "$@"
fi
TRITON_INTERPRET=1 exec "$PY" -m megamoe.bench "$@"
