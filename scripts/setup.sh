#!/usr/bin/env bash
# Prints the python to use. On a machine whose python3 already has a CUDA PyTorch and Triton (the H200
# image) that python3 is used as is; elsewhere a virtualenv .venv gets the pinned CPU stack.
set -euo pipefail
cd "$(dirname "$0")/.."
if python3 -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo python3
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv >&2
fi
# torch 2.13.0 resolves to the local CPU wheel; numpy<2.3 is needed by the Triton 3.6 interpreter.
.venv/bin/python -m pip install -q --disable-pip-version-check \
    "torch==2.13.0" "triton==3.6.0" "numpy<2.3" "pytest>=8" "pytest-timeout" "matplotlib" >&2
echo .venv/bin/python
