"""Instruments for work on the kernels, run from the repository root (not installed with the package):

    python -m tools.resources     compile every kernel for sm_90a on any machine: registers, spills, shared memory
    python -m tools.kernels       per-kernel times of the fused path, optionally sweeping tile configs (GPU)
    python -m tools.fp8           the FP8 path's kernels against the dense FP8 matmul and the copy rate (GPU)
    python -m tools.fp8_trace     where the FP8 GEMMs' blocks spend their time (Hopper)
    python -m tools.kernels_trace  where the bf16 Gluon GEMMs' blocks spend their time (Hopper)
    python -m tools.fp8_wgrad_scales   the FP8 weight gradients' error with fewer scales, against float64 (CPU)
    python -m tools.wgrad_schedule  the weight gradients' blocks dealt to the programs, modelled (CPU)
    python -m tools.host          the host time of a step: the Python around the kernels
    python -m tools.l2            the GPU's L2 and HBM read bandwidth
    torchrun ... -m tools.sender_trace   where the expert-parallel sending kernels spend their time (GPUs)

The user's benchmarks stay in the package: ``python -m megamoe.bench`` (layer, ep, model, report).
"""
