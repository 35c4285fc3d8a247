"""Triton kernels (private): the routing plan, the expert GEMMs forward and backward, the combine."""
