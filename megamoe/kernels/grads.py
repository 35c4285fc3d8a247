"""Gradients multiplied in place by an fp32 scalar that stays on the device: the training loop's clipping.

``scale_(tensors, scale)`` computes ``(t.float() * scale).to(t.dtype)`` for each tensor: the fp32 product rounded
once. It replaces torch's ``torch._foreach_mul_(tensors, scale)`` (``clip_grad_norm_``'s scaling: bf16 gradients
times an fp32 0-dim tensor, two dtypes in one op), with which the 6-layer model's clipping took 22.6 ms where its
bytes take ~9 (docs/PERFORMANCE.md, "The clipping's scaling"). Not torch's bits on the GPU: there torch rounds the
factor to the gradients' dtype before it multiplies (docs/FACTS.md); on the CPU it does not, and the two agree. Here
one plain streaming kernel per tensor reads and writes each gradient once, in 16-byte accesses where its length is a
multiple of 16; the scale is read on the device, so nothing waits for the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.env import interpreting

BLOCK = 4096  # values per program: 8 KiB of bf16 in, 8 KiB out


# Triton 3.6's interpreter converts fp32 to bf16 by dropping the low 16 bits (and mishandles subnormals); the GPU
# rounds to nearest even, as torch does. Under the interpreter the kernel makes the bf16 bits itself. Fixed at
# import, as Triton fixes the interpreter when a kernel is defined.
BF16_ON_THE_BITS = tl.constexpr(interpreting())


@triton.jit
def _to_bf16_on_the_bits(v):
    """fp32 ``v`` rounded to bf16 on its bits, to nearest even (a NaN stays a NaN)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, rounded)  # a NaN: kept quiet
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _scale_kernel(
    t_ptr,  # (n,) contiguous, bf16 / fp16 / fp32: scaled in place
    scale_ptr,  # () fp32
    n,
    BLOCK: tl.constexpr,
    ON_THE_BITS: tl.constexpr = BF16_ON_THE_BITS,
):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: a tensor may hold more than 2**31 values
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.load(scale_ptr)
    t = tl.load(t_ptr + offs, mask=mask)
    product = t.to(tl.float32) * scale
    if ON_THE_BITS and t_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(t_ptr + offs, _to_bf16_on_the_bits(product), mask=mask)
    else:
        tl.store(t_ptr + offs, product.to(t_ptr.dtype.element_ty), mask=mask)


KERNELS = (_scale_kernel,)  # compiled for sm_90a without a GPU in tests/test_compile.py


def scale_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiplies each of ``tensors`` in place by ``scale`` (a 0-dim fp32 tensor on their device): the product
    in fp32, rounded to nearest even in the tensor's dtype. CUDA tensors (and any under Triton's interpreter) go
    through the kernel, one launch each; CPU tensors through torch, the same bits. All contiguous, bf16, fp16 or
    fp32, on the scale's device."""
    if scale.dim() != 0 or scale.dtype != torch.float32:
        raise ValueError(f"scale must be a 0-dim fp32 tensor, got {scale.dtype} of shape {tuple(scale.shape)}")
    for t in tensors:
        if t.device != scale.device:
            raise ValueError(f"a tensor on {t.device} and the scale on {scale.device}")
        if not t.is_contiguous():
            raise ValueError(f"scale_ needs contiguous tensors, got one of shape {tuple(t.shape)} and strides "
                             f"{t.stride()}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"scale_ scales bf16, fp16 or fp32 tensors, got {t.dtype}")
    if not (scale.is_cuda or interpreting()):
        torch._foreach_mul_(tensors, scale)  # CPU tensors: torch's own scaling, the same bits on the CPU
        return
    for t in tensors:
        if t.numel():
            _scale_kernel[(triton.cdiv(t.numel(), BLOCK),)](t, scale, t.numel(), BLOCK=BLOCK, num_warps=8)
