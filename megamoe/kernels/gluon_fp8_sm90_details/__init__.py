"""The FP8 Gluon kernels behind ``megamoe.kernels.gluon_fp8_sm90`` (its launchers): ``common`` (shared device
helpers), ``rows`` (the sorted-rows GEMM), ``up`` (gate/up + SwiGLU + h's quantisation), ``wgrad`` (weight
gradients) and ``act`` (the FP8 weight gradients' act step)."""
