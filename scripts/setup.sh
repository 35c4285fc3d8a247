#!/usr/bin/env bash
# Prints the python to use, with megamoe installed from this checkout (`pip install -e`). On a machine whose
# python3 already has a CUDA PyTorch and Triton, that python3 (nothing is downloaded: the editable install
# needs no dependency); elsewhere a virtualenv .venv with the pinned CPU stack and the dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if python3 -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >&2 \
        || echo "setup: the editable install failed (no setuptools?); python3 -m runs megamoe from this checkout" >&2
    echo python3
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv >&2
fi
# torch from pip's configured index (PyPI's Linux wheel is the CUDA build; docs/USAGE.md says how to get the CPU one);
# the dev extras pin numpy<2.3 for the Triton 3.6 interpreter.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" "triton==3.6.0" -e ".[dev]" >&2
echo .venv/bin/python
