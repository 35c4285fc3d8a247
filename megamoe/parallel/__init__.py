"""Expert parallelism: the all-to-all baseline path (and, to come, the fused in-kernel dispatch)."""
