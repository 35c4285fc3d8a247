"""The FP8 rowwise baseline (``reference.moe_grouped_mm_fp8``, torchao's recipe): its quantisation against plain
per-slice computations, its layouts and scale conventions against ``torch._scaled_grouped_mm``'s rules through an
emulated GEMM on the CPU, and on a GPU the real kernels against the fp32 reference."""

import pytest
import torch

from megamoe import reference
from tests.helpers import make_problem, run_with_grads

NAMES = ["y", "dx", "dtopk_weights", "dw13", "dw2"]
FP8 = torch.float8_e4m3fn


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def plain_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale written out: the largest power of two s with amax * s <= 448 (448 * 2**40 for amax = 0)."""
    amax = amax.double().clamp_min(1e-12)
    return torch.exp2(torch.floor(torch.log2(448.0 / amax))).float()


def test_axiswise_quantisation_matches_plain_computation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 48, generator=gen, dtype=torch.float64).mul(3).to(torch.bfloat16)
    x[3] = 0  # a zero row: finite scale, zero data
    for dim in (0, 1):
        data, scale = reference.fp8_quantize_axiswise(x, dim)
        assert data.dtype == FP8 and scale.dtype == torch.float32 and scale.shape[dim] == 1
        amax = x.float().abs().amax(dim=dim, keepdim=True)
        torch.testing.assert_close(scale, plain_scale(amax), rtol=0, atol=0)
        assert ((amax * scale)[amax > 0] > 224).all() and ((amax * scale) <= 448).all()
        torch.testing.assert_close(data.float(), (x.float() * scale).to(FP8).float(), rtol=0, atol=0)
        # Round to nearest in e4m3 (3 mantissa bits): within 2**-4 relative of the scaled value, or subnormal.
        back = data.float() / scale
        assert ((back - x.float()).abs() <= x.float().abs() / 16 + 2.0**-10 / scale).all()


def test_axiswise_quantisation_saturates():
    """The cast clamps to +-448 (PyTorch's plain e4m3 cast would give NaN past it)."""
    x = torch.tensor([[1.0, -3.0]])
    data = reference._to_fp8_saturated(x, torch.tensor([[300.0]]))
    assert data.float().tolist() == [[288.0, -448.0]]


def test_token_group_quantisation_matches_per_group_loop():
    """One scale per (group, column) over the group's rows, as torchao's per-group loop computes them; rows past
    the last group (garbage, here NaN) reach no scale; the data comes back column-major."""
    gen = torch.Generator().manual_seed(1)
    sizes = [32, 16, 64, 16]  # multiples of 16; 16 rows left over past the last group
    m_rows, cols = sum(sizes) + 16, 24
    x = (torch.randn(m_rows, cols, generator=gen) * torch.rand(m_rows, 1, generator=gen) * 5).to(torch.bfloat16)
    x[sum(sizes):] = float("nan")
    x[32:48] = 0  # a padded-out expert: zero scale input, zero data
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    data, scale = reference.fp8_quantize_token_groups(x, offs)
    assert data.shape == (m_rows, cols) and data.stride() == (1, m_rows) and scale.shape == (4, cols)
    start = 0
    for g, end in enumerate(offs.tolist()):
        rows = x[start:end].float()
        want = plain_scale(rows.abs().amax(dim=0))
        torch.testing.assert_close(scale[g], want, rtol=0, atol=0)
        torch.testing.assert_close(data[start:end].float(), (rows * want).to(FP8).float(), rtol=0, atol=0)
        start = end
    assert torch.isfinite(scale).all()


def emulated_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
                               out_dtype=None, use_fast_accum=False):
    """``torch._scaled_grouped_mm`` (FP8 rowwise, 2d-3d and 2d-2d) on the CPU: its argument checks (the meta
    function's, run on meta copies, plus the CUDA entry point's and the CUTLASS launcher's size rules), then
    dequantise-and-multiply in fp32, bf16 out. Output rows it would not write are NaN."""
    meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            for t in (mat_a, mat_b, scale_a, scale_b, offs)]
    torch.ops.aten._scaled_grouped_mm(*meta, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    assert mat_a.size(-1) % 16 == 0 and mat_b.size(-2) % 16 == 0 and mat_b.size(-1) % 16 == 0
    assert out_dtype == torch.bfloat16 and use_fast_accum  # torchao's arguments
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    a, b = mat_a.float(), mat_b.float()
    if mat_b.dim() == 3:  # 2d-3d: groups of rows of mat_a
        out = torch.full((mat_a.shape[0], mat_b.shape[-1]), float("nan"))
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = (a[s:e] @ b[g]) * scale_a[s:e, None] * scale_b[g][None, :]
    else:  # 2d-2d: groups along the contraction dim, CUTLASS rejects empty ones and unaligned starts
        rows, cols = mat_a.shape[0], mat_b.shape[1]
        assert all(e - s > 0 for s, e in zip(starts, ends)) and all(e % 16 == 0 for e in ends[:-1])
        out = torch.stack([(a[:, s:e] @ b[s:e]) * scale_a[g * rows:(g + 1) * rows, None]
                           * scale_b[g * cols:(g + 1) * cols][None, :] for g, (s, e) in enumerate(zip(starts, ends))])
    return out.to(torch.bfloat16)


@pytest.fixture
def emulated_fp8(monkeypatch):
    """``torch._scaled_grouped_mm`` given a CPU kernel (the emulation) for the test: a kernel, not a patched
    Python name, so that a ``torch.compile``d graph reaches it too."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_grouped_mm", emulated_scaled_grouped_mm, "CPU")
    monkeypatch.setattr(reference, "_check_fp8_device", lambda device: None)
    yield
    lib._destroy()


@pytest.mark.parametrize("routing", ["random", "empty", "dropped"])
def test_fp8_emulated_matches_fp32(emulated_fp8, routing):
    """The whole layer with the GEMM emulated: layouts and scale shapes pass torch's checks, the scales are
    applied on the right axes (a mix-up gives O(1) errors), unused experts get exactly zero gradient."""
    problem = make_problem(203, 64, 32, 8, 2, routing, dtype=torch.bfloat16)  # T*K not a multiple of 16
    out = run_with_grads(reference.moe_grouped_mm_fp8, *problem)
    ref = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    bf16 = run_with_grads(reference.moe_grouped_mm, *problem)
    for name, o, r, b in zip(NAMES, out, ref, bf16):
        assert o.shape == r.shape and torch.isfinite(o).all(), name
        assert rel_err(o, r) < 0.1, f"{name}: {rel_err(o, r):.3f}"
        assert rel_err(o, b) > 5e-3, f"{name} matches bf16 ({rel_err(o, b):.1e}): FP8 not applied?"
    idx = problem[1]
    unused = torch.ones(8, dtype=torch.bool)
    unused[idx[idx >= 0].unique()] = False
    if routing == "empty":
        assert unused.any()
    assert (out[3][unused] == 0).all() and (out[4][unused] == 0).all()


def test_fp8_compiles_fullgraph(emulated_fp8):
    """``torch.compile(..., fullgraph=True)`` traces the custom autograd function and the quantisation (meta
    functions of every op, no graph break) and runs the same ops as eager (aot_eager: no fusion, same bits)."""
    problem = make_problem(203, 64, 32, 8, 2, "dropped", dtype=torch.bfloat16)
    eager = run_with_grads(reference.moe_grouped_mm_fp8, *problem)
    torch._dynamo.reset()
    compiled = run_with_grads(torch.compile(reference.moe_grouped_mm_fp8, fullgraph=True, backend="aot_eager"),
                              *problem)
    for name, c, e in zip(NAMES, compiled, eager):
        assert torch.equal(c, e), name


def test_fp8_raises_clearly_without_a_gpu():
    problem = make_problem(8, 32, 16, 4, 2, "random", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
        reference.moe_grouped_mm_fp8(*problem[:5])


def test_fp8_rejects_sizes_the_kernel_cannot_take(emulated_fp8):
    problem = make_problem(8, 40, 24, 4, 2, "random", dtype=torch.bfloat16)
    assert not reference.grouped_mm_fp8_supports(40, 24)
    with pytest.raises(ValueError, match="multiples of 16"):
        reference.moe_grouped_mm_fp8(*problem[:5])


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("routing", ["random", "empty"])
def test_fp8_gpu_matches_fp32(poison_cuda, routing, compiled):
    """2 048 tokens, E=8, top-2, D=512, I=256 (``empty``: experts 3..7 get no tokens). Norm-wise error below
    0.1 against the fp32 loop for the output and every gradient, and visibly not the bf16 result (a silent bf16
    fallback would fail); unused experts get exactly zero gradient."""
    problem = make_problem(2048, 512, 256, 8, 2, routing, dtype=torch.bfloat16, device="cuda")
    fn = reference.moe_grouped_mm_fp8
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True)
    out = run_with_grads(fn, *problem)
    ref = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    bf16 = run_with_grads(reference.moe_grouped_mm, *problem)
    errs = {name: (rel_err(o, r), rel_err(o, b)) for name, o, r, b in zip(NAMES, out, ref, bf16)}
    for name, o in zip(NAMES, out):
        assert torch.isfinite(o).all(), f"{name} has non-finite values"
        assert errs[name][0] < 0.1, f"{name}: rel err vs fp32 {errs[name]}"
        assert errs[name][1] > 5e-3, f"{name}: within {errs[name][1]:.1e} of bf16, FP8 not applied?"
    idx = problem[1]
    unused = torch.ones(8, dtype=torch.bool, device="cuda")
    unused[idx.unique()] = False
    assert bool(unused.any()) == (routing == "empty")
    assert (out[3][unused] == 0).all() and (out[4][unused] == 0).all()
