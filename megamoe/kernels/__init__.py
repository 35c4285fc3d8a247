"""Triton kernels (private). ``AVAILABLE`` says whether the fused path exists in this build."""

AVAILABLE = True
