"""``kernels.grads.scale_``, the clipping's in-place scaling: bit for bit the fp32 product rounded once (as torch's
``_foreach_mul_`` computes it on the CPU; on the GPU torch rounds the factor first), on every size around the
kernel's block and on the values that round."""

import pytest
import torch

from megamoe.kernels import grads
from megamoe.kernels.grads import BLOCK, scale_


def gradients(dtype, device="cpu"):
    """One tensor of each awkward size: a scalar, a partial block, a block and one past it, two blocks and a
    partial, an empty one; a few special values (infinities, a NaN, the dtype's largest and smallest normal)."""
    torch.manual_seed(0)
    shapes = [(), (5,), (BLOCK,), (BLOCK + 1,), (3, 2 * BLOCK // 3 + 7), (0, 4)]
    tensors = [(torch.randn(shape) * 3).to(dtype).to(device) for shape in shapes]
    info = torch.finfo(dtype)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), info.max, info.tiny, -info.tiny, 0.0])
    tensors[3][: special.numel()] = special.to(dtype)
    return tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", [0.37123, 1.0, 3.5])
def test_scale_is_the_fp32_product_rounded_once(dtype, value):
    tensors = gradients(dtype)
    scale = torch.tensor(value)
    expected = [(t.float() * scale).to(dtype) for t in tensors]
    scale_(tensors, scale)
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t, e, rtol=0, atol=0, equal_nan=True)
    if value != 1.0:  # the case changed something: a kernel that stored its input back would fail here
        assert not torch.equal(tensors[2], gradients(dtype)[2])


def test_scale_outside_the_interpreter_is_torchs(monkeypatch):
    """CPU tensors outside Triton's interpreter go through torch's ``_foreach_mul_``: the same bits."""
    monkeypatch.setattr(grads, "interpreting", lambda: False)
    tensors, kernel = gradients(torch.bfloat16), gradients(torch.bfloat16)
    scale = torch.tensor(0.37123)
    scale_(tensors, scale)
    monkeypatch.undo()
    scale_(kernel, scale)
    for t, k in zip(tensors, kernel):
        torch.testing.assert_close(t, k, rtol=0, atol=0, equal_nan=True)


def test_scale_refuses_what_it_cannot_scale():
    t = torch.randn(8, 6)
    with pytest.raises(ValueError, match="0-dim fp32"):
        scale_([t], torch.tensor([0.5]))
    with pytest.raises(ValueError, match="0-dim fp32"):
        scale_([t], torch.tensor(0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        scale_([t.t()], torch.tensor(0.5))
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        scale_([torch.ones(4, dtype=torch.int32)], torch.tensor(0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scale_is_the_fp32_product_on_the_gpu(dtype):
    """The compiled kernel (not the interpreter's bit-level rounding) against torch's fp32 product on the GPU."""
    tensors = gradients(dtype, "cuda")
    scale = torch.tensor(0.37123, device="cuda")
    expected = [(t.float() * scale).to(dtype) for t in tensors]
    scale_(tensors, scale)
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t, e, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="on cpu"):
        scale_([torch.ones(3)], scale)
