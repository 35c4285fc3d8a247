"""The FP8 blockwise Gluon kernels (``megamoe.kernels.gluon_fp8_sm90``): on an H200 against a float64 torch
computation of the same blockwise-dequantised math (``-m gpu``), and on any machine that both compile for
sm_90a without spills (ahead of time, in a subprocess: the CPU test session runs Triton's interpreter).

Two kinds of data. "random": normal values, quantised by the FP8 path's formula (``quantize``); the
tensor cores accumulate each 128-wide FP8 block at reduced precision, so results are compared norm-wise.
"exact": values in {0, ±1, ±2} times a power of two per scale group, with every group's amax reached, so
that quantisation gives the codes ±224 / ±448 exactly and every block's MMA is exact at any accumulator
precision; the kernel then differs from the float64 reference only by fp32 rounding, and its FP8 h must
match the reference's quantisation byte for byte (but for values within fp32 rounding of a tie).
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import (
    assert_launches_pass_parameters,
    capture_launches,
    check_block_trace,
    skewed_expert_rows,
)

FP8_MAX = 448.0
GROUP = 128


def quantize(v: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 path's quantisation of fp32 ``v`` (..., n) in groups of ``group`` along the last dim: amax =
    max(max|v|, 1e-12), q = fp8(clamp(v * (448 / amax), ±448)) (round to nearest even), scale = amax / 448
    (IEEE fp32 divisions). Returns q (..., n) float8_e4m3fn and the scales (..., n // group) fp32."""
    g = v.float().reshape(*v.shape[:-1], v.shape[-1] // group, group)
    amax = g.abs().amax(-1).clamp_min(1e-12)
    inv = torch.full_like(amax, FP8_MAX) / amax
    q = (g * inv[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(v.shape), amax / FP8_MAX


def quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (M, K) -> a_q (M, K) fp8 and a_s (K // 128, M) fp32 (k-block-major)."""
    q, s = quantize(a)
    return q, s.t().contiguous()


def quantize_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (E, N, K) -> w_q (E, N, K) fp8 and w_s (E, N // 128, K // 128) fp32, one scale per 128 x 128
    block (the group formula over the block's 16 384 values)."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n // GROUP, GROUP, k // GROUP, GROUP).permute(0, 1, 3, 2, 4)
    q, s = quantize(blocks.reshape(e, n // GROUP, k // GROUP, GROUP * GROUP), GROUP * GROUP)
    s = s.squeeze(-1)
    q = q.reshape(e, n // GROUP, k // GROUP, GROUP, GROUP).permute(0, 1, 3, 2, 4).reshape(e, n, k)
    return q.contiguous(), s.contiguous()


def dequant_rows(a_q, a_s):
    return a_q.double() * a_s.t().double().repeat_interleave(GROUP, dim=1)


def dequant_weights(w_q, w_s):
    return w_q.double() * w_s.double().repeat_interleave(GROUP, dim=1).repeat_interleave(GROUP, dim=2)


def make_data(shape, kind: str, gen: torch.Generator, group_dims: int = 1) -> torch.Tensor:
    """fp32 data of ``shape`` on the GPU. "random": normal. "exact": {0, ±1, ±2} times 2^j (j in [-3, 3])
    per scale group, with one ±2 per group (the group: 128 along the last dim, ``group_dims`` = 2: 128 x 128
    over the last two dims, the weights' blocks)."""
    if kind == "random":
        return torch.randn(shape, generator=gen).cuda()
    v = torch.randint(-2, 3, shape, generator=gen).float()
    if group_dims == 1:
        v[..., ::GROUP] = 2.0
        j = torch.randint(-3, 4, (*shape[:-1], shape[-1] // GROUP), generator=gen).float()
        v = v * torch.exp2(j).repeat_interleave(GROUP, dim=-1)
    else:
        v[..., ::GROUP, ::GROUP] = 2.0
        j = torch.randint(-3, 4, (*shape[:-2], shape[-2] // GROUP, shape[-1] // GROUP), generator=gen).float()
        v = v * torch.exp2(j).repeat_interleave(GROUP, dim=-2).repeat_interleave(GROUP, dim=-1)
    return v.cuda()


def make_routing(num_tokens: int, num_experts: int, top_k: int, routing: str, gen: torch.Generator):
    """topk_idx (T, top_k) int64 on the GPU: "random" (distinct experts per token), "empty" (experts 3.. get
    no tokens), "one" (every slot to the last expert), "dropped" (random, 30% of the slots -1: the sorted rows past
    the routed count exist and must be neither read nor written)."""
    if routing not in ("random", "empty", "one", "dropped"):
        raise ValueError(f"routing {routing!r}")
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if routing == "empty":
        scores[:, 3:] -= 2.0
    topk_idx = scores.topk(top_k, dim=1).indices
    if routing == "one":
        topk_idx[:] = num_experts - 1
    if routing == "dropped":
        topk_idx = topk_idx.masked_fill(torch.rand(num_tokens, top_k, generator=gen) < 0.3, -1)
    return topk_idx.cuda()


def build(topk_idx, num_experts):
    from megamoe.kernels.plan import build_plan

    plan = build_plan(topk_idx, num_experts)
    offsets = plan.offsets_E1.tolist()
    return plan, offsets


def rows_reference(a_q, a_s, w_q, w_s, offsets) -> torch.Tensor:
    """(routed rows, N) float64: each sorted row's dequantised product with its expert's weight."""
    a = dequant_rows(a_q, a_s)
    w = dequant_weights(w_q, w_s)
    return torch.cat([a[offsets[e]:offsets[e + 1]] @ w[e].t() for e in range(len(offsets) - 1)])


def rel_err(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# (T, E, top_k, D, I, routing): a few thousand tokens; E a power of two and not; experts without tokens; one
# expert taking every row (a long run of full tiles and one partial); one K-block (D = 128) and five (I = 640: the
# issue-ahead loop's odd block, then its two-block body once and its last pair).
GPU_CASES = [
    (1024, 4, 2, 128, 640, "random"),
    (2048, 8, 2, 256, 256, "random"),
    (3000, 5, 2, 512, 384, "random"),
    (1500, 8, 8, 256, 384, "random"),
    (2500, 8, 2, 512, 256, "empty"),
    (2000, 5, 2, 256, 384, "one"),
    (2600, 6, 3, 256, 384, "dropped"),
]
# Bound on the bf16 output's rounding, relative and norm-wise (2^-9 per element at most): added to the 1e-3
# allowed for the FP8 accumulation where the output is bf16.
BF16_ROUNDING = 2.0 ** -9


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("kind", ["random", "exact"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,dim,inter,routing",
                         GPU_CASES + [(1024, 4, 2, 128, 256, "random")])  # (dh' of one K-step in 256 columns)
def test_fp8_rows_gemm(num_tokens, num_experts, top_k, dim, inter, routing, kind, block_n):
    """The down projection (h (N, I) x W2 (E, D, I), weighted, to slots) and dh' (dy (N, D) x W2ᵀ as (E, I, D),
    sorted rows, unweighted), in blocks of 128 columns and of 256 (the GEMMs whose N is a multiple of 256)."""
    from megamoe.kernels.gluon_fp8_sm90 import fp8_rows_gemm_ws

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(num_tokens + dim + inter)
    topk_idx = make_routing(num_tokens, num_experts, top_k, routing, gen)
    plan, offsets = build(topk_idx, num_experts)
    rows = num_tokens * top_k
    routed = offsets[-1]
    row_slot = plan.row_slot_N[:routed].long()
    weights = torch.rand(rows, generator=gen).cuda()
    gemms = [(k, n, weighted, to_slots) for k, n, weighted, to_slots in ((inter, dim, True, True),
                                                                           (dim, inter, False, False))
             if n % block_n == 0]
    if not gemms:
        pytest.skip(f"neither N ({dim}, {inter}) is a multiple of {block_n}")
    for k_dim, n_out, weighted, to_slots in gemms:
        a_q, a_s = quantize_rows(make_data((rows, k_dim), kind, gen))
        w_q, w_s = quantize_weights(make_data((num_experts, n_out, k_dim), kind, gen, group_dims=2) / 16)
        out = torch.full((rows, n_out), float("nan"), device="cuda", dtype=torch.bfloat16)
        fp8_rows_gemm_ws(a_q, a_s, w_q, w_s, out, plan, weights=weights if weighted else None, to_slots=to_slots,
                         block_n=block_n)
        torch.cuda.synchronize()
        ref = rows_reference(a_q, a_s, w_q, w_s, offsets)
        if weighted:
            ref = ref * weights[row_slot].double()[:, None]
        got = out[row_slot] if to_slots else out[:routed]
        assert torch.isfinite(got).all(), "a routed row was not written"
        err = rel_err(got, ref)
        assert err <= 1e-3 + BF16_ROUNDING, (k_dim, n_out, err)
        if kind == "exact":  # exact MMAs: only fp32 promotion and the bf16 rounding
            assert err <= BF16_ROUNDING, (k_dim, n_out, err)
        if not to_slots:  # rows past the routed count are not written
            assert torch.isnan(out[routed:].float()).all()
        else:  # nor the rows of dropped slots
            kept = torch.zeros(rows, dtype=torch.bool, device="cuda")
            kept[row_slot] = True
            assert torch.isnan(out[~kept].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "exact"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,dim,inter,routing", GPU_CASES)
@pytest.mark.parametrize("preact", [False, True])
def test_fp8_up_swiglu(num_tokens, num_experts, top_k, dim, inter, routing, kind, preact):
    """h = silu(x W1gᵀ) * (x W1uᵀ) over the tokens' sorted rows, quantised per row and 128 columns."""
    from megamoe.kernels.gluon_fp8_sm90 import fp8_up_swiglu_ws

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(num_tokens * 3 + dim + inter)
    topk_idx = make_routing(num_tokens, num_experts, top_k, routing, gen)
    plan, offsets = build(topk_idx, num_experts)
    rows = num_tokens * top_k
    routed = offsets[-1]
    x_q, x_s = quantize_rows(make_data((num_tokens, dim), kind, gen))
    w13_q, w13_s = quantize_weights(make_data((num_experts, 2 * inter, dim), kind, gen, group_dims=2) / 16)
    h_q = torch.full((rows, inter), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    h_s = torch.full((inter // GROUP, rows), float("nan"), device="cuda")
    pre = torch.full((rows, 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16) if preact else None
    fp8_up_swiglu_ws(x_q, x_s, w13_q, w13_s, h_q, h_s, plan, top_k, preact=pre)
    torch.cuda.synchronize()

    tokens = plan.row_slot_N[:routed].long() // top_k
    x_rows = dequant_rows(x_q, x_s)[tokens]
    w13 = dequant_weights(w13_q, w13_s)
    gu = torch.cat([x_rows[offsets[e]:offsets[e + 1]] @ w13[e].t() for e in range(num_experts)])
    g, u = gu[:, :inter], gu[:, inter:]
    h = torch.nn.functional.silu(g) * u
    ref_q, ref_s = quantize(h.float())
    got_q, got_s = h_q[:routed], h_s[:, :routed].t()
    assert torch.isfinite(got_s).all(), "a routed row's scale was not written"

    # Norm-wise: the scales to 1e-3, the dequantised h to the reference h within FP8's rounding (2^-4 per
    # element at most, about 2.5% norm-wise) plus 1e-3.
    assert rel_err(got_s, ref_s) <= 1e-3
    deq = got_q.double() * got_s.double().repeat_interleave(GROUP, dim=1)
    assert rel_err(deq, h) <= 0.04
    same = (got_q.view(torch.uint8) == ref_q.view(torch.uint8)).double().mean().item()
    assert same >= 0.98, same
    # Bytes: h on the kernel's own scales, t = h / s (float64 reference), rounds to the kernel's code except where
    # t lies within the kernel's error of a rounding midpoint: its fp32 h (exp through ex2.approx) differs from
    # float64 by ~1e-7 relative for the exact data (whose few distinct values repeat, so one tie decides many
    # bytes: 0.4% of them in one case), and by the tensor cores' FP8 accumulation for the random data: an error
    # relative to the row's sums, not to a small value that cancelled (1% of the bytes moved on the H200), so
    # bounded against the row's largest, 448: 2^-9 of it.
    t = (h / got_s.double().repeat_interleave(GROUP, dim=1)).clamp(-FP8_MAX, FP8_MAX)
    near = t.float().to(torch.float8_e4m3fn).double()
    off = got_q.double() != near
    tie = (t - (got_q.double() + near) / 2).abs() <= (2.0**-20 * t.abs() if kind == "exact" else 2.0**-9 * FP8_MAX)
    assert bool((tie | ~off).all()), f"{int((off & ~tie).sum())} bytes off the reference away from a tie"
    if kind == "exact":
        assert rel_err(got_s, ref_s) <= 1e-6
    if preact:
        assert rel_err(pre[:routed].float(), gu) <= 1e-3 + BF16_ROUNDING
        assert torch.isnan(pre[routed:].float()).all()
    assert torch.isnan(h_s[:, routed:]).all()  # rows past the routed count are not written


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,num_experts,top_k,dim,inter,routing", GPU_CASES)
def test_fp8_up_products_only_are_the_full_kernels_products(num_tokens, num_experts, top_k, dim, inter, routing):
    """Without h (``h_q = h_s = None``: the FP8 backward's recompute) the up kernel writes the products bit for bit
    as the kernel that also writes h, and only the routed rows."""
    from megamoe.kernels.gluon_fp8_sm90 import fp8_up_swiglu_ws

    gen = torch.Generator().manual_seed(num_tokens * 7 + dim + inter)
    topk_idx = make_routing(num_tokens, num_experts, top_k, routing, gen)
    plan, offsets = build(topk_idx, num_experts)
    rows, routed = num_tokens * top_k, offsets[-1]
    x_q, x_s = quantize_rows(make_data((num_tokens, dim), "random", gen))
    w13_q, w13_s = quantize_weights(make_data((num_experts, 2 * inter, dim), "random", gen, group_dims=2) / 16)
    h_q = torch.empty(rows, inter, device="cuda", dtype=torch.float8_e4m3fn)
    h_s = torch.empty(inter // GROUP, rows, device="cuda")
    full, alone = (torch.full((rows, 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fp8_up_swiglu_ws(x_q, x_s, w13_q, w13_s, h_q, h_s, plan, top_k, preact=full)
    fp8_up_swiglu_ws(x_q, x_s, w13_q, w13_s, None, None, plan, top_k, preact=alone)
    torch.cuda.synchronize()
    assert torch.isfinite(full[:routed].float()).all()
    assert torch.equal(alone[:routed], full[:routed]) and torch.isnan(alone[routed:].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,num_experts,top_k,dim,inter,routing",
                         GPU_CASES + [(4096, 128, 8, 256, 256, "random")])  # (many blocks per program, 2 K-steps each)
@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("b_scales", ["tile", "layer", "expert"])
def test_fp8_wgrad(num_tokens, num_experts, top_k, dim, inter, routing, block_n, b_scales):
    """The FP8 weight gradients: dW13 = dzᵀ x and dW2 = dyᵀ (h·w) shapes, (N, P) and (N, Q) sorted bf16 rows
    quantised 128x1 per plan tile (``quant.quantize_tile_cols``, bit for bit the reference's on CPU), against the
    float64 per-expert products of the dequantised operands; experts without rows get zeros. The sorted rows span six
    decades (neighbouring tiles' scales 1.2-2.4x apart) and a column of each operand is zero over the first 128 rows
    (an all-zero group: the floor scale). Both block widths; a width that does not divide Q is refused. ``b_scales``:
    B's scales per tile (the recipe), or its expert's in every tile, from one column amax over all the rows or one per
    expert (``quantize_tile_cols``' ``col_amax``; the kernel's ``b_const``)."""
    from megamoe import reference
    from megamoe.kernels.gluon_fp8_sm90 import fp8_wgrad_ws
    from megamoe.kernels.quant import (
        channel_amax,
        expert_channel_amax,
        quantize_tile_cols,
    )

    gen = torch.Generator().manual_seed(num_tokens * 5 + dim + inter)
    topk_idx = make_routing(num_tokens, num_experts, top_k, routing, gen)
    plan, offsets = build(topk_idx, num_experts)
    rows = num_tokens * top_k
    for p, q in ((2 * inter, dim), (dim, inter)):
        decades = torch.logspace(-3, 3, rows, device="cuda")[:, None]
        a = (make_data((rows, p), "random", gen) * decades).to(torch.bfloat16)
        b = (make_data((rows, q), "random", gen) * decades.flip(0)).to(torch.bfloat16)
        a[:128, 7] = 0.0
        b[:128, 3] = 0.0
        a[offsets[-1]:] = float("nan")  # dropped slots' rows: never read
        b_amax = None
        if b_scales == "layer":
            b_amax = channel_amax(b[:offsets[-1]])
        elif b_scales == "expert":
            b_amax = expert_channel_amax(b, plan)
        (aq, a_s), (bq, b_s) = quantize_tile_cols(a, plan), quantize_tile_cols(b, plan, col_amax=b_amax)
        out = torch.full((num_experts, p, q), float("nan"), device="cuda", dtype=torch.bfloat16)
        if q % block_n:
            with pytest.raises(ValueError, match="block_n"):
                fp8_wgrad_ws(aq, a_s, bq, b_s, out, plan.offsets_E1, block_n, b_const=b_amax is not None)
            continue
        fp8_wgrad_ws(aq, a_s, bq, b_s, out, plan.offsets_E1, block_n, b_const=b_amax is not None)
        torch.cuda.synchronize()
        cpu_offsets = plan.offsets_E1.cpu()
        ref = torch.stack([ae @ be.t() for ae, be in zip(reference.dequantize_tile_cols(aq.cpu(), a_s.cpu(), cpu_offsets),
                                                         reference.dequantize_tile_cols(bq.cpu(), b_s.cpu(), cpu_offsets))])
        assert torch.isfinite(out).all(), "a block was not written"
        err = rel_err(out.cpu(), ref)
        assert err <= 1e-3 + BF16_ROUNDING, (p, q, err)
        empty = [e for e in range(num_experts) if offsets[e] == offsets[e + 1]]
        assert (out[empty] == 0).all()


@pytest.mark.gpu
def test_fp8_up_swiglu_power_of_two_scales():
    """With ``env.set_fp8_scales("pow2")`` the kernel's h scales are its fp32-scale run's rounded up to a power of
    two (the same products and amax), and its bytes h times their exact inverse, rounded (within the ties that
    differ between the two scalings)."""
    from megamoe import env
    from megamoe.kernels.gluon_fp8_sm90 import fp8_up_swiglu_ws

    gen = torch.Generator().manual_seed(11)
    num_tokens, num_experts, top_k, dim, inter = 1500, 8, 4, 256, 384
    plan, offsets = build(make_routing(num_tokens, num_experts, top_k, "random", gen), num_experts)
    routed = offsets[-1]
    x_q, x_s = quantize_rows(make_data((num_tokens, dim), "random", gen))
    w13_q, w13_s = quantize_weights(make_data((num_experts, 2 * inter, dim), "random", gen, group_dims=2) / 16)
    runs = []
    for kind in ("fp32", "pow2"):
        h_q = torch.empty(num_tokens * top_k, inter, device="cuda", dtype=torch.float8_e4m3fn)
        h_s = torch.empty(inter // GROUP, num_tokens * top_k, device="cuda")
        env.set_fp8_scales(kind)
        try:
            fp8_up_swiglu_ws(x_q, x_s, w13_q, w13_s, h_q, h_s, plan, top_k)
        finally:
            env.set_fp8_scales("fp32")
        runs.append((h_q[:routed].float().cpu().double(), h_s[:, :routed].t().cpu()))
    (q32, s32), (q2, s2) = runs
    mantissa, exponent = torch.frexp(s32)
    assert torch.equal(s2, torch.ldexp(torch.ones_like(s32), torch.where(mantissa == 0.5, exponent - 1, exponent)))
    h = q32 * s32.double().repeat_interleave(GROUP, dim=1)  # h as the fp32-scale run holds it (within its rounding)
    deq = q2 * s2.double().repeat_interleave(GROUP, dim=1)
    assert rel_err(deq, h) <= 0.04


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["rows128", "rows256", "up", "wgrad128", "wgrad256"])
def test_fp8_gemm_traced_is_bitwise_the_untraced_and_stamps_every_block(kernel):
    """The block trace (``trace=``) changes no output bit, and every program's partitions stamp each of their blocks
    in time order: the sorted-rows kernel in blocks of 128 and 256 columns, the up kernel, the weight gradients in
    both block widths (an expert without rows among them)."""
    from megamoe.kernels import gluon_fp8_sm90 as f
    from megamoe.kernels import gluon_sm90 as g
    from megamoe.kernels.quant import quantize_tile_cols
    from tools.block_trace import WARPGROUPS

    gen = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, dim, inter = 2048, 16, 4, 512, 256
    # the weight gradients' tokens routed among all experts but the last (its blocks: zeros, no K-steps)
    topk_idx = make_routing(num_tokens, num_experts - kernel.startswith("wgrad"), top_k, "random", gen)
    plan, offsets = build(topk_idx, num_experts)
    rows = num_tokens * top_k
    busy_tiles = sum(-(-(hi - lo) // 128) for lo, hi in itertools.pairwise(offsets))
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.full((g.trace_size(programs),), -1, device="cuda", dtype=torch.int64)
    outs = []
    if kernel.startswith("rows"):
        block_n = int(kernel[4:7])
        a_q, a_s = quantize_rows(make_data((rows, inter), "random", gen))
        w_q, w_s = quantize_weights(make_data((num_experts, dim, inter), "random", gen, group_dims=2) / 16)
        weights = torch.rand(rows, generator=gen).cuda()
        for tr in (None, trace):
            outs.append((torch.zeros(rows, dim, device="cuda", dtype=torch.bfloat16), ))
            f.fp8_rows_gemm_ws(a_q, a_s, w_q, w_s, outs[-1][0], plan, weights=weights, to_slots=True, block_n=block_n,
                               trace=tr)
        num_blocks = busy_tiles * (dim // block_n)
    elif kernel.startswith("wgrad"):  # dW13's shape: (2I, D) per expert
        block_n = int(kernel[5:8])
        a_q, a_s = quantize_tile_cols(make_data((rows, 2 * inter), "random", gen).to(torch.bfloat16), plan)
        b_q, b_s = quantize_tile_cols(make_data((rows, dim), "random", gen).to(torch.bfloat16), plan)
        for tr in (None, trace):
            outs.append((torch.zeros(num_experts, 2 * inter, dim, device="cuda", dtype=torch.bfloat16), ))
            f.fp8_wgrad_ws(a_q, a_s, b_q, b_s, outs[-1][0], plan.offsets_E1, block_n, trace=tr)
        num_blocks = num_experts * (2 * inter // 128) * (dim // block_n)
    else:
        x_q, x_s = quantize_rows(make_data((num_tokens, dim), "random", gen))
        w13_q, w13_s = quantize_weights(make_data((num_experts, 2 * inter, dim), "random", gen, group_dims=2) / 16)
        for tr in (None, trace):
            outs.append((torch.zeros(rows, inter, device="cuda", dtype=torch.float8_e4m3fn),
                         torch.zeros(inter // 128, rows, device="cuda", dtype=torch.float32)))
            f.fp8_up_swiglu_ws(x_q, x_s, w13_q, w13_s, *outs[-1], plan, top_k, trace=tr)
        outs = [(h_q.view(torch.uint8), h_s) for h_q, h_s in outs]
        num_blocks = busy_tiles * (inter // 128)
    assert all(map(torch.equal, *outs))
    check_block_trace(trace, programs, num_blocks, WARPGROUPS)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [128, 256])
def test_fp8_wgrad_in_size_order_is_bitwise_the_same(block_n):
    """The FP8 weight gradients with their blocks dealt in order of their experts' rows (``by_size``) write every
    block, bitwise as in expert order: a skewed routing with experts without rows, 512 or 1 024 blocks over the SMs
    (full rounds dealt from alternate ends, then a partial one)."""
    from megamoe.kernels.gluon_fp8_sm90 import fp8_wgrad_ws
    from megamoe.kernels.quant import quantize_tile_cols

    gen = torch.Generator().manual_seed(block_n)
    num_experts, p, q = 64, 512, 512
    counts = skewed_expert_rows(num_experts, gen)
    plan, _ = build(torch.repeat_interleave(torch.arange(num_experts), counts)[:, None].cuda(), num_experts)
    rows = int(counts.sum())
    a_t = quantize_tile_cols(make_data((rows, p), "random", gen).to(torch.bfloat16), plan)
    b_t = quantize_tile_cols(make_data((rows, q), "random", gen).to(torch.bfloat16), plan)
    outs = []
    for by_size in (False, True):
        outs.append(torch.full((num_experts, p, q), float("nan"), device="cuda", dtype=torch.bfloat16))
        fp8_wgrad_ws(*a_t, *b_t, outs[-1], plan.offsets_E1, block_n, by_size=by_size)
    assert not outs[1].isnan().any()  # every block written (experts without rows: zeros)
    assert torch.equal(*outs)


# The AOT check runs in a subprocess: this test session runs Triton's interpreter (TRITON_INTERPRET=1 without a
# GPU), under which the compile path is replaced.
_AOT_SCRIPT = r"""
import json
import os
from concurrent.futures import ProcessPoolExecutor
from tools.resources import ptxas_report
from megamoe.kernels import gluon_fp8_sm90 as f
variants = {"rows_down": ("fp8_rows", dict(weighted=True, to_slots=True)),
            "rows_dh": ("fp8_rows", dict(weighted=False, to_slots=False)),
            "up": ("fp8_up", dict(preact=False)), "up_preact": ("fp8_up", dict(preact=True)),
            "rows_down_any_size": ("fp8_rows", dict(sizes_divisible=False)),
            "up_any_size": ("fp8_up", dict(sizes_divisible=False)), "wgrad": ("fp8_wgrad", {}),
            "wgrad_any_size": ("fp8_wgrad", dict(sizes_divisible=False)),
            "wide_wgrad": ("fp8_wgrad", dict(block_n=256)),
            "wgrad_b_const": ("fp8_wgrad", dict(b_const=True)),
            "wide_wgrad_b_const": ("fp8_wgrad", dict(block_n=256, b_const=True)),
            "up_pow2": ("fp8_up", dict(pow2=True)), "up_preact_pow2": ("fp8_up", dict(preact=True, pow2=True)),
            "up_products_only": ("fp8_up", dict(preact=True, h_out=False)),
            "rows_down_traced": ("fp8_rows", dict(trace=True)), "up_traced": ("fp8_up", dict(trace=True)),
            "wgrad_traced": ("fp8_wgrad", dict(trace=True)),
            "wide_wgrad_traced": ("fp8_wgrad", dict(block_n=256, trace=True)),
            "wgrad_by_size": ("fp8_wgrad", dict(by_size=True)),
            "wide_wgrad_by_size": ("fp8_wgrad", dict(block_n=256, by_size=True)),
            "wide_rows_down": ("fp8_rows", dict(block_n=256)),
            "wide_rows_dh": ("fp8_rows", dict(block_n=256, weighted=False, to_slots=False)),
            "tile_cols": ("fp8_tile_cols", {}), "tile_cols_pow2": ("fp8_tile_cols", dict(pow2=True))}
def report(item):
    kernel, kw = item
    return ptxas_report(f.aot_compile(kernel, **kw))
with ProcessPoolExecutor(os.cpu_count()) as pool:  # compiles side by side, one per core
    print(json.dumps(dict(zip(variants, pool.map(report, variants.values())))))
"""

# Register spills allowed per variant (bytes): the sorted-rows kernel's 256-column blocks with their stores deferred
# under their own chains (two accumulators, the temporary in flight and a half block being stored) ten and four
# registers; the up kernel's traced variant (the stamps' registers; no layer launches it) three.
_SPILLS_ALLOWED = {"wide_rows_down": 40, "wide_rows_dh": 16, "up_traced": 12}


def test_fp8_kernels_compile_for_sm90a_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    import json

    from megamoe.kernels import gluon_fp8_sm90 as f

    reports = json.loads(out.stdout.strip().splitlines()[-1])
    for name, r in reports.items():
        assert r["wgmma"] or name.startswith("tile_cols"), name  # (the tile-column quantiser has no MMA)
        assert not r["wgmma_serialized"], name  # the issue-ahead pattern is lost if ptxas waits out each MMA
        if not name.endswith("any_size"):  # (the launchers' sizes are multiples of 128: Triton specialises them)
            assert r["wide_stores"], name  # the epilogues convert to 16-byte row segments
        assert r["spill_bytes"] <= _SPILLS_ALLOWED.get(name, 0), (name, r)
        assert r["shared_bytes"] <= f.SHARED_MEMORY_LIMIT, (name, r)


def test_fp8_launchers_pass_each_kernel_exactly_its_parameters(monkeypatch):
    """Each Gluon FP8 launcher hands its kernel every parameter the kernel declares and no other, in each of its
    variants (a name gone from one side would fail only at a GPU launch), through TMA descriptors that Triton accepts
    (block shapes, strides): the launches captured on a CPU."""
    from megamoe.kernels import gluon_fp8_sm90 as f
    from megamoe.kernels import gluon_sm90 as g
    from megamoe.kernels.plan import build_plan

    launched = capture_launches(monkeypatch, f, ("rows_ws_kernel", "up_ws_kernel", "wgrad_ws_kernel",
                                                 "act_tile_cols_kernel", "tile_cols_kernel"))
    e4m3 = torch.float8_e4m3fn
    num_experts, rows, dim, inter = 4, 128, 256, 256
    plan = build_plan(torch.arange(rows).remainder(num_experts).view(-1, 2), num_experts)
    trace = torch.empty(g.trace_size(132), dtype=torch.int64)
    a_q, a_s = torch.zeros(rows, dim, dtype=e4m3), torch.zeros(dim // 128, rows)
    w_q, w_s = torch.zeros(num_experts, 512, dim, dtype=e4m3), torch.zeros(num_experts, 4, dim // 128)
    for block_n, weights, row_dest, tr in ((128, None, None, None), (256, torch.ones(rows), None, trace),
                                           (256, torch.ones(rows), torch.zeros(rows, dtype=torch.int64), None)):
        f.fp8_rows_gemm_ws(a_q, a_s, w_q, w_s, torch.zeros(rows, 512, dtype=torch.bfloat16), plan, weights=weights,
                           to_slots=True, row_dest=row_dest, block_n=block_n, trace=tr)
    w13_q, w13_s = torch.zeros(num_experts, 2 * inter, dim, dtype=e4m3), torch.zeros(num_experts, 4, dim // 128)
    h = torch.zeros(rows, inter, dtype=e4m3), torch.zeros(inter // 128, rows)
    for h_out, preact, tr in ((h, None, None), (h, torch.zeros(rows, 2 * inter, dtype=torch.bfloat16), trace),
                              ((None, None), torch.zeros(rows, 2 * inter, dtype=torch.bfloat16), None)):
        f.fp8_up_swiglu_ws(a_q[:rows // 2], a_s[:, :rows // 2], w13_q, w13_s, *h_out, plan, 2, preact, trace=tr)
    tiles = plan.tile_expert_NT.numel()
    cols = torch.zeros(512, tiles * 128, dtype=e4m3), torch.zeros(tiles, 512)
    for block_n, by_size, tr, b_const in ((128, False, None, False), (256, True, trace, False),
                                          (256, True, None, True)):
        f.fp8_wgrad_ws(*cols, *cols, torch.zeros(num_experts, 512, 512, dtype=torch.bfloat16), plan.offsets_E1,
                       block_n, by_size=by_size, trace=tr, b_const=b_const)
    preact, dh = torch.zeros(rows, 2 * inter, dtype=torch.bfloat16), torch.zeros(rows, inter, dtype=torch.bfloat16)
    dz_q, dz_s = torch.zeros(rows, 2 * inter, dtype=e4m3), torch.zeros(2 * inter // 128, rows)
    dz_t = torch.zeros(2 * inter, tiles * 128, dtype=e4m3), torch.zeros(tiles, 2 * inter)
    hw_t = torch.zeros(inter, tiles * 128, dtype=e4m3), torch.zeros(tiles, inter)
    f.fp8_act_tile_cols_ws(preact, dh, torch.ones(rows), plan, torch.zeros(inter // 64, rows), dz_q, dz_s, dz_t, hw_t,
                           64)
    for top_k in (None, 2):
        f.fp8_tile_cols_ws(preact, plan, top_k, *dz_t)
    assert_launches_pass_parameters(launched, 12)


def test_wgrad_block_n_defaults_where_it_divides_and_refuses_otherwise():
    from megamoe.kernels import gluon_fp8_sm90 as f

    assert f.wgrad_block_n(4096) == f.WGRAD_BLOCK_N
    assert f.wgrad_block_n(640) == 128  # (256 does not divide it)
    assert f.wgrad_block_n(768, 256) == 256 and f.wgrad_block_n(768, 128) == 128
    for q, block_n in ((640, 256), (1024, 64), (1024, 512)):
        with pytest.raises(ValueError, match="block_n"):
            f.wgrad_block_n(q, block_n)


def test_rows_block_n_defaults_where_it_divides_and_refuses_otherwise():
    from megamoe.kernels import gluon_fp8_sm90 as f

    assert f.rows_block_n(2048) == f.ROWS_BLOCK_N
    assert f.rows_block_n(640) == 128  # (256 does not divide it)
    assert f.rows_block_n(768, 256) == 256 and f.rows_block_n(768, 128) == 128
    for n_out, block_n in ((640, 256), (1024, 64), (1024, 512)):
        with pytest.raises(ValueError, match="block_n"):
            f.rows_block_n(n_out, block_n)
