"""The references agree with each other and with fp32 on outputs and all gradients."""

import pytest
import torch

from megamoe import reference
from tests.helpers import (
    NAMES,
    SHAPES,
    assert_close_to_reference,
    make_problem,
    run_with_grads,
)

SHAPE_IDS = [f"T{s[0]}-D{s[1]}-I{s[2]}-E{s[3]}-K{s[4]}-{s[5]}" for s in SHAPES]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_reference_matches_fp32(dtype, shape):
    if not reference.grouped_mm_supports(shape[1], shape[2], dtype):
        pytest.skip("torch._grouped_mm needs 16-byte aligned rows (a limitation of the baseline)")
    problem = make_problem(*shape, dtype=dtype)
    assert_close_to_reference(run_with_grads(reference.moe_grouped_mm, *problem), problem)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loop_in_its_dtype_is_fp32_to_rounding(dtype, shape):
    """The per-expert loop computed in the test dtype is the yardstick of every kernel test's bound
    (``assert_close_to_reference``: twice its distance from fp32), so it is checked against fp32 on its own: in fp32
    exactly (``fp32=True`` changes nothing there), in 16 bits within two units in the last place of the dtype at each
    output's scale (the results pass through the down GEMM's and the weighted sum's roundings, half a unit each, and
    the gate/up products' before them; measured up to 1.5 units in bf16 on these shapes). A 2% error in the loop
    would let every kernel test pass 4% off; this fails it."""
    problem = make_problem(*shape, dtype=dtype)
    out = run_with_grads(reference.moe_loop, *problem)
    ref32 = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    eps = torch.finfo(dtype).eps
    for name, o, r in zip(NAMES, out, ref32):
        if dtype == torch.float32:
            assert torch.equal(o, r), name
            continue
        err = (o.float() - r).abs().max().item()
        assert err <= 2 * eps * max(1.0, r.abs().max().item()), f"{name}: max err {err:.3e} ({err / eps:.2f} ulp)"


def test_loop_matches_explicit_formula():
    """moe_loop against the formula written token by token (guards the reference itself)."""
    x, idx, w, w13, w2, _ = make_problem(7, 16, 8, 3, 2, "dropped")
    inter = 8
    y = reference.moe_loop(x, idx, w, w13, w2)
    for t in range(7):
        acc = torch.zeros(16)
        for k in range(2):
            e = int(idx[t, k])
            if e < 0:
                continue
            g, u = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            acc += w[t, k] * (w2[e] @ (torch.nn.functional.silu(g) * u))
        torch.testing.assert_close(y[t], acc, rtol=1e-5, atol=1e-5)


def test_dropped_slots_and_empty_experts_get_zero_gradient():
    x, idx, w, w13, w2, dy = make_problem(29, 32, 16, 8, 2, "empty")
    idx[0, 0] = -1
    for fn in (reference.moe_loop, reference.moe_grouped_mm):
        _, _, dw, dw13, dw2 = run_with_grads(fn, x, idx, w, w13, w2, dy)
        used = torch.zeros(8, dtype=torch.bool)
        used[idx[idx >= 0].unique()] = True
        assert (~used).any()
        assert torch.equal(dw13[~used], torch.zeros_like(dw13[~used]))
        assert torch.equal(dw2[~used], torch.zeros_like(dw2[~used]))
        assert dw[0, 0] == 0


@pytest.mark.gpu
def test_grouped_mm_bf16_gpu_matches_fp32(poison_cuda):
    problem = make_problem(4096, 2048, 768, 128, 8, "random", dtype=torch.bfloat16, device="cuda")
    assert_close_to_reference(run_with_grads(reference.moe_grouped_mm, *problem), problem)


@pytest.mark.gpu
def test_grouped_mm_gpu_handles_tiny_and_empty_groups(poison_cuda):
    """Group sizes like [3, 17, 0, 45] (docs/FACTS.md: `_grouped_mm` was seen failing on these)."""
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 17, 0, 45]
    idx = torch.cat([torch.full((n,), e) for e, n in enumerate(sizes)])[torch.randperm(65, generator=gen)]
    problem = list(make_problem(65, 64, 32, 4, 1, "random", dtype=torch.bfloat16, device="cuda"))
    problem[1] = idx[:, None].cuda()
    assert_close_to_reference(run_with_grads(reference.moe_grouped_mm, *problem), problem)


@pytest.mark.gpu
def test_matches_hugging_face_qwen3_moe_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    import megamoe

    cfg = transformers.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16,
                                      num_experts_per_tok=4, norm_topk_prob=True)
    torch.manual_seed(0)
    block = hf.Qwen3MoeSparseMoeBlock(cfg).cuda().float()
    layer = megamoe.MegaMoE(256, 128, 16, 4, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
        layer.gate.weight.copy_(block.gate.weight)
        layer.w13.copy_(block.experts.gate_up_proj)
        layer.w2.copy_(block.experts.down_proj)
    x = torch.randn(2, 37, 256, device="cuda")
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(layer(x), out, rtol=1e-4, atol=1e-5)
