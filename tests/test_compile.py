"""Every GEMM kernel's default config compiles for Hopper (sm_90a) inside the shared memory, bf16 with
warpgroup MMAs, and so does every kernel without a tile config (the backward's row copies, the
expert-parallel protocol, the quantisers, the training loop's gradient scaling), and the Gluon kernels (also
with sizes not 16-divisible) — checked on any machine, no GPU needed (Triton compiles ahead of time for a named
target; the interpreter that runs the CPU tests accepts code that does not compile). Runs in a subprocess
because the CPU test session interprets the kernels instead."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_default_configs_compile_for_hopper_within_shared_memory(dtype):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "tools.resources", "--dtype", dtype], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:] if line.strip()]
    from tools.resources import (
        FP8_KERNELS,
        FP8_WS_VARIANTS,
        KERNELS,
        OTHER_KERNELS,
        VARIANTS,
        WS_KERNELS,
        configs_to_check,
    )

    gluon_kernels = len(WS_KERNELS) if dtype == "bf16" else 0  # 16-bit only
    fp8_gemms = len(FP8_KERNELS) + len(FP8_WS_VARIANTS) if dtype == "bf16" else 0  # FP8 operands, bf16 outputs
    triton_configs = sum(len(configs_to_check(kernel, candidates=False)) for kernel in KERNELS.values()) + len(VARIANTS)
    gemms = triton_configs + gluon_kernels + fp8_gemms
    # and two lines for each Gluon kernel (compiled with sizes not 16-divisible; with its block trace), two for each
    # weight-gradient kernel (its blocks in the other order, and taken in turn), and one for each of the two side-copy
    # kernels at top_k 1 and 2, for the act step on saved products in both paths (without spills), for the FP8 act
    # step's Gluon kernel with each kind of scale (two programs per SM), and for the dispatch of FP8 token rows
    # (forward, and backward beside x and dy) and its token-major row copy's FP8 variant
    side_copies = 4 if dtype == "bf16" else 0
    other_orders = 2 * sum(name.startswith("wgrad") for name in WS_KERNELS) if dtype == "bf16" else 0
    act_steps = 2 + (2 if dtype == "bf16" else 0)
    assert len(rows) == gemms + len(OTHER_KERNELS) + 2 * gluon_kernels + other_orders + side_copies + act_steps + 3, \
        out.stdout
    if dtype == "bf16":
        gluon = rows[triton_configs:triton_configs + gluon_kernels]
        assert [row[0] for row in gluon] == list(WS_KERNELS), out.stdout
        spills = {row[0]: int(row[-3]) for row in rows[:gemms]}
        for name, (twin, *_) in WS_KERNELS.items():  # a Gluon kernel spills no more than the Triton kernel it replaces
            assert spills[name] <= spills[twin], out.stdout
        assert all(row[-1] == "yes" for row in rows[:gemms]), f"bf16 GEMMs must use warpgroup MMAs:\n{out.stdout}"
