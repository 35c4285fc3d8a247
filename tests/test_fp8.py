"""Blockwise FP8 (``precision="fp8"``): the quantisers bit for bit against ``reference.quantize_rows`` /
``quantize_weight``, the layer against the recipe computed in plain PyTorch (``reference.moe_loop_fp8``: tight,
the kernels must compute exactly that) and against the fp32 reference (flash-attention's rule, with the recipe's
own error as the measure), the weight cache, and the refusals.

What FP8 costs on its own: e4m3 keeps 3 mantissa bits, so one 1x128 quantisation of Gaussian data is ~2.5%
off in norm, and the layer's output and gradients ~5-7% (three chained quantised GEMMs); the tests bound the
kernels by that measured error, not by a fixed number. On CPU the Triton kernels run in the interpreter.
"""

import pytest
import torch

import megamoe
from megamoe import env, reference
from megamoe.api import backend_for
from megamoe.bench.layer import cuda_graphed
from megamoe.kernels import quant
from megamoe.kernels.plan import build_plan, plan_op
from tests.helpers import (
    NAMES,
    assert_close_to_reference,
    gpu_problem,
    interpreter_only,
    make_problem,
    run_with_grads,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The shape matrix of tests/helpers.py with D and I multiples of 128 (FP8's group and block edge).
FP8_SHAPES = [
    (1, 128, 128, 4, 2, "random"),      # a single token
    (5, 128, 128, 4, 2, "random"),      # T smaller than any tile
    (40, 128, 256, 6, 3, "random"),     # E not a power of two; two I-blocks (two 1x128 groups of h)
    (33, 256, 128, 8, 1, "random"),     # K = 1; two K-blocks (promotion across blocks)
    (17, 128, 128, 4, 4, "random"),     # K = E: every token visits every expert
    (29, 128, 128, 8, 2, "empty"),      # experts with no tokens
    (37, 128, 128, 5, 1, "one"),        # every token to one expert
    (31, 256, 256, 6, 3, "dropped"),    # dropped slots (-1)
    (150, 128, 128, 2, 2, "dropped"),   # several tiles per expert, a partial last tile
]
SAVE_MODES = ["none", "preact"]


def shape_id(s):
    return f"T{s[0]}-D{s[1]}-I{s[2]}-E{s[3]}-K{s[4]}-{s[5]}"


def fp8_moe(mode="none"):
    return lambda *a: megamoe.moe(*a, precision="fp8", save_for_backward=mode)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bits(t):
    return t.view(torch.uint8) if t.dtype == quant.FP8 else t


def busy_tiles(plan) -> int:
    """The plan's busy tiles: the tile columns a quantiser writes (the idle tiles' are never written)."""
    return int(sum(-(-c // 128) for c in (plan.offsets_E1[1:] - plan.offsets_E1[:-1]).tolist()))


@pytest.fixture(params=["fp32", "pow2"])
def scales(request):
    """Each kind of FP8 scale in turn (``env.set_fp8_scales``), back to the default afterwards."""
    env.set_fp8_scales(request.param)
    yield request.param
    env.set_fp8_scales("fp32")


def assert_scale_kind(s: torch.Tensor, kind: str) -> None:
    """With power-of-two scales every scale is one (frexp's mantissa 0.5); with fp32 ones some are not."""
    pow2 = torch.frexp(s.float().cpu()).mantissa == 0.5
    assert pow2.all() if kind == "pow2" else not pow2.all()


def test_quantize_rows_matches_reference_bit_for_bit(scales):
    gen = torch.Generator().manual_seed(0)
    # Rows over 12 decades (e4m3 normal and subnormal values), an all-zero row, exact ties of the rounding.
    a = torch.randn(70, 384, generator=gen) * torch.logspace(-6, 6, 70)[:, None]
    a[3] = 0.0
    a[5, :128] = torch.tensor([1.0625, -1.1875, 3 * 2.0**-10, 448.0, -0.0] * 25 + [2.0, 4.0, 8.0])
    q, s = quant.quantize_rows(a.to(DEVICE))
    qr, sr = reference.quantize_rows(a)
    assert q.shape == (70, 384) and s.shape == (3, 70)
    assert torch.equal(bits(q).cpu(), bits(qr)) and torch.equal(s.cpu(), sr)
    assert_scale_kind(s, scales)
    deq = reference.dequantize_rows(q.cpu(), s.cpu())
    half_ulp = torch.maximum(a.abs() * 2.0**-4, s.cpu().t().repeat_interleave(128, 1) * 2.0**-10)
    assert ((deq - a).abs() <= half_ulp).all()


@pytest.mark.parametrize("dim", [128, 384, 640])  # one column block; one with a masked group; a second block
def test_sorting_dy_quantises_its_rows_as_quantize_rows_does(dim, scales):
    """The backward's gather quantises dy once per token beside its sorted bf16 copy: the e4m3 rows and scales are
    bit for bit ``quantize_rows`` of the sorted copy (dropped slots: unwritten, as there), the copies unchanged; so
    are ``sorted_quantized_rows``', which copies each token's quantised row without a bf16 copy."""
    from megamoe.kernels.expert_bwd import gather_rows, sorted_quantized_rows
    from megamoe.kernels.plan import build_plan

    x, idx, _, _, _, dy = make_problem(37, dim, 128, 6, 3, "dropped", dtype=torch.bfloat16, device=DEVICE)
    dy = dy * torch.logspace(-6, 6, 37, device=DEVICE)[:, None].to(dy.dtype)  # e4m3 normal and subnormal values
    dy[4] = 0.0
    plan = build_plan(idx, 6)
    routed = int(plan.offsets_E1[-1])
    x_sorted, dy_sorted = gather_rows(x, dy, plan, 3)
    x_q_pass, dy_q_pass, dyq, dys = gather_rows(x, dy, plan, 3, quantize_dy=True)
    assert torch.equal(x_q_pass[:routed], x_sorted[:routed]) and torch.equal(dy_q_pass[:routed], dy_sorted[:routed])
    q_ref, s_ref = quant.quantize_rows(dy_sorted[:routed])
    assert dyq.shape == (idx.numel(), dim) and dys.shape == (dim // 128, idx.numel())
    assert torch.equal(bits(dyq[:routed]), bits(q_ref)) and torch.equal(dys[:, :routed], s_ref)
    assert_scale_kind(dys[:, :routed], scales)
    # Quantised per token and then copied (the FP8 weight gradients' backward, which sorts no bf16 rows): the same.
    dyq_copied, dys_copied = sorted_quantized_rows(dy, plan, 3)
    assert dyq_copied.shape == dyq.shape and dys_copied.shape == dys.shape
    assert torch.equal(bits(dyq_copied[:routed]), bits(q_ref)) and torch.equal(dys_copied[:, :routed], s_ref)


def test_quantize_tile_cols_refuses_a_partial_column_block():
    """A column count that is not a multiple of the quantiser's block would leave the last columns unwritten: it is
    refused, naming the multiple."""
    from megamoe.kernels.plan import build_plan

    x, idx, _, _, _, _ = make_problem(64, quant.TILE_COLS_BC + 64, 128, 4, 2, "random", dtype=torch.bfloat16,
                                      device=DEVICE)
    with pytest.raises(ValueError, match=f"multiple of {quant.TILE_COLS_BC} columns"):
        quant.quantize_tile_cols(x, build_plan(idx, 4), top_k=2)


@pytest.mark.parametrize("routing", ["random", "dropped"])
def test_quantize_tile_cols_reads_the_tokens_rows_as_their_sorted_copy(routing, scales):
    """``quantize_tile_cols(x, plan, top_k)`` reads each sorted row from its token: bit for bit the quantisation of
    the sorted copy (``gather_rows``), the routed tiles' bytes and scales (dropped slots are in no tile)."""
    from megamoe.kernels.expert_bwd import gather_rows
    from megamoe.kernels.plan import build_plan

    x, idx, _, _, _, dy = make_problem(300, 128, 128, 6, 3, routing, dtype=torch.bfloat16, device=DEVICE)
    x = x * torch.logspace(-6, 6, 300, device=DEVICE)[:, None].to(x.dtype)  # e4m3 normal and subnormal values
    plan = build_plan(idx, 6)
    busy = busy_tiles(plan)
    x_sorted, dy_sorted = gather_rows(x, dy, plan, 3)
    for tokens, sorted_rows in ((x, x_sorted), (dy, dy_sorted)):
        q, s = quant.quantize_tile_cols(tokens, plan, top_k=3)
        q_ref, s_ref = quant.quantize_tile_cols(sorted_rows, plan)
        assert torch.equal(bits(q[:, :busy * 128]), bits(q_ref[:, :busy * 128]))
        assert torch.equal(s[:busy], s_ref[:busy])
        assert_scale_kind(s[:busy], scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_weight_both_orientations_match_reference_bit_for_bit(dtype, scales):
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(3, 256, 384, generator=gen) * torch.logspace(-3, 1, 3)[:, None, None]).to(dtype)
    w[1, :128, 128:256] = 0.0  # an all-zero block
    out = quant.quantize_weight(w.to(DEVICE))
    ref = reference.quantize_weight(w)
    for name, o, r in zip(("q", "s", "qt", "st"), out, ref):
        assert torch.equal(bits(o).cpu(), bits(r)), name
    q, s, qt, st = (t.cpu() for t in out)
    assert torch.equal(bits(qt), bits(q.transpose(1, 2).contiguous())) and torch.equal(st, s.transpose(1, 2))
    assert_scale_kind(s, scales)
    assert rel_err(reference.dequantize_weight(q, s), w) < 0.03


# Rows per expert of the weight gradients' tile-column tests: none, one, a partial tile, one full tile, a full tile
# and a one-row tile, several tiles with a partial last one.
WGRAD_COUNTS = [0, 1, 127, 128, 129, 300]
WGRAD_UNROUTED = 15  # rows past the routed ones (dropped slots' rows, never written): NaN, and never read


def wgrad_rows(cols: int, gen: torch.Generator, decades: float = 0.0) -> torch.Tensor:
    """(routed + unrouted rows, cols) of normal values, scaled over ``decades`` down the rows (within a 128x1 group
    the largest rows set the scale and the smallest go subnormal or to zero); the unrouted rows NaN."""
    n = sum(WGRAD_COUNTS) + WGRAD_UNROUTED
    a = torch.randn(n, cols, generator=gen) * torch.logspace(-decades / 2, decades / 2, n)[:, None]
    a[sum(WGRAD_COUNTS):] = float("nan")
    return a


def wgrad_plan():
    from megamoe.kernels.plan import plan_from_counts

    return plan_from_counts(torch.tensor(WGRAD_COUNTS, dtype=torch.int32, device=DEVICE),
                            sum(WGRAD_COUNTS) + WGRAD_UNROUTED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the layer's rows
def test_quantize_tile_cols_matches_reference_bit_for_bit(dtype, scales):
    """128x1 groups along the tokens, one per plan tile (never across two experts) and column: the kernel's bytes
    and scales equal the reference's; the dequantised values are the rows' within e4m3's half step, and the
    columns of a tile past its expert's end are zeros."""
    gen = torch.Generator().manual_seed(4)
    a = wgrad_rows(256, gen, decades=12.0)
    a[128:256, 7] = 0.0  # an all-zero group (expert 3's one tile)
    a[256:384, 9] = torch.tensor([1.0625, -1.1875, 3 * 2.0**-10, 448.0, -0.0] * 25 + [2.0, 4.0, 8.0])  # ties
    a = a.to(dtype)
    plan = wgrad_plan()
    q, s = quant.quantize_tile_cols(a.to(DEVICE), plan)
    offsets = plan.offsets_E1.cpu()
    qr, sr = reference.quantize_tile_cols(a, offsets)
    busy = sr.shape[0]
    assert busy == sum(-(-c // 128) for c in WGRAD_COUNTS)
    assert q.shape == (256, plan.tile_expert_NT.numel() * 128) and s.shape == (plan.tile_expert_NT.numel(), 256)
    assert torch.equal(bits(q[:, :busy * 128]).cpu(), bits(qr)) and torch.equal(s[:busy].cpu(), sr)
    assert_scale_kind(s[:busy], scales)
    # The format: column 128 t + i of q is sorted row tile_row[t] + i of the tile's expert, zero past its end.
    tile_row, tile_expert = plan.tile_row_NT[:busy].cpu().long(), plan.tile_expert_NT[:busy].cpu().long()
    rows = tile_row[:, None] + torch.arange(128)  # (busy, 128)
    inside = rows < offsets[tile_expert + 1].long()[:, None]
    values = a[rows.clamp_max(a.shape[0] - 1)].permute(2, 0, 1).float()  # (C, busy, 128)
    expect = torch.where(inside[None], values, 0.0)
    deq = qr.float().reshape(256, busy, 128) * sr.t()[:, :, None]
    half_step = torch.maximum(expect.abs() * 2.0**-4, sr.t()[:, :, None] * 2.0**-10)
    assert ((deq - expect).abs() <= half_step).all()
    assert (bits(qr).reshape(256, busy, 128)[:, ~inside] == 0).all()
    # Written into memory handed over (``over``) where it is large enough, else into new memory: the same bytes
    need = q.numel() + 4 * s.numel()
    for size, inside_over in ((need // 2, True), (need // 2 - 1, False)):
        over = torch.full((size,), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        q2, s2 = quant.quantize_tile_cols(a.to(DEVICE), plan, over=over)
        assert (q2.data_ptr() == over.data_ptr()) is inside_over
        assert (s2.data_ptr() == over.data_ptr() + q.numel()) is inside_over
        assert torch.equal(bits(q2[:, :busy * 128]), bits(q[:, :busy * 128])) and torch.equal(s2[:busy], s[:busy])


@interpreter_only("tests/test_gluon_fp8.py::test_fp8_wgrad")
def test_fp8_wgrad_gemm_computes_the_dequantised_products():
    """dW[e] = sum over expert e's tiles of deq(a)ᵀ deq(b) (the Triton kernel: exact products, fp32 sums and
    promotion); an expert without rows gets exact zeros, and the NaN rows past the routed ones reach nothing."""
    from megamoe.kernels import expert_bwd

    gen = torch.Generator().manual_seed(5)
    plan = wgrad_plan()
    a, b = wgrad_rows(256, gen, decades=4.0).to(DEVICE), wgrad_rows(128, gen).to(DEVICE)
    (aq, a_s), (bq, b_s) = quant.quantize_tile_cols(a, plan), quant.quantize_tile_cols(b, plan)
    dw = expert_bwd.wgrad_fp8(aq, a_s, bq, b_s, plan, torch.float32)
    offsets = plan.offsets_E1.cpu()
    ref = [ae @ be.t() for ae, be in zip(reference.dequantize_tile_cols(aq.cpu(), a_s.cpu(), offsets),
                                         reference.dequantize_tile_cols(bq.cpu(), b_s.cpu(), offsets))]
    assert torch.equal(dw[0].cpu(), torch.zeros(256, 128))
    for e in range(1, len(WGRAD_COUNTS)):
        assert rel_err(dw[e].cpu(), ref[e]) < 1e-6, (e, rel_err(dw[e].cpu(), ref[e]))


@pytest.mark.parametrize("dim", [256, 384])  # blocks of 256 columns on sm90; 128
def test_output_gemms_write_rows_anywhere_as_to_slots(dim):
    """The down projection and dx with ``dest`` (an expert-parallel owner's rows straight into their sources' slots):
    each slot's row lands at its int64 offset (16-byte units) from the base, here into two other allocations in a
    shuffled order, bit for bit the row the plain launch writes to that slot; nothing else is written. (On sm90 the
    Gluon kernel, in its default block width and store pattern; elsewhere the Triton one.)"""
    from megamoe.kernels import expert_bwd, expert_fwd
    from megamoe.kernels.plan import build_plan

    gen = torch.Generator().manual_seed(dim)
    num_tokens, num_experts, top_k, inter = 300, 4, 2, 128
    topk_idx = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    topk_idx[::7, 1] = -1  # dropped slots: no row, nothing written
    plan = build_plan(topk_idx.to(DEVICE), num_experts)
    rows = num_tokens * top_k
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    hq, hs = quant.quantize_rows(torch.randn(rows, inter, generator=gen).to(DEVICE))
    dzq, dzs = quant.quantize_rows(torch.randn(rows, 2 * inter, generator=gen).to(DEVICE))
    w2q, w2s, _, _ = quant.quantize_weight(torch.randn(num_experts, dim, inter, generator=gen).to(DEVICE) / 16)
    _, _, w13tq, w13ts = quant.quantize_weight(torch.randn(num_experts, 2 * inter, dim, generator=gen).to(DEVICE) / 16)
    routed = topk_idx.reshape(-1) >= 0
    slot_of_row = plan.row_slot_N[:int(routed.sum())].long().cpu()
    unit = 16 // 2
    for name, plain, dest_call in (
            ("down", lambda: expert_fwd.down_fp8(hq, hs, w2q, w2s, weights, plan, torch.bfloat16),
             lambda dest: expert_fwd.down_fp8(hq, hs, w2q, w2s, weights, plan, torch.bfloat16, dest=dest)),
            ("dx", lambda: expert_bwd.dx_slots_fp8(dzq, dzs, w13tq, w13ts, plan, torch.bfloat16),
             lambda dest: expert_bwd.dx_slots_fp8(dzq, dzs, w13tq, w13ts, plan, torch.bfloat16, dest=dest))):
        want = plain()
        base = torch.empty(unit, device=DEVICE, dtype=torch.bfloat16)
        sinks = [torch.full((rows, dim), float("nan"), device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
        sink_of_slot = torch.randint(0, 2, (rows,), generator=gen)
        place_of_slot = torch.randperm(rows, generator=gen)
        sink_start = torch.tensor([(s.data_ptr() - base.data_ptr()) // 16 for s in sinks])
        row_dest = torch.full((rows,), -1, dtype=torch.int64)  # sorted rows past the routed ones: never read
        row_dest[:len(slot_of_row)] = (sink_start[sink_of_slot[slot_of_row]]
                                       + place_of_slot[slot_of_row] * (dim // unit))
        assert dest_call((base, row_dest.to(DEVICE))) is base
        for i, sink in enumerate(sinks):
            mine = routed & (sink_of_slot == i)
            assert torch.equal(sink[place_of_slot[mine].to(DEVICE)], want[mine.to(DEVICE)]), name
            others = torch.ones(rows, dtype=torch.bool)
            others[place_of_slot[mine]] = False
            assert torch.isnan(sink[others.to(DEVICE)].float()).all(), name


# Every shape keeping nothing; the saved mode (which shares all but the backward's act step) on three of them.
FP8_CASES = [(s, "none") for s in FP8_SHAPES] + [(FP8_SHAPES[i], "preact") for i in (2, 5, 7)]


@interpreter_only("test_fp8_bf16_gpu_computes_the_recipe")
@pytest.mark.parametrize("shape, mode", FP8_CASES, ids=[f"{shape_id(s)}-{m}" for s, m in FP8_CASES])
def test_fp8_layer_computes_the_recipe(shape, mode):
    """Output and every gradient: equal to the recipe in plain PyTorch up to the order of fp32 sums (a sum can
    flip one FP8 rounding of h or dz: ~1e-4 in norm), and within twice the recipe's own error of fp32."""
    assert backend_for(torch.empty(0, device=DEVICE), fp8=True) == "triton"
    problem = make_problem(*shape, device=DEVICE)
    quant.clear_weight_cache()
    out = run_with_grads(fp8_moe(mode), *problem)
    recipe = run_with_grads(reference.moe_loop_fp8, *problem)
    for name, o, r in zip(NAMES, out, recipe):
        assert rel_err(o, r) < 2e-3, f"{name}: {rel_err(o, r):.2e} from the recipe"
    assert_close_to_reference(out, problem, lowp=reference.moe_loop_fp8)


@interpreter_only("tests/test_gluon_fp8.py::test_fp8_up_swiglu_power_of_two_scales")
@pytest.mark.parametrize("shape, mode", [(FP8_SHAPES[2], "none"), (FP8_SHAPES[7], "preact")],
                         ids=lambda v: shape_id(v) if isinstance(v, tuple) else v)
def test_fp8_layer_with_power_of_two_scales_computes_its_recipe(shape, mode):
    """``env.set_fp8_scales("pow2")``: every quantiser of the layer (x, the weights, h, dy, dz) rounds its scales up
    to powers of two; output and gradients equal the recipe with those scales, and stay within twice the recipe's
    error of fp32 -- and differ from the fp32-scale layer's."""
    problem = make_problem(*shape, device=DEVICE)
    quant.clear_weight_cache()
    fp32_scales = run_with_grads(fp8_moe(mode), *problem)
    env.set_fp8_scales("pow2")
    try:
        out = run_with_grads(fp8_moe(mode), *problem)
        recipe = run_with_grads(reference.moe_loop_fp8, *problem)
    finally:
        env.set_fp8_scales("fp32")
    for name, o, r, f in zip(NAMES, out, recipe, fp32_scales):
        assert rel_err(o, r) < 2e-3, f"{name}: {rel_err(o, r):.2e} from the recipe"
        assert not torch.equal(o, f), f"{name}: the same as with fp32 scales"
    assert_close_to_reference(out, problem, lowp=reference.moe_loop_fp8)


def fp8_wgrad_recipe(*problem):
    return reference.moe_loop_fp8(*problem, fp8_wgrad=True)


def expert_amax(a: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(E, C) fp32: each expert's sorted rows' column amax (zeros for an expert without rows)."""
    return torch.stack([a[lo:hi].float().abs().amax(dim=0) if hi > lo else a.new_zeros(a.shape[1]).float()
                        for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist())])


@pytest.mark.parametrize("routing", ["random", "empty", "dropped"])
def test_expert_channel_amax_is_each_experts_rows_amax(routing):
    """``expert_channel_amax``: each expert's largest magnitude of each column over its sorted rows, read from the
    tokens' rows (``top_k``) or from a sorted copy alike: exactly ``expert_amax`` of the sorted copy, zeros for an
    expert without rows, a NaN in an expert's rows NaN in its amax (and only its), an infinity infinite (not NaN);
    dropped slots' rows count in none. Columns off the kernel's block are refused."""
    from megamoe.kernels.expert_bwd import gather_rows
    from megamoe.kernels.plan import build_plan

    x, idx, _, _, _, dy = make_problem(300, 256, 128, 8, 2, routing, dtype=torch.bfloat16, device=DEVICE)
    x = x * torch.logspace(-3, 3, 300, device=DEVICE)[:, None].to(x.dtype)
    x[7, 5] = float("nan")
    x[11, 9] = -float("inf")
    plan = build_plan(idx, 8)
    x_sorted, _ = gather_rows(x, dy, plan, 2)
    offsets = plan.offsets_E1.cpu()
    want = expert_amax(x_sorted[:int(offsets[-1])].cpu(), offsets)
    for rows, top_k in ((x, 2), (x_sorted, None)):
        got = quant.expert_channel_amax(rows, plan, top_k).cpu()
        assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))
    nan_experts = {int(e) for e in idx[7].cpu() if e >= 0}
    assert {int(e) for e in torch.isnan(want[:, 5]).nonzero()} == nan_experts and torch.isnan(want).sum() == len(
        nan_experts)
    inf_experts = {int(e) for e in idx[11].cpu() if e >= 0}
    assert {int(e) for e in torch.isinf(want[:, 9]).nonzero()} == inf_experts
    if routing == "empty":
        assert (want[3:] == 0).all() and (want[:3] > 0).any()
    with pytest.raises(ValueError, match=f"multiple of {quant.TILE_COLS_BC} columns"):
        quant.expert_channel_amax(x[:, :64].contiguous(), plan, 2)


@pytest.mark.parametrize("per", ["layer", "expert"])
def test_quantize_tile_cols_with_given_amax_matches_reference_bit_for_bit(per, scales):
    """``col_amax`` (one row for all the experts, or one per expert): every tile's scales are its expert's, taken
    from that amax as the recipe takes a group's from its own, in all of the expert's tiles alike; bytes and scales
    the reference's with the same amax (twice the rows' own per expert: no value reaches 448); the dequantised values
    the rows' within e4m3's half step at the expert's scale. An amax of the wrong width is refused."""
    gen = torch.Generator().manual_seed(6)
    a = wgrad_rows(256, gen, decades=6.0)
    plan = wgrad_plan()
    offsets = plan.offsets_E1.cpu()
    routed = a[:sum(WGRAD_COUNTS)]
    amax = quant.channel_amax(routed) if per == "layer" else expert_amax(routed, offsets) * 2.0
    q, s = quant.quantize_tile_cols(a.to(DEVICE), plan, col_amax=amax.contiguous().to(DEVICE))
    qr, sr = reference.quantize_tile_cols(a, offsets, col_amax=amax)
    busy = sr.shape[0]
    assert torch.equal(bits(q[:, :busy * 128]).cpu(), bits(qr)) and torch.equal(s[:busy].cpu(), sr)
    assert_scale_kind(s[:busy], scales)
    tile_expert = plan.tile_expert_NT[:busy].cpu().long()
    per_tile = amax.expand(len(WGRAD_COUNTS), 256)[tile_expert]  # each tile's expert's amax
    _, expect_s = reference.quantize_groups(torch.zeros(busy, 256, 1), per_tile)
    assert torch.equal(sr, expect_s)
    assert not torch.equal(s[:busy], quant.quantize_tile_cols(a.to(DEVICE), plan)[1][:busy])
    for e, part in enumerate(reference.dequantize_tile_cols(qr, sr, offsets)):
        rows = routed[offsets[e]:offsets[e + 1]].t().float()
        _, scale = reference.quantize_groups(torch.zeros(256, 1), amax.expand(len(WGRAD_COUNTS), 256)[e])
        half_step = torch.maximum(rows.abs() * 2.0**-4, scale[:, None] * 2.0**-10)
        assert ((part[:, :rows.shape[1]] - rows).abs() <= half_step).all(), e
    with pytest.raises(AssertionError):
        quant.quantize_tile_cols(a.to(DEVICE), plan, col_amax=amax[..., :128].contiguous().to(DEVICE))


@interpreter_only("tests/test_gluon_fp8.py::test_fp8_wgrad")
@pytest.mark.parametrize("per", ["layer", "expert"])
def test_fp8_wgrad_gemm_with_b_const_computes_the_dequantised_products(per):
    """b quantised with ``col_amax`` and the GEMM told so (``b_const``): dW[e] = sum over expert e's tiles of
    deq(a)ᵀ deq(b), b's scales applied once to each block's sum (exact products, fp32 sums); an expert without rows
    gets exact zeros."""
    from megamoe.kernels import expert_bwd

    gen = torch.Generator().manual_seed(7)
    plan = wgrad_plan()
    offsets = plan.offsets_E1.cpu()
    a, b = wgrad_rows(256, gen, decades=4.0), wgrad_rows(128, gen, decades=4.0)
    routed = b[:sum(WGRAD_COUNTS)]
    amax = (quant.channel_amax(routed) if per == "layer" else expert_amax(routed, offsets)).contiguous().to(DEVICE)
    (aq, a_s), (bq, b_s) = quant.quantize_tile_cols(a.to(DEVICE), plan), quant.quantize_tile_cols(b.to(DEVICE), plan,
                                                                                                 col_amax=amax)
    dw = expert_bwd.wgrad_fp8(aq, a_s, bq, b_s, plan, torch.float32, b_const=True)
    ref = [ae @ be.t() for ae, be in zip(reference.dequantize_tile_cols(aq.cpu(), a_s.cpu(), offsets),
                                         reference.dequantize_tile_cols(bq.cpu(), b_s.cpu(), offsets))]
    assert torch.equal(dw[0].cpu(), torch.zeros(256, 128))
    for e in range(1, len(WGRAD_COUNTS)):
        assert rel_err(dw[e].cpu(), ref[e]) < 1e-6, (e, rel_err(dw[e].cpu(), ref[e]))
    # the tile recipe's scales with this switch would be wrong: b's per-tile scales differ from the expert's
    tiles = expert_bwd.wgrad_fp8(aq, a_s, *quant.quantize_tile_cols(b.to(DEVICE), plan), plan, torch.float32)
    assert rel_err(dw[5].cpu(), tiles[5].cpu()) > 1e-4


def bf16_wgrad_recipe(*problem):
    return reference.moe_loop_fp8(*problem, fp8_wgrad=False)


# FP8 weight gradients (autograd.FP8_WGRAD): experts with several tiles and a partial last one, experts without rows,
# dropped slots, two I-blocks; the saved mode once.
FP8_WGRAD_CASES = [(FP8_SHAPES[2], "none"), (FP8_SHAPES[5], "preact"), (FP8_SHAPES[8], "none")]


@interpreter_only("test_fp8_wgrad_bf16_gpu_computes_the_recipe")
@pytest.mark.parametrize("fp8_wgrad", [True, False], ids=["fp8-wgrad", "bf16-wgrad"])
@pytest.mark.parametrize("shape, mode", FP8_WGRAD_CASES, ids=[f"{shape_id(s)}-{m}" for s, m in FP8_WGRAD_CASES])
def test_fp8_layer_computes_its_weight_gradient_recipe(shape, mode, fp8_wgrad, monkeypatch):
    """With FP8 weight gradients (``autograd.FP8_WGRAD``, the default) and with bf16 ones from the unquantised rows
    (``MEGAMOE_FP8_WGRAD=0``): output and every gradient equal to that recipe in plain PyTorch up to the order of fp32
    sums, and within twice its error of fp32; FP8 weight gradients also carry the 128x1 quantisations' error (not the
    bf16 weight gradients')."""
    from megamoe import autograd as ops

    monkeypatch.setattr(ops, "FP8_WGRAD", fp8_wgrad)
    problem = make_problem(*shape, device=DEVICE)
    quant.clear_weight_cache()
    out = run_with_grads(fp8_moe(mode), *problem)
    recipe_fn = fp8_wgrad_recipe if fp8_wgrad else bf16_wgrad_recipe
    recipe = run_with_grads(recipe_fn, *problem)
    for name, o, r in zip(NAMES, out, recipe):
        assert rel_err(o, r) < 2e-3, f"{name}: {rel_err(o, r):.2e} from the recipe"
    assert_close_to_reference(out, problem, lowp=recipe_fn)
    if fp8_wgrad:
        bf16_wgrad = run_with_grads(bf16_wgrad_recipe, *problem)
        for name, o, r in list(zip(NAMES, out, bf16_wgrad))[3:]:
            assert rel_err(o, r) > 5e-3, f"{name}: {rel_err(o, r):.2e} from the bf16 weight gradients"


@interpreter_only("test_fp8_wgrad_bf16_gpu_computes_the_recipe")
@pytest.mark.parametrize("x_scales", ["layer", "expert"])
@pytest.mark.parametrize("shape, mode", FP8_WGRAD_CASES[:2], ids=[f"{shape_id(s)}-{m}" for s, m in FP8_WGRAD_CASES[:2]])
def test_fp8_layer_with_coarser_x_scales_computes_its_recipe(shape, mode, x_scales, monkeypatch):
    """``autograd.FP8_WGRAD_X_SCALES = "layer"`` or ``"expert"`` (``MEGAMOE_FP8_WGRAD_X_SCALES``): output and every
    gradient equal to the recipe with x's dW13 scales one per channel over the layer's tokens, or over each expert's,
    up to the order of fp32 sums, and within twice its error of fp32; only dW13 differs from the layer with the
    recipe's 128x1 scales."""
    from megamoe import autograd as ops

    monkeypatch.setattr(ops, "FP8_WGRAD", True)
    problem = make_problem(*shape, device=DEVICE)
    quant.clear_weight_cache()
    tile = run_with_grads(fp8_moe(mode), *problem)
    monkeypatch.setattr(ops, "FP8_WGRAD_X_SCALES", x_scales)
    out = run_with_grads(fp8_moe(mode), *problem)

    def recipe_fn(*a):
        return reference.moe_loop_fp8(*a, fp8_wgrad=True, x_scales=x_scales)

    recipe = run_with_grads(recipe_fn, *problem)
    for name, o, r in zip(NAMES, out, recipe):
        assert rel_err(o, r) < 2e-3, f"{name}: {rel_err(o, r):.2e} from the recipe"
    assert_close_to_reference(out, problem, lowp=recipe_fn)
    for name, o, t in zip(NAMES, out, tile):
        assert torch.equal(o, t) is (name != "dw13"), name


@pytest.mark.parametrize("x_scales", ["tile", "layer", "expert"])
def test_fp8_recipes_error_is_fp8s_own(x_scales):
    """The recipe in plain PyTorch (``reference.moe_loop_fp8``, FP8 weight gradients), against fp32 on Gaussian data:
    output and every gradient 3-9% off in norm (FP8's own error, four e4m3 roundings deep: ~6.4%; without them bf16's
    ~0.4%), with each of x's dW13 scale options alike (over the layer or per expert, dW13 within 5% of the recipe's
    error here, where x has no outliers). What the kernels are checked against (twice its error, elementwise)
    stays FP8's."""
    problem = make_problem(512, 256, 256, 8, 2, "random", dtype=torch.bfloat16, device=DEVICE)
    ref32 = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    tile = run_with_grads(lambda *a: reference.moe_loop_fp8(*a, fp8_wgrad=True, x_scales="tile"), *problem)
    out = run_with_grads(lambda *a: reference.moe_loop_fp8(*a, fp8_wgrad=True, x_scales=x_scales), *problem)
    for name, o, t, r in zip(NAMES, out, tile, ref32):
        assert 3e-2 < rel_err(o, r) < 9e-2, f"{name}: {rel_err(o, r):.2e} from fp32"
        if name == "dw13":
            assert rel_err(o, r) < 1.05 * rel_err(t, r), f"{rel_err(o, r):.3e} against {rel_err(t, r):.3e}"
        else:
            assert torch.equal(o, t), name


def test_x_scales_switch_refuses_unknown_values(monkeypatch):
    """``MEGAMOE_FP8_WGRAD_X_SCALES`` takes "tile" (also unset or empty), "layer" or "expert"; the reference and the
    backward refuse anything else by name."""
    from megamoe.kernels.backward_fp8 import backward_rows_fp8

    for value, want in (("", "tile"), ("tile", "tile"), ("layer", "layer"), ("expert", "expert")):
        monkeypatch.setenv("MEGAMOE_FP8_WGRAD_X_SCALES", value)
        assert env.fp8_wgrad_x_scales_requested() == want
    monkeypatch.setenv("MEGAMOE_FP8_WGRAD_X_SCALES", "experts")
    with pytest.raises(ValueError, match="MEGAMOE_FP8_WGRAD_X_SCALES"):
        env.fp8_wgrad_x_scales_requested()
    problem = make_problem(*FP8_SHAPES[0], device=DEVICE)
    with pytest.raises(ValueError, match="x_scales"):
        reference.moe_loop_fp8(*problem[:5], fp8_wgrad=True, x_scales="block")
    with pytest.raises(ValueError, match="x_scales"):
        backward_rows_fp8(*problem[:1], *problem[:1], None, None, None, None, 1, None, fp8_wgrad=True,
                          x_scales="block")


@pytest.mark.parametrize("mode", SAVE_MODES)
def test_fp8_wgrad_backward_frees_dz_rows_and_dx_slots_before_dw13(mode, monkeypatch):
    """With FP8 weight gradients the backward runs dx (dz's 1x128 rows into slot rows, then the combine) before
    dW13, whose launch is its peak: by then dz's rows and dx's slot rows are freed, and x's tile columns are made
    only for it."""
    import weakref

    from megamoe import autograd
    from megamoe.kernels import backward_fp8 as ops

    monkeypatch.setattr(autograd, "FP8_WGRAD", True)
    dead_before_dw13 = []  # weak references to what must be freed before dW13 runs
    order = []
    dx_slots, wgrad, tile_cols = ops.dx_slots_fp8, ops.wgrad_fp8, ops.quantize_tile_cols

    def spy_dx_slots(dzq, dzs, *args, **kwargs):
        out = dx_slots(dzq, dzs, *args, **kwargs)
        dead_before_dw13.extend(weakref.ref(t) for t in (dzq, dzs, out))
        order.append("dx")
        return out

    def spy_wgrad(*args, **kwargs):
        order.append("dW13" if "dW2" in order else "dW2")
        if order[-1] == "dW13":
            assert [ref() for ref in dead_before_dw13] == [None] * 3
        return wgrad(*args, **kwargs)

    def spy_tile_cols(rows, *args, **kwargs):
        order.append("tile cols")
        return tile_cols(rows, *args, **kwargs)

    monkeypatch.setattr(ops, "dx_slots_fp8", spy_dx_slots)
    monkeypatch.setattr(ops, "wgrad_fp8", spy_wgrad)
    monkeypatch.setattr(ops, "quantize_tile_cols", spy_tile_cols)
    x, idx, w, w13, w2, dy = make_problem(40, 128, 256, 6, 3, "dropped", device=DEVICE)
    quant.clear_weight_cache()
    run_with_grads(fp8_moe(mode), x, idx, w, w13, w2, dy)
    assert order == ["tile cols", "dW2", "dx", "tile cols", "dW13"]  # dy's tile columns, then x's


def test_fp8_layer_fp16_inputs():
    problem = make_problem(40, 128, 256, 6, 3, "dropped", dtype=torch.float16, device=DEVICE)
    assert_close_to_reference(run_with_grads(fp8_moe(), *problem), problem, lowp=reference.moe_loop_fp8)


def test_fp8_is_not_the_bf16_path():
    """The FP8 result carries FP8's error (a silent fall-back to the input dtype would not)."""
    problem = make_problem(40, 128, 128, 6, 3, "random", device=DEVICE)
    ref32 = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    out = run_with_grads(fp8_moe(), *problem)
    for name, o, r in zip(NAMES, out, ref32):
        assert 0.01 < rel_err(o, r) < 0.15, f"{name}: {rel_err(o, r):.2e}"


def test_quantisers_keep_a_nan_a_nan(scales):
    """Each quantiser writes a NaN as e4m3's NaN (0x7F / 0xFF) and every other value as it would without it (amax
    passes over a NaN: the group's scale is its other values')."""
    gen = torch.Generator().manual_seed(0)
    plan = build_plan(torch.randint(0, 2, (256, 1), generator=gen).to(DEVICE), 2)

    def quantised(a):  # every e4m3 output; the tile columns over zeros (idle tiles are not written)
        over = torch.zeros(2**20, device=DEVICE)
        return [q for q in (*quant.quantize_rows(a), *quant.quantize_tile_cols(a, plan, over=over),
                            *quant.quantize_weight(a[None])) if q.dtype == quant.FP8]

    a = torch.randn(256, 256, generator=gen).to(DEVICE)
    a[3, 7] = 0.0
    clean = quantised(a)
    a[3, 7] = float("nan")
    for c, d in zip(clean, quantised(a), strict=True):
        changed = bits(c) != bits(d)
        assert changed.sum() == 1 and (bits(d)[changed] & 0x7F == 0x7F).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_fp8_keeps_a_nan_a_nan(mode):
    """A NaN in a token's row of x, or of dy, reaches that token's rows of y and dx and the weight gradients, and no
    other token's: quantised, a NaN stays NaN (a clamp before the GPU's saturating conversion turned it into -448, a
    finite value that no NaN check downstream would see). On the GPU only: Triton's interpreter reads e4m3's NaN
    (0x7F) as 480 (the quantisers' own NaN bytes: ``test_quantisers_keep_a_nan_a_nan``)."""
    x, idx, w, w13, w2, dy = make_problem(40, 128, 256, 6, 3, "random", device="cuda")
    x[5, 17] = float("nan")
    dy[9, 3] = float("nan")
    y, dx, dw, dw13, dw2 = run_with_grads(fp8_moe(mode), x, idx, w, w13, w2, dy)
    others = torch.ones(40, dtype=torch.bool)
    others[[5, 9]] = False
    assert y[5].isnan().all() and y[others].isfinite().all()
    assert dx[5].isnan().all() and dx[9].isnan().all() and dx[others].isfinite().all()
    assert dw[others].isfinite().all() and dw13.isnan().any() and dw2.isnan().any()


@pytest.mark.parametrize("dim, inter", [(136, 128), (128, 72)])
def test_fp8_refuses_dims_off_the_128_grid(dim, inter):
    x, idx, w, w13, w2, _ = make_problem(8, dim, inter, 4, 2, "random", device=DEVICE)
    with pytest.raises(ValueError, match="multiples of 128"):
        megamoe.moe(x, idx, w, w13, w2, precision="fp8")
    with pytest.raises(ValueError, match="multiples of 128"):  # at construction, before any step
        megamoe.MegaMoE(dim, inter, 4, 2, precision="fp8", device=DEVICE)


def _counting_weight_quantisations(monkeypatch):
    """(the list every ``quant.quantize_weight`` call appends its weight to, an FP8-shaped problem whose weights are
    parameters), the weight cache emptied."""
    calls = []
    real = quant.quantize_weight
    monkeypatch.setattr(quant, "quantize_weight", lambda w, *a, **k: calls.append(w) or real(w, *a, **k))
    quant.clear_weight_cache()
    x, idx, w, w13, w2, dy = make_problem(33, 128, 128, 4, 2, "random", device=DEVICE)
    return calls, (x, idx, w, torch.nn.Parameter(w13), torch.nn.Parameter(w2), dy)


def test_weight_cache_hit_miss_and_invalidation(monkeypatch):
    """One quantisation per weight while it is unchanged (forward and backward, any number of micro-batches); a
    new one after an in-place update, after an optimizer step, and for another tensor; the layer never computes
    with stale copies."""
    calls, (x, idx, w, w13, w2, dy) = _counting_weight_quantisations(monkeypatch)

    def step():
        y = megamoe.moe(x, idx, w, w13, w2, precision="fp8")
        y.backward(dy)
        return y.detach()

    step()
    step()
    assert len(calls) == 2, "two micro-batches (forward and backward each) quantise each weight once"
    with torch.no_grad():
        w2.mul_(-1.0)  # an in-place update bumps the version: w2 is quantised again, w13 is not
    y = step()
    assert len(calls) == 3 and calls[-1] is w2
    # computed with w2's new copy: within half the recipe's own error of fp32 (the GPU tests' rule: the tensor cores'
    # sums flip a few FP8 roundings); the stale copy, of -w2, would be ~200% off
    fresh = reference.moe_loop_fp8(x, idx, w, w13.detach(), w2.detach())
    assert rel_err(y, fresh) < 0.5 * rel_err(fresh, reference.moe_loop(x, idx, w, w13.detach(), w2.detach(), fp32=True))
    torch.optim.SGD([w13, w2], lr=0.1).step()  # any optimizer step invalidates every copy
    y = step()
    assert len(calls) == 5
    assert rel_err(y, reference.moe_loop_fp8(x, idx, w, w13.detach(), w2.detach())) < 2e-3
    other = w13.detach().clone()
    megamoe.moe(x, idx, w, other, w2, precision="fp8")
    assert len(calls) == 6 and calls[-1] is other
    env.set_fp8_scales("pow2")  # another kind of scales: new copies
    try:
        step()
    finally:
        env.set_fp8_scales("fp32")
    assert len(calls) == 8


def test_weight_cache_hits_for_the_checkpointed_backward(monkeypatch):
    """Under ``megamoe.checkpoint_context`` the backward meets aliases of the weights (the region's saved tensors
    unpack as new tensor objects on the same storage): they hit the forward's copies, so that a checkpointed step
    quantises each weight once, not once more in every backward. A tensor on another storage with the same
    contents, shape and version does not hit."""
    from torch.utils.checkpoint import checkpoint

    calls, (x, idx, w, w13, w2, dy) = _counting_weight_quantisations(monkeypatch)
    x.requires_grad_()

    def layer(x):
        return megamoe.moe(x, idx, w, w13, w2, precision="fp8")

    for _ in range(2):
        checkpoint(layer, x, use_reentrant=False, context_fn=megamoe.checkpoint_context).backward(dy)
    assert len(calls) == 2, "two checkpointed micro-batches quantise each weight once"
    twin = w13.detach().clone()
    assert twin._version == w13._version
    megamoe.moe(x, idx, w, twin, w2, precision="fp8")
    assert len(calls) == 3 and calls[-1] is twin


def test_quantize_weight_makes_either_copy_alone_bit_for_bit():
    """The straight or the transposed copy alone (what a call makes under the "call" policy): the bits that the pass
    making both writes, None in the other copy's places; asking for neither is refused."""
    w = torch.randn(2, 256, 128, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    both = quant.quantize_weight(w)
    straight = quant.quantize_weight(w, transposed=False)
    transposed = quant.quantize_weight(w, straight=False)
    for i in (0, 1):  # data, scales
        assert torch.equal(bits(straight[i]), bits(both[i])) and transposed[i] is None
        assert torch.equal(bits(transposed[2 + i]), bits(both[2 + i])) and straight[2 + i] is None
    with pytest.raises(ValueError, match="the straight copy, the transposed one or both"):
        quant.quantize_weight(w, straight=False, transposed=False)


@pytest.mark.parametrize("mode", SAVE_MODES)
def test_weight_cache_call_policy_keeps_no_copy_and_computes_the_same(monkeypatch, mode):
    """Under ``set_fp8_weight_cache("call")`` each forward makes both weights' straight copies and each backward
    their transposed ones (and w13's straight one again without saved products: the recompute's), at every call,
    and nothing is kept: y and every gradient bit for bit what the cached copies give. Setting the policy drops
    what the cache held; an unknown policy is refused."""
    x, idx, w, w13, w2, dy = make_problem(33, 128, 128, 4, 2, "random", device=DEVICE)
    leaves = [t.requires_grad_() for t in (x, w, w13, w2)]

    def run():
        y = fp8_moe(mode)(x, idx, w, w13, w2)
        return [y.detach(), *torch.autograd.grad(y, leaves, dy)]

    quant.clear_weight_cache()
    cached = run()
    assert len(quant._weight_cache) == 2, "the step policy keeps both weights' copies"
    made = []
    real = quant.quantize_weight
    monkeypatch.setattr(quant, "quantize_weight", lambda a, straight=True, transposed=True: made.append(
        ("w13" if a is w13 else "w2", straight, transposed)) or real(a, straight, transposed))
    megamoe.set_fp8_weight_cache("call")
    try:
        assert not quant._weight_cache and quant.fp8_weight_cache() == "call"
        for _ in range(2):
            out = run()
            assert not quant._weight_cache
            for name, a, b in zip(NAMES, out, cached):
                assert torch.equal(a, b), name
        with pytest.raises(ValueError, match="must be one of"):
            megamoe.set_fp8_weight_cache("layer")
    finally:
        megamoe.set_fp8_weight_cache("step")
    step = [("w13", True, False), ("w2", True, False),  # the forward
            ("w13", mode == "none", True), ("w2", False, True)]  # the backward
    assert made == step * 2


def test_weight_copies_bytes_are_what_quantize_weight_makes():
    w = torch.randn(3, 256, 384).to(DEVICE)
    assert quant.weight_copies_bytes(w) == sum(t.numel() * t.element_size() for t in quant.quantize_weight(w))


def test_weight_cache_policy_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEGAMOE_FP8_WEIGHT_CACHE", "call")
    assert env.fp8_weight_cache_requested() == "call"
    monkeypatch.setenv("MEGAMOE_FP8_WEIGHT_CACHE", "ahead")
    assert env.fp8_weight_cache_requested() == "ahead"
    monkeypatch.setenv("MEGAMOE_FP8_WEIGHT_CACHE", "")
    assert env.fp8_weight_cache_requested() == "step"
    monkeypatch.setenv("MEGAMOE_FP8_WEIGHT_CACHE", "never")
    with pytest.raises(ValueError, match="MEGAMOE_FP8_WEIGHT_CACHE must be one of"):
        env.fp8_weight_cache_requested()


def test_optimizer_step_frees_the_cached_copies_before_it_runs():
    """Every copy is stale once an optimizer steps: dropped by the step's pre-hook, so that their memory is free
    for the optimizer's own work, not held until each weight's next use."""
    import weakref

    x, idx, w, w13, w2, _dy = make_problem(33, 128, 128, 4, 2, "random", device=DEVICE)
    w13, w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    quant.clear_weight_cache()
    megamoe.moe(x, idx, w, w13, w2, precision="fp8")
    copy = weakref.ref(quant.fp8_weight(w13)[2])
    held_at_step = []
    opt = torch.optim.SGD([w13, w2], lr=0.1)
    opt.register_step_pre_hook(lambda *_: held_at_step.append(len(quant._weight_cache)))
    opt.step()
    assert held_at_step == [0] and copy() is None


def test_weight_cache_ahead_policy_makes_the_copies_at_the_optimizer_step(monkeypatch):
    """Under ``"ahead"`` an optimizer step's post-hook quantises again each weight met since the step before that the
    optimizer holds: the next forward and backward make no copy and compute what the ``"step"`` policy computes, bit
    for bit (on a GPU the copies come from a side stream). A weight the optimizer does not hold (as FSDP2's gathered
    ones) is quantised at its next use instead."""
    calls, (x, idx, w, w13, w2, dy) = _counting_weight_quantisations(monkeypatch)
    opt = torch.optim.SGD([w13, w2], lr=0.1)

    def run():
        y = megamoe.moe(x, idx, w, w13, w2, precision="fp8")
        y.backward(dy)
        out = [y.detach(), w13.grad, w2.grad]
        opt.zero_grad()
        return out

    megamoe.set_fp8_weight_cache("ahead")
    try:
        run()
        assert len(calls) == 2
        opt.step()
        assert len(calls) == 4 and calls[2] is w13 and calls[3] is w2 and len(quant._weight_cache) == 2
        ahead = run()
        assert len(calls) == 4, "the step after made both weights' copies: the forward and backward hit them"
        megamoe.set_fp8_weight_cache("step")
        quant.clear_weight_cache()
        for name, a, b in zip(("y", "dw13", "dw2"), ahead, run()):
            assert torch.equal(a, b), name
        megamoe.set_fp8_weight_cache("ahead")
        other = w13.detach().clone()  # another storage: not a weight the optimizer updates
        quant.clear_weight_cache()
        megamoe.moe(x, idx, w, other, w2, precision="fp8")
        assert len(calls) == 8 and calls[-2] is other and calls[-1] is w2
        opt.step()
        assert len(calls) == 9 and calls[-1] is w2 and len(quant._weight_cache) == 1
        quant.clear_weight_cache()
        megamoe.moe(x, idx, w, w13.detach(), w2, precision="fp8")  # w13 met through an alias (gone after the call)
        opt.step()
        assert len(calls) == 13 and calls[-2] is w13 and calls[-1] is w2 and len(quant._weight_cache) == 2
        # two optimizers: the second's step drops the copies made after the first's; its own weight's survive
        megamoe.moe(x, idx, w, w13, w2, precision="fp8")
        first, second = torch.optim.SGD([w13], lr=0.1), torch.optim.SGD([w2], lr=0.1)
        first.step()
        second.step()
        assert len(calls) == 15 and calls[-2] is w13 and calls[-1] is w2
        assert [entry[0]() for entry in quant._weight_cache.values()] == [w2]
    finally:
        megamoe.set_fp8_weight_cache("step")


@pytest.mark.gpu
def test_weight_copies_made_ahead_come_from_the_main_streams_pool():
    """Under ``"ahead"`` the copies are written on a side stream but allocated from the main stream's pool of the
    caching allocator, where they are read and freed: a step's new copies then take the memory of those it dropped,
    in stream order, even while the device still runs earlier work (a training loop's host runs ahead of it). From
    the side stream's own pool they could not, and every step asked the driver for fresh memory, its frees
    synchronising the device once memory ran short (docs/PERFORMANCE.md, "FP8's weight copies made ahead")."""
    quant.clear_weight_cache()
    x, idx, w, w13, w2, dy = make_problem(64, 256, 256, 4, 2, "random", dtype=torch.bfloat16, device="cuda")
    w13, w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    opt = torch.optim.SGD([w13, w2], lr=0.1)

    def pool(t):  # the stream whose pool holds t's memory
        address = t.data_ptr()
        return next(segment["stream"] for segment in torch.cuda.memory_snapshot()
                    if segment["address"] <= address < segment["address"] + segment["total_size"])

    megamoe.set_fp8_weight_cache("ahead")
    try:
        megamoe.moe(x, idx, w, w13, w2, precision="fp8").backward(dy)
        opt.step()
        main = torch.cuda.current_stream().cuda_stream
        for weight in (w13, w2):
            made = quant._weight_cache[quant._cache_key(weight)][2]
            assert [pool(t) for t in made] == [main] * 4
            torch.cuda.synchronize()
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(made, quant.quantize_weight(weight.detach())))
    finally:
        megamoe.set_fp8_weight_cache("step")
        quant.clear_weight_cache()


def test_layer_benchmark_optstep_impl_quantises_the_weights_at_every_step(monkeypatch):
    """The layer benchmark's ``megamoe_fp8_optstep``: each forward+backward makes both weights' FP8 copies once (as
    after an optimizer step), where ``megamoe_fp8`` makes them once for all steps; the same outputs."""
    from megamoe.bench.layer import make_impls

    calls, (x, idx, w, w13, w2, dy) = _counting_weight_quantisations(monkeypatch)
    fp8, optstep = make_impls(["megamoe_fp8", "megamoe_fp8_optstep"], DEVICE)
    assert optstep.keeps_activations == fp8.keeps_activations
    ys = []
    for impl in (fp8, fp8, optstep, optstep):
        y = impl.fn(x, idx, w, w13, w2)
        y.backward(dy)
        ys.append(y.detach())
    assert len(calls) == 2 + 2 * 2, "megamoe_fp8 quantises each weight once, megamoe_fp8_optstep at every step"
    assert all(torch.equal(y, ys[0]) for y in ys)


def test_layer_benchmark_x_scales_impls_run_their_option_in_their_backward(monkeypatch):
    """The layer benchmark's ``megamoe_fp8[_saved]_x_layer`` / ``_x_expert``: their option of x's dW13 scales is the
    one their backward reads (inside ``Impl.within``, as the benchmark times and checks them), the process's setting
    as it was afterwards; against the recipe's impl only dW13 differs."""
    from megamoe import autograd as ops
    from megamoe.bench.layer import X_SCALES_IMPLS, make_impls

    assert sorted(X_SCALES_IMPLS) == ["megamoe_fp8_saved_x_expert", "megamoe_fp8_saved_x_layer",
                                      "megamoe_fp8_x_expert", "megamoe_fp8_x_layer"]
    monkeypatch.setattr(ops, "FP8_WGRAD", True)
    seen, backward = [], ops.backward_rows_fp8
    monkeypatch.setattr(ops, "backward_rows_fp8", lambda *a, **k: seen.append(k["x_scales"]) or backward(*a, **k))
    problem = make_problem(*FP8_SHAPES[8], device=DEVICE)  # several tiles per expert: the options differ
    recipe, option = make_impls(["megamoe_fp8_saved", "megamoe_fp8_saved_x_expert"], DEVICE)
    assert (option.x_scales, option.keeps_activations) == ("expert", recipe.keeps_activations)
    before = ops.FP8_WGRAD_X_SCALES
    tile = recipe.within(run_with_grads)(recipe.fn, *problem)
    out = option.within(run_with_grads)(option.fn, *problem)
    assert seen == [before, "expert"] and ops.FP8_WGRAD_X_SCALES == before
    for name, o, t in zip(NAMES, out, tile):
        assert torch.equal(o, t) is (name != "dw13"), name
    assert rel_err(out[NAMES.index("dw13")], tile[NAMES.index("dw13")]) < 5e-2


def test_fp8_in_the_layer_is_the_functional_fp8_path():
    """``MegaMoE(precision="fp8")`` runs the FP8 experts: with the same weights its output differs from its bf16
    twin's by FP8's error (not by nothing, not by more)."""
    torch.manual_seed(0)
    layer = megamoe.MegaMoE(128, 128, 4, 2, precision="fp8", device=DEVICE, dtype=torch.float32)
    twin = megamoe.MegaMoE(128, 128, 4, 2, device=DEVICE, dtype=torch.float32)
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 128, device=DEVICE)
    assert "precision='fp8'" in repr(layer)
    y, y_bf16 = layer(x), twin(x)
    assert y.shape == x.shape
    assert 0.01 < rel_err(y, y_bf16) < 0.15


# bf16 on the GPU: the real layers and routings off every tile size.
FP8_GPU_SHAPES = [
    (4096, 2048, 768, 128, 8, "random"),   # Qwen3-30B-A3B layer
    (1024, 4096, 1536, 128, 8, "random"),  # Qwen3-235B-A22B layer
    (3000, 1024, 512, 64, 8, "skewed"),
    (777, 512, 256, 13, 4, "dropped"),     # nothing a multiple of the tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
@pytest.mark.parametrize("shape", FP8_GPU_SHAPES, ids=[shape_id(s) for s in FP8_GPU_SHAPES])
def test_fp8_bf16_gpu_computes_the_recipe(shape, mode, poison_cuda):
    """bf16 inputs on the H200: the tensor cores accumulate each FP8 MMA at reduced precision (~5e-4 relative; the
    recipe in PyTorch in fp32), which moves ~1% of h's and dz's FP8 roundings by one step, and the kernels round y,
    dh' and dz to bf16: so the kernels sit 1-2% from the recipe, well inside FP8's own error (~6% from fp32; at
    most half of it here), and within twice the recipe's error of fp32 elementwise."""
    problem = gpu_problem(*shape)
    out = run_with_grads(fp8_moe(mode), *problem)
    recipe = run_with_grads(reference.moe_loop_fp8, *problem)
    ref32 = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    for name, o, r, r32 in zip(NAMES, out, recipe, ref32):
        assert rel_err(o, r) < 0.5 * rel_err(r, r32), f"{name}: {rel_err(o, r):.2e} from the recipe"
    assert_close_to_reference(out, problem, lowp=reference.moe_loop_fp8, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("x_scales", ["tile", "layer", "expert"])
@pytest.mark.parametrize("shape", FP8_GPU_SHAPES, ids=[shape_id(s) for s in FP8_GPU_SHAPES])
def test_fp8_wgrad_bf16_gpu_computes_the_recipe(shape, x_scales, poison_cuda, monkeypatch):
    """As ``test_fp8_bf16_gpu_computes_the_recipe``, with FP8 weight gradients (the Gluon k-grouped GEMM on
    tile-column operands) against the recipe with FP8 weight gradients; x's scales in dW13 per tile (the recipe), per
    channel over the layer and per channel over each expert (``autograd.FP8_WGRAD_X_SCALES``)."""
    from megamoe import autograd as ops

    monkeypatch.setattr(ops, "FP8_WGRAD", True)
    monkeypatch.setattr(ops, "FP8_WGRAD_X_SCALES", x_scales)
    problem = gpu_problem(*shape)
    out = run_with_grads(fp8_moe(), *problem)

    def fp8_wgrad_recipe(*a):
        return reference.moe_loop_fp8(*a, fp8_wgrad=True, x_scales=x_scales)

    recipe = run_with_grads(fp8_wgrad_recipe, *problem)
    ref32 = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    for name, o, r, r32 in zip(NAMES, out, recipe, ref32):
        assert rel_err(o, r) < 0.5 * rel_err(r, r32), f"{name}: {rel_err(o, r):.2e} from the recipe"
    assert_close_to_reference(out, problem, lowp=fp8_wgrad_recipe, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["random", "dropped", "one"])
def test_gluon_tile_cols_quantiser_writes_the_triton_kernels_bits(routing, scales, monkeypatch):
    """The Gluon tile-column quantiser (``quant.quantize_tile_cols(..., gluon=True)``, sm90, bf16 rows; fp16 rows take
    the Triton kernel): the Triton kernel's bytes and scales, from sorted rows and from the tokens' rows, over values
    spanning e4m3's normal and subnormal range, an all-zero group, partial and idle tiles and rows past the routed ones
    (NaN, never read); its memory handed over (``over``) as the Triton kernel's. Each call with ``gluon=True`` is
    checked to have launched the Gluon kernel."""
    from megamoe.kernels.expert_bwd import gather_rows
    from megamoe.kernels.plan import build_plan

    launched = []
    gluon_launcher = quant.fp8_tile_cols_ws

    def counted(*args, **kwargs):
        launched.append(True)
        return gluon_launcher(*args, **kwargs)

    monkeypatch.setattr(quant, "fp8_tile_cols_ws", counted)
    x, idx, _, _, _, dy = make_problem(700, 256, 128, 6, 3, routing, dtype=torch.bfloat16, device="cuda")
    x = x * torch.logspace(-4, 4, 700, device="cuda")[:, None].to(x.dtype)
    x[:, 5] = 0.0
    plan = build_plan(idx, 6)
    busy = busy_tiles(plan)
    x_sorted, dy_sorted = gather_rows(x, dy, plan, 3)
    x_sorted[int(plan.offsets_E1[-1]):] = float("nan")
    for rows, top_k in ((x, 3), (dy, 3), (x_sorted, None), (dy_sorted, None)):
        q, s = quant.quantize_tile_cols(rows, plan, top_k, gluon=True)
        q_ref, s_ref = quant.quantize_tile_cols(rows, plan, top_k, gluon=False)
        assert torch.equal(bits(q[:, :busy * 128]), bits(q_ref[:, :busy * 128])), top_k
        assert torch.equal(s[:busy], s_ref[:busy]), top_k
        assert_scale_kind(s[:busy], scales)
    over = torch.empty(q.numel() + 4 * s.numel(), device="cuda", dtype=torch.uint8)
    q_over, s_over = quant.quantize_tile_cols(x, plan, 3, over=over, gluon=True)
    assert q_over.data_ptr() == over.data_ptr()
    q_ref, s_ref = quant.quantize_tile_cols(x, plan, 3, gluon=False)
    assert torch.equal(bits(q_over[:, :busy * 128]), bits(q_ref[:, :busy * 128]))
    assert torch.equal(s_over[:busy], s_ref[:busy])
    assert len(launched) == 5  # the Gluon kernel, not the Triton one, for every gluon=True call


@pytest.mark.gpu
def test_fp8_quantisers_on_the_gpu_match_reference_bit_for_bit(scales):
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(3000, 2048, generator=gen) * torch.logspace(-6, 4, 3000)[:, None]).to(torch.bfloat16)
    q, s = quant.quantize_rows(a.cuda())
    qr, sr = reference.quantize_rows(a)
    assert torch.equal(bits(q).cpu(), bits(qr)) and torch.equal(s.cpu(), sr)
    w = torch.randn(8, 1536, 2048, generator=gen).to(torch.bfloat16)
    for name, o, r in zip(("q", "s", "qt", "st"), quant.quantize_weight(w.cuda()), reference.quantize_weight(w)):
        assert torch.equal(bits(o).cpu(), bits(r)), name
    from megamoe.kernels.plan import build_plan

    plan = build_plan(gpu_problem(3000, 128, 128, 64, 1, "skewed")[1], 64)  # 3000 rows: a[:3000] routed
    busy = plan.tile_expert_NT.lt(64).sum().item()
    q, s = quant.quantize_tile_cols(a[:, :1024].contiguous().cuda(), plan)
    qr, sr = reference.quantize_tile_cols(a[:, :1024], plan.offsets_E1.cpu())
    assert torch.equal(bits(q[:, :busy * 128]).cpu(), bits(qr)) and torch.equal(s[:busy].cpu(), sr)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["edges", "30B"])
def test_act_step_into_tile_columns_is_the_act_step_then_the_quantiser(case, scales):
    """The FP8 weight gradients' act step in one Gluon kernel (``expert_bwd.act_bwd_tile_cols`` on sm90): bit for bit
    the act step writing dz and h·w in bf16 (``act_bwd_from_preact`` with dz's 1x128 quantisation) followed by
    ``quantize_tile_cols`` on them, on the routed rows and busy tiles (the rest is never written). "edges": experts
    with no rows, one row, partial and several tiles, products over 2 decades (subnormal and zero e4m3 values) and NaN
    rows past the routed ones (never read); "30B": the 30B layer's I (six column blocks), a skewed routing of 64
    experts."""
    from megamoe.kernels import expert_bwd
    from megamoe.kernels.gluon_fp8_sm90 import fp8_ws_supported
    from megamoe.kernels.plan import build_plan

    gen = torch.Generator().manual_seed(6)
    if case == "edges":
        plan, routed = wgrad_plan(), sum(WGRAD_COUNTS)
        products, dh = wgrad_rows(512, gen, decades=2.0), wgrad_rows(256, gen)
    else:
        plan, routed = build_plan(gpu_problem(3000, 128, 128, 64, 2, "skewed")[1], 64), 6000
        products = torch.randn(6000, 1536, generator=gen) * torch.logspace(-2, 2, 6000)[:, None]
        dh = torch.randn(6000, 768, generator=gen)
    products, dh = products.to(torch.bfloat16).cuda(), dh.to(torch.bfloat16).cuda()
    weights = torch.rand(products.shape[0], generator=gen).cuda()
    assert fp8_ws_supported(products, products.dtype)  # the Gluon kernel, not the two steps it is checked against
    busy = plan.tile_expert_NT.lt(plan.offsets_E1.numel() - 1).sum().item()
    dz, hw, *expected = expert_bwd.act_bwd_from_preact(products, dh, weights, plan, 1, quant_dz=True)
    expected += [quant.quantize_tile_cols(dz, plan), quant.quantize_tile_cols(hw, plan)]
    dweight, dzq, dzs, dz_t, hw_t = expert_bwd.act_bwd_tile_cols(products, dh, weights, plan, 1)
    assert torch.equal(dweight, expected[0])
    assert torch.equal(bits(dzq[:routed]), bits(expected[1][:routed]))
    assert torch.equal(dzs[:, :routed], expected[2][:, :routed])
    for name, (q, s), (q_ref, s_ref) in (("dz", dz_t, expected[3]), ("h·w", hw_t, expected[4])):
        assert torch.equal(bits(q[:, :busy * 128]), bits(q_ref[:, :busy * 128])), name
        assert torch.equal(s[:busy], s_ref[:busy]), name
    assert_scale_kind(dz_t[1][:busy], scales)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_fp8_no_host_sync_and_bitwise_deterministic(mode):
    problem = gpu_problem(2048, 1024, 512, 32, 8, "skewed")
    first = run_with_grads(fp8_moe(mode), *problem)  # compiles and caches the weights outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        runs = [run_with_grads(fp8_moe(mode), *problem) for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(first, run))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_fp8_cuda_graph_replays_with_new_routing(mode):
    x, idx, w, w13, w2, dy = gpu_problem(512, 256, 128, 16, 4, "random")
    static_idx = idx.clone()
    leaves = [t.detach().requires_grad_() for t in (x, w, w13, w2)]

    def step():
        y = megamoe.moe(leaves[0], static_idx, leaves[1], leaves[2], leaves[3], precision="fp8",
                        save_for_backward=mode)
        return [y, *torch.autograd.grad(y, leaves, dy)]

    replay, outs = cuda_graphed(step)
    for seed in (1, 2):
        static_idx.copy_(gpu_problem(512, 256, 128, 16, 4, "skewed", seed=seed)[1])
        replay()
        expected = run_with_grads(fp8_moe(mode), x, static_idx, w, w13, w2, dy)
        for a, b in zip(outs, expected):
            assert torch.equal(a, b)
    with torch.no_grad():  # the weights change: the graph quantises them inside, never from a stale copy
        leaves[3].mul_(0.5)
    replay()
    expected = run_with_grads(fp8_moe(mode), x, static_idx, w, w13, leaves[3].detach(), dy)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_fp8_torch_compile_fullgraph_without_recompiles(mode):
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(fp8_moe(mode), fullgraph=True)
    x, idx, w, w13, w2, dy = gpu_problem(512, 256, 128, 16, 4, "random")
    for seed in range(3):
        idx = gpu_problem(512, 256, 128, 16, 4, "skewed" if seed else "random", seed=seed)[1]
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            out = run_with_grads(compiled, x, idx, w, w13, w2, dy)
        expected = run_with_grads(fp8_moe(mode), x, idx, w, w13, w2, dy)
        for a, b in zip(out, expected):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_fp8_custom_ops_pass_opcheck():
    from megamoe import autograd as ops

    x, idx, w, w13, w2, dy = gpu_problem(300, 256, 128, 8, 2, "random")
    plan = plan_op(idx, 8)
    torch.library.opcheck(ops._experts_fwd, (x.requires_grad_(), idx, w.requires_grad_(), w13, w2, *plan, True))
    torch.library.opcheck(ops._experts_bwd, (dy, x.detach(), idx, w.detach(), w13, w2, *plan, None, True))
    torch.library.opcheck(ops._experts_fwd_saved, (x, idx, w, w13, w2, *plan, True))
    _, preact = ops._experts_fwd_saved(x.detach(), idx, w.detach(), w13, w2, *plan, True)
    torch.library.opcheck(ops._experts_bwd, (dy, x.detach(), idx, w.detach(), w13, w2, *plan, preact, True))
