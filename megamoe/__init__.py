"""megamoe: fused Mixture-of-Experts training kernels for Hopper GPUs."""

from megamoe.api import moe
from megamoe.checkpoint import checkpoint_context
from megamoe.env import set_fp8_scales
from megamoe.kernels.quant import set_fp8_weight_cache
from megamoe.layer import MegaMoE

__version__ = "0.1.0"
__all__ = ["MegaMoE", "__version__", "checkpoint_context", "moe", "set_fp8_scales", "set_fp8_weight_cache"]
