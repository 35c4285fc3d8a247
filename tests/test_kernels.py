"""Fused Triton kernels against the fp32 reference: outputs and every gradient.

On CPU the kernels run in the Triton interpreter (fp32/fp16, small shapes; bf16 is broken in the 3.6
interpreter); the GPU cases (bf16, real sizes, poisoned allocator, no host sync, CUDA graphs,
torch.compile) are marked ``gpu``.
"""

import functools
import itertools

import pytest
import torch

import megamoe
from megamoe import reference
from megamoe.api import backend_for
from megamoe.bench.layer import cuda_graphed
from megamoe.kernels.combine import combine
from megamoe.kernels.plan import BLOCK_M, build_plan, plan_op
from tests.helpers import (
    NAMES,
    SHAPES,
    assert_close_to_reference,
    assert_launches_pass_parameters,
    capture_launches,
    check_block_trace,
    gpu_problem,
    make_problem,
    run_with_grads,
    skewed_expert_rows,
)

# The shape matrix plus cases that exercise several tiles per expert, several K-loop iterations with a
# remainder, and several I-blocks in the backward.
KERNEL_SHAPES = SHAPES + [
    (260, 136, 72, 3, 2, "random"),    # 2+ tiles per expert, D and I not multiples of the blocks
    (150, 128, 128, 2, 2, "dropped"),  # even K loops, a partial last tile, dropped slots
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def shape_id(s):
    return f"T{s[0]}-D{s[1]}-I{s[2]}-E{s[3]}-K{s[4]}-{s[5]}"


@pytest.fixture(autouse=True)
def _uses_kernels():
    assert backend_for(torch.empty(0, device=DEVICE)) == "triton", "these tests must run the Triton kernels"


SAVE_MODES = ["none", "preact"]  # what the forward keeps for the backward (megamoe.moe's save_for_backward)


def moe_in(mode: str):
    return functools.partial(megamoe.moe, save_for_backward=mode)


@pytest.mark.parametrize("mode", SAVE_MODES)
@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=[shape_id(s) for s in KERNEL_SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_matches_fp32_reference(shape, dtype, mode):
    problem = make_problem(*shape, dtype=dtype, device=DEVICE)
    assert_close_to_reference(run_with_grads(moe_in(mode), *problem), problem)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_low_peak_backward_gives_the_dx_first_orders_gradients(monkeypatch, mode, fp8):
    """``autograd.LOW_PEAK_BACKWARD`` (the default: dW13 before dx's slot rows, the dx combine on its own): bit for
    bit the dx-first order's gradients (dx's slot rows summed by the dW13 kernel), eagerly and through the custom
    ops (a checkpointed region's path), in both memory modes and both precisions (with bf16 weight gradients: the
    FP8 ones have one order); the order is the one set when the forward ran."""
    import contextlib

    import megamoe.autograd
    from megamoe.env import forcing_custom_ops
    from megamoe.kernels import backward_fp8

    monkeypatch.setattr(megamoe.autograd, "FP8_WGRAD", False)
    x, idx, w, w13, w2, dy = make_problem(40, 128, 128, 4, 2, "dropped", device=DEVICE)
    layer = functools.partial(megamoe.moe, save_for_backward=mode, precision="fp8" if fp8 else "bf16")
    body = backward_fp8 if fp8 else megamoe.autograd  # the module whose backward body runs
    combined = []
    wgrad_and_combine = body.expert_wgrad_and_combine
    monkeypatch.setattr(body, "expert_wgrad_and_combine", lambda *a: combined.append(1) or wgrad_and_combine(*a))
    monkeypatch.setattr(megamoe.autograd, "LOW_PEAK_BACKWARD", False)
    expected = run_with_grads(layer, x, idx, w, w13, w2, dy)
    assert combined == [1]
    for ops in (contextlib.nullcontext(), forcing_custom_ops(contextlib.nullcontext())):
        with monkeypatch.context() as m:
            m.setattr(body, "expert_wgrad_and_combine",
                      lambda *a: pytest.fail("the low-peak order ran dW13 with the combine"))
            leaves = [t.detach().requires_grad_() for t in (x, w, w13, w2)]
            with ops:
                m.setattr(megamoe.autograd, "LOW_PEAK_BACKWARD", True)
                y = layer(leaves[0], idx, leaves[1], leaves[2], leaves[3])
                m.setattr(megamoe.autograd, "LOW_PEAK_BACKWARD", False)  # the forward's choice holds
                y.backward(dy)
        for name, a, b in zip(NAMES, [y, *(t.grad for t in leaves)], expected):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("fp8", [False, True])
def test_saved_products_become_dz_in_the_eager_backward(monkeypatch, fp8):
    """The eager saved mode's backward writes dz over its saved gate and up products (no (N, 2I) block of its own),
    with the gradients bit for bit those of the custom ops, which give dz a block of its own; the FP8 keep-nothing
    backward does the same with the products it recomputes (with bf16 weight gradients: with FP8 ones no dz is
    written in x's dtype, ``test_fp8_wgrad_backward_writes_x_tile_columns_over_the_saved_products``). A second
    backward through the retained graph of the saved mode fails instead of reading dz as g and u."""
    import contextlib

    import megamoe.autograd
    from megamoe.env import forcing_custom_ops
    from megamoe.kernels import backward_fp8

    monkeypatch.setattr(megamoe.autograd, "FP8_WGRAD", False)
    x, idx, w, w13, w2, dy = make_problem(40, 128, 128, 4, 2, "dropped", device=DEVICE)
    body = backward_fp8 if fp8 else megamoe.autograd  # the module whose backward body runs
    original = body.act_bwd_from_preact
    shared = []  # per act step of a backward: whether dz is in the products' memory

    def spy(preact, *args, **kwargs):
        out = original(preact, *args, **kwargs)
        shared.append(out[0].data_ptr() == preact.data_ptr())
        return out

    monkeypatch.setattr(body, "act_bwd_from_preact", spy)
    for mode in SAVE_MODES:
        if mode == "none" and not fp8:
            continue  # the bf16 keep-nothing backward runs the act step on a recomputed GEMM, with no products
        layer = functools.partial(megamoe.moe, save_for_backward=mode, precision="fp8" if fp8 else "bf16")
        results = []
        for ops in (contextlib.nullcontext(), forcing_custom_ops(contextlib.nullcontext())):
            shared.clear()
            with ops:
                results.append(run_with_grads(layer, x, idx, w, w13, w2, dy))
            # eager: dz over the products; the custom op: over its own recomputed ones only
            assert shared == [mode == "none" or isinstance(ops, contextlib.nullcontext)], (mode, shared)
        for name, a, b in zip(NAMES, *results):
            assert torch.equal(a, b), (mode, name)
    monkeypatch.setattr(body, "act_bwd_from_preact", original)
    leaves = [t.detach().requires_grad_() for t in (x, w, w13, w2)]
    y = megamoe.moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], save_for_backward="preact",
                    precision="fp8" if fp8 else "bf16")
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


def test_fp8_wgrad_backward_writes_x_tile_columns_over_the_saved_products(monkeypatch):
    """With FP8 weight gradients the act step writes no dz in x's dtype (``expert_bwd.act_bwd_tile_cols``), and the
    eager saved mode's backward writes x's tile columns for dW13 over its saved products instead, once the act step
    (their last reader) has run: the gradients bit for bit those of the custom ops, which give the tile columns
    memory of their own. A second backward through the retained graph fails instead of reading them as g and u."""
    import contextlib

    import megamoe.autograd
    from megamoe.env import forcing_custom_ops
    from megamoe.kernels import backward_fp8

    monkeypatch.setattr(megamoe.autograd, "FP8_WGRAD", True)
    monkeypatch.setattr(backward_fp8, "act_bwd_from_preact", lambda *a, **k: pytest.fail("ran the bf16 act step"))
    original = backward_fp8.quantize_tile_cols
    over_products = []  # per tile-column quantisation: whether it wrote into memory handed to it

    def spy(a, plan, top_k=None, over=None, col_amax=None):
        q, s = original(a, plan, top_k, over=over, col_amax=col_amax)
        over_products.append(over is not None and q.untyped_storage().data_ptr() == over.untyped_storage().data_ptr())
        return q, s

    monkeypatch.setattr(backward_fp8, "quantize_tile_cols", spy)
    # products (300, 256) against x's tile columns for 5 plan tiles (128 x 640 bytes and 5 x 128 scales): they fit
    x, idx, w, w13, w2, dy = make_problem(150, 128, 128, 2, 2, "dropped", device=DEVICE)
    layer = functools.partial(megamoe.moe, save_for_backward="preact", precision="fp8")
    results = []
    for ops in (contextlib.nullcontext(), forcing_custom_ops(contextlib.nullcontext())):
        over_products.clear()
        with ops:
            results.append(run_with_grads(layer, x, idx, w, w13, w2, dy))
        # dy's tile columns, then x's: over the products in the eager backward only
        assert over_products == [False, isinstance(ops, contextlib.nullcontext)]
    for name, a, b in zip(NAMES, *results):
        assert torch.equal(a, b), name
    leaves = [t.detach().requires_grad_() for t in (x, w, w13, w2)]
    y = layer(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


@pytest.mark.parametrize("mode", SAVE_MODES)
def test_backward_order_by_default_is_low_peak_in_both_modes(monkeypatch, mode):
    """``MEGAMOE_LOW_PEAK_BACKWARD`` unset (the default of ``autograd.LOW_PEAK_BACKWARD``): the low-peak order in both
    memory modes (dW13 without the dx combine in its launch); ``0`` the dx-first order; anything else is refused."""
    import megamoe.autograd
    from megamoe.env import low_peak_backward_requested

    monkeypatch.delenv("MEGAMOE_LOW_PEAK_BACKWARD", raising=False)
    monkeypatch.setattr(megamoe.autograd, "LOW_PEAK_BACKWARD", low_peak_backward_requested())
    monkeypatch.setattr(megamoe.autograd, "expert_wgrad_and_combine",
                        lambda *a: pytest.fail("the default order ran dW13 with the combine"))
    x, idx, w, w13, w2, dy = make_problem(40, 128, 128, 4, 2, "dropped", device=DEVICE)
    run_with_grads(functools.partial(megamoe.moe, save_for_backward=mode), x, idx, w, w13, w2, dy)
    for value, expected in (("", True), ("0", False), ("1", True)):
        monkeypatch.setenv("MEGAMOE_LOW_PEAK_BACKWARD", value)
        assert low_peak_backward_requested() is expected
    monkeypatch.setenv("MEGAMOE_LOW_PEAK_BACKWARD", "yes")
    with pytest.raises(ValueError, match="MEGAMOE_LOW_PEAK_BACKWARD must be 0, 1 or unset"):
        low_peak_backward_requested()


def test_dx_first_benchmark_impl_runs_that_order_and_restores_the_setting(monkeypatch):
    """The layer benchmark's ``megamoe_saved_dx_first``: the dx-first order (dW13 with the dx combine in its launch) in
    the backward of its own calls, the process's setting as it was afterwards."""
    import megamoe.autograd
    from megamoe.bench.layer import make_impls

    problem = make_problem(40, 48, 24, 6, 3, "dropped", device=DEVICE)
    calls = []
    combined = megamoe.autograd.expert_wgrad_and_combine
    monkeypatch.setattr(megamoe.autograd, "expert_wgrad_and_combine", lambda *a: calls.append(1) or combined(*a))
    before = megamoe.autograd.LOW_PEAK_BACKWARD
    (impl,) = make_impls(["megamoe_saved_dx_first"], DEVICE)
    assert impl.keeps_activations
    assert_close_to_reference(run_with_grads(impl.fn, *problem), problem)
    assert calls == [1]
    assert megamoe.autograd.LOW_PEAK_BACKWARD is before


def test_saved_mode_keeps_the_preactivation_and_skips_the_recompute(monkeypatch):
    """``save_for_backward="preact"``: the forward keeps the gate/up products, (T*K, 2I) in x's dtype and equal
    to them (fp32 operands: exact to rounding), and the backward runs the act step on them instead of the
    recompute GEMM (writing dz over them); ``"none"`` keeps nothing of the kind and recomputes."""
    import megamoe.autograd

    x, idx, w, w13, w2, dy = make_problem(40, 48, 24, 6, 3, "dropped", device=DEVICE)
    inter = w2.shape[2]
    slot_rows = [(t, k) for e in range(w13.shape[0]) for t in range(x.shape[0]) for k in range(idx.shape[1])
                 if idx[t, k] == e]  # the sorted order: by expert, then slot
    for mode, unused in (("preact", "act_bwd"), ("none", "act_bwd_from_preact")):
        with monkeypatch.context() as m:
            m.setattr(megamoe.autograd, unused,
                      lambda *a, mode=mode, unused=unused: pytest.fail(f"{mode}: the backward ran {unused}"))
            leaves = [t.detach().requires_grad_() for t in (x, w, w13, w2)]
            y = megamoe.moe(leaves[0], idx, leaves[1], leaves[2], leaves[3], save_for_backward=mode)
            kept = [t for t in y.grad_fn.saved_tensors if t.shape == (idx.numel(), 2 * inter)]
            if mode == "preact":
                (preact,) = kept
                for row, (t, k) in enumerate(slot_rows):
                    torch.testing.assert_close(preact[row], w13[idx[t, k]] @ x[t], rtol=1e-5, atol=1e-5)
            else:
                assert kept == []
            y.backward(dy)
    with pytest.raises(ValueError, match="save_for_backward must be one of"):
        megamoe.moe(x, idx, w, w13, w2, save_for_backward="h")


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values, contiguous, starting one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.copy_(t.reshape(-1)).view(t.shape)


def test_rows_tma_cannot_take_warn_and_run_the_reference(monkeypatch):
    import megamoe.api
    import megamoe.env

    monkeypatch.setattr(megamoe.env, "_warned", set())
    monkeypatch.setattr(megamoe.api, "fused_moe", lambda *a: pytest.fail("the fused path ran"))
    problem = make_problem(20, 32, 20, 4, 2, "random", dtype=torch.float16, device=DEVICE)  # 40-byte I rows
    with pytest.warns(UserWarning, match="not 16-byte multiples"):
        out = run_with_grads(megamoe.moe, *problem)
    # the per-expert loop (torch._grouped_mm cannot take these rows either), itself checked against fp32 in
    # tests/test_reference.py
    for name, got, want in zip(NAMES, out, run_with_grads(reference.moe_loop, *problem)):
        assert torch.equal(got, want), name


def test_misaligned_weights_warn_and_still_run_fused(monkeypatch):
    """A weight starting off a 16-byte boundary (a view into a larger buffer) is copied for TMA."""
    import megamoe.env

    monkeypatch.setattr(megamoe.env, "_warned", set())
    x, idx, w, w13, w2, dy = make_problem(20, 32, 16, 4, 2, "random", device=DEVICE)
    problem = (x, idx, w, misaligned(w13), misaligned(w2), dy)
    assert problem[3].data_ptr() % 16 and torch.equal(problem[3], w13)
    with pytest.warns(UserWarning, match="16-byte aligned"):
        out = run_with_grads(megamoe.moe, *problem)
    assert_close_to_reference(out, problem)


def test_fused_path_check_traces_under_torch_compile():
    """``fused_supports`` runs inside a ``torch.compile(fullgraph=True)`` region (no data_ptr, no
    storage_offset: Dynamo traces neither)."""
    from megamoe.api import fused_supports

    x, _, _, _, w2, _ = make_problem(4, 32, 16, 4, 2, "random", device=DEVICE)
    fn = torch.compile(lambda x, w2: x * 2 if fused_supports(x, w2) else x * 3, fullgraph=True, backend="eager")
    assert torch.equal(fn(x, w2), x * 2)


@pytest.mark.parametrize("mode", SAVE_MODES)
def test_compiled_custom_ops_equal_the_eager_path(monkeypatch, mode):
    """Under ``torch.compile(fullgraph=True)`` the layer runs as custom ops (eagerly, an autograd.Function, which
    skips their dispatch layers): the same kernels, so the same bits, outputs and every gradient (the expert-id
    check is an assert in the graph, not a host read)."""
    import torch._dynamo

    import megamoe.autograd

    problem = make_problem(40, 32, 16, 6, 3, "random", device=DEVICE)
    expected = run_with_grads(moe_in(mode), *problem)
    torch._dynamo.reset()
    monkeypatch.setattr(megamoe.autograd._FusedMoE, "apply", lambda *a: pytest.fail("the eager path was traced"))
    out = run_with_grads(torch.compile(moe_in(mode), backend="aot_eager", fullgraph=True), *problem)
    for name, a, b in zip(NAMES, out, expected):
        assert torch.equal(a, b), name


PLAN_CASES = [
    (400, 3, 7),    # several chunks, one popular expert with several tiles
    (200, 8, 128),  # the real expert count and top-k
    (1, 1, 1),      # one slot, one expert
    (5, 2, 300),    # more experts than slots: most are empty
]


def test_sub_tiles_match_fp32_reference(monkeypatch):
    """BM smaller than the plan's tile (a kernel config the sweep may pick) covers every row once."""
    from megamoe.kernels import expert_bwd, expert_fwd

    for kernel in (expert_fwd.UP, expert_fwd.DOWN, expert_bwd.DH, expert_bwd.ACT_BWD, expert_bwd.DX):
        monkeypatch.setattr(kernel, "default", {**kernel.default, "BM": 64, "BN": 64, "BK": 32})
    problem = make_problem(260, 136, 72, 3, 2, "random", device=DEVICE)
    assert_close_to_reference(run_with_grads(megamoe.moe, *problem), problem)


def use_the_other_launch_mode(monkeypatch):
    """dh', down and dx with the PERSISTENT setting their defaults do not use (autotuning may pick
    either): a persistent kernel must visit every busy tile once, a tile-grid one must skip idle tiles."""
    from megamoe.kernels import expert_bwd, expert_fwd

    for kernel in (expert_fwd.DOWN, expert_bwd.DH, expert_bwd.DX):
        monkeypatch.setattr(kernel, "default", {**kernel.default, "PERSISTENT": not kernel.default["PERSISTENT"]})


OTHER_MODE_SHAPES = [s for s in KERNEL_SHAPES if s[0] in (1, 17, 29, 37, 260, 150)]


@pytest.mark.parametrize("shape", OTHER_MODE_SHAPES, ids=[shape_id(s) for s in OTHER_MODE_SHAPES])
def test_other_launch_mode_matches_fp32_reference(monkeypatch, shape):
    use_the_other_launch_mode(monkeypatch)
    problem = make_problem(*shape, device=DEVICE)
    assert_close_to_reference(run_with_grads(megamoe.moe, *problem), problem)


def test_every_config_writes_every_weight_gradient_partial(monkeypatch):
    """What autotuning relies on: after a config with narrow blocks, a config with wide blocks run on
    the same (dirty) partial buffer must leave no stale partial behind."""
    from megamoe.kernels import expert_bwd

    x, idx, w, w13, w2, dy = make_problem(260, 136, 200, 3, 2, "random", device=DEVICE)
    plan = build_plan(idx, 3)
    x_sorted, dy_sorted = expert_bwd.gather_rows(x, dy, plan, 2)
    operands, kernel = (x_sorted, expert_bwd.dh_sorted(dy_sorted, w2, plan)), expert_bwd.ACT_BWD
    _, _, expected = expert_bwd.act_bwd(*operands, w13, w, plan, 2)
    n = idx.numel()
    dz = torch.empty(n, 400, device=DEVICE)
    hw = torch.empty(n, 200, device=DEVICE)
    part = torch.zeros(-(-200 // expert_bwd.PART_COLS), n, device=DEVICE)
    for bn in (64, 128):  # first writes every 64-column group itself, then the wide config must too
        monkeypatch.setattr(kernel, "default", {**kernel.default, "BN": bn})  # BK as for `expected`: same sums
        part.add_(1000.0)  # dirty every partial, as a previous config's run would
        expert_bwd.act_bwd_into(*operands, w13, w, plan, dz, hw, part)
        assert kernel.last_config["BN"] == bn  # what the kernel benchmark records
    assert torch.equal(part.sum(0).view(-1, 2), expected)


@pytest.mark.parametrize("num_tokens,top_k,num_experts", PLAN_CASES)
def test_plan_is_a_stable_sort_with_a_complete_tile_table(num_tokens, top_k, num_experts, monkeypatch):
    from megamoe.kernels import plan as plan_module

    monkeypatch.setattr(plan_module, "SCAN_BLOCK", 4)  # several steps of the column scan
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, num_experts, (num_tokens, top_k), generator=gen)
    idx[:, 0] = min(2, num_experts - 1)  # one popular expert
    plan = build_plan(idx.to(DEVICE), num_experts)
    flat = idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)
    expected_order = torch.sort(key, stable=True).indices
    assert torch.equal(plan.row_slot_N.cpu().long(), expected_order)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    assert plan.tile_expert_NT.numel() == -(-flat.numel() // BLOCK_M) + num_experts
    assert torch.equal(plan.offsets_E1.cpu().long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    # Every routed row is covered by exactly one tile of its own expert.
    cover = torch.zeros(flat.numel(), dtype=torch.long)
    for e, r0 in zip(plan.tile_expert_NT.cpu().tolist(), plan.tile_row_NT.cpu().tolist()):
        if e == num_experts:
            continue
        end = min(r0 + BLOCK_M, int(plan.offsets_E1[e + 1]))
        assert int(plan.offsets_E1[e]) <= r0 < end
        cover[r0:end] += 1
    n_routed = int((flat >= 0).sum())
    assert torch.equal(cover[:n_routed], torch.ones(n_routed, dtype=torch.long))


@pytest.mark.parametrize("counts,num_rows", [([3, 0, 200, 1], 300), ([0, 0], 5), ([130, 130, 130], 300)],
                         ids=["gaps and unused rows", "nothing routed", "clipped at num_rows"])
def test_plan_from_counts_equals_the_sorting_plan(counts, num_rows):
    """Rows already grouped by expert (an EP owner's receive buffer): the plan from the counts is the
    plan the counting sort builds for the same rows."""
    from megamoe.kernels.plan import plan_from_counts

    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))[:num_rows]
    idx = torch.full((num_rows,), -1, dtype=torch.int32)
    idx[: ids.numel()] = ids.to(torch.int32)
    expected = build_plan(idx.to(DEVICE)[:, None], len(counts))
    got = plan_from_counts(torch.tensor(counts, dtype=torch.int32, device=DEVICE), num_rows)
    for a, b in zip(got.tensors(), expected.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("counts", [[5], [3, 0, 9, 9, 1, 0, 9], list(range(130, 0, -1)), [0, 0, 0]],
                         ids=["one expert", "ties and empty experts", "130 experts (past a power of two)", "no rows"])
def test_experts_by_size_orders_the_experts_by_rows_most_first(counts):
    """The weight gradients' size order (``plan.experts_by_size``): each expert once, by rows descending, ties in index
    order, with its sorted rows [start, end) from the offsets."""
    from megamoe.kernels.plan import experts_by_size

    gen = torch.Generator().manual_seed(len(counts))
    counts = torch.tensor(counts)[torch.randperm(len(counts), generator=gen)]  # not given in order
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    order = sorted(range(len(counts)), key=lambda e: (-int(counts[e]), e))
    expected = torch.tensor([[e, offsets[e], offsets[e + 1]] for e in order], dtype=torch.int32)
    assert torch.equal(experts_by_size(offsets.to(DEVICE)).cpu(), expected)


def test_combine_moves_rows_exactly():
    num_tokens, top_k, dim = 37, 3, 40
    idx = torch.randint(0, 4, (num_tokens, top_k))
    idx[::5, 1] = -1
    # Index-derived payloads: row n holds n*1000 + column, exact in fp32.
    rows = (torch.arange(num_tokens * top_k)[:, None] * 1000 + torch.arange(dim)[None, :]).float()
    rows[idx.reshape(-1) < 0] = float("nan")  # dropped slots' rows are never written: must not be read
    out = combine(rows.to(DEVICE), idx.to(DEVICE), torch.float32).cpu()
    expected = torch.where((idx >= 0)[:, :, None], rows.view(num_tokens, top_k, dim), 0).sum(1)
    assert torch.equal(out, expected)


def test_empty_batch():
    """T = 0 (an empty micro-batch): empty outputs, zero weight gradients, no launch errors."""
    x, idx, w, w13, w2, dy = make_problem(0, 32, 16, 4, 2, "random", device=DEVICE)
    y, dx, dw, dw13, dw2 = run_with_grads(megamoe.moe, x, idx, w, w13, w2, dy)
    assert y.shape == (0, 32) and dx.shape == (0, 32) and dw.shape == (0, 2)
    assert torch.equal(dw13, torch.zeros_like(dw13)) and torch.equal(dw2, torch.zeros_like(dw2))


def test_experts_without_tokens_get_exactly_zero_gradients():
    problem = make_problem(29, 32, 16, 8, 2, "empty", device=DEVICE)
    *_, dw13, dw2 = run_with_grads(megamoe.moe, *problem)
    used = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    used[problem[1][problem[1] >= 0].unique()] = True
    assert (~used).any()
    assert torch.equal(dw13[~used], torch.zeros_like(dw13[~used]))
    assert torch.equal(dw2[~used], torch.zeros_like(dw2[~used]))


def test_dropped_slots_get_zero_weight_gradient():
    problem = make_problem(31, 32, 16, 6, 3, "dropped", device=DEVICE)
    _, _, dw, _, _ = run_with_grads(megamoe.moe, *problem)
    dropped = problem[1] < 0
    assert dropped.any() and torch.equal(dw[dropped], torch.zeros_like(dw[dropped]))


@pytest.mark.parametrize("mode", SAVE_MODES)
def test_bitwise_deterministic(mode):
    problem = make_problem(260, 136, 72, 3, 2, "random", dtype=torch.float16, device=DEVICE)
    first = run_with_grads(moe_in(mode), *problem)
    second = run_with_grads(moe_in(mode), *problem)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [
    (4096, 2048, 768, 128, 8, "random"),   # Qwen3-30B-A3B layer
    (1024, 4096, 1536, 128, 8, "random"),  # Qwen3-235B-A22B layer
    (3000, 1024, 512, 64, 8, "skewed"),
    (777, 520, 200, 13, 4, "dropped"),     # nothing a multiple of the tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + GPU_SHAPES, ids=[shape_id(s) for s in SHAPES + GPU_SHAPES])
def test_fused_bf16_gpu_matches_fp32_reference(shape, poison_cuda):
    problem = gpu_problem(*shape)
    assert_close_to_reference(run_with_grads(megamoe.moe, *problem), problem)


# The saved-activation mode on the GPU: the real layers and the shapes off every block size.
SAVED_GPU_SHAPES = [SHAPES[0], SHAPES[-1], *GPU_SHAPES]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SAVED_GPU_SHAPES, ids=[shape_id(s) for s in SAVED_GPU_SHAPES])
def test_saved_mode_bf16_gpu_matches_fp32_reference(shape, poison_cuda):
    problem = gpu_problem(*shape)
    assert_close_to_reference(run_with_grads(moe_in("preact"), *problem), problem)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [GPU_SHAPES[0], GPU_SHAPES[-1]], ids=shape_id)
def test_saved_mode_gluon_up_kernel_keeps_the_products_of_the_keep_nothing_forward(shape, monkeypatch, poison_cuda):
    """On sm90 the saved mode's forward runs the Gluon up kernel (never the Triton one): y bitwise the keep-nothing
    forward's, and each kept row the fp32 gate/up products of its token, rounded to bf16 once."""
    from megamoe.kernels import expert_fwd

    x, idx, w, w13, w2, _ = gpu_problem(*shape)
    y_none = megamoe.moe(x, idx, w, w13, w2)
    monkeypatch.setattr(expert_fwd, "_launch_up", lambda *a, **k: pytest.fail("the Triton up kernel ran"))
    leaves = [t.detach().requires_grad_() for t in (w, w13)]
    y = megamoe.moe(x, idx, leaves[0], leaves[1], w2, save_for_backward="preact")
    assert torch.equal(y, y_none)
    (preact,) = [t for t in y.grad_fn.saved_tensors if t.shape == (idx.numel(), w13.shape[1])]
    flat = idx.reshape(-1).to(torch.int64)
    routed = int((flat >= 0).sum())  # dropped slots (-1) have no row: rows past the routed count are not written
    order = torch.sort(torch.where(flat < 0, w13.shape[0], flat), stable=True).indices[:routed]  # by expert, slot
    token, expert = order // idx.shape[1], flat[order]
    want = torch.empty(routed, preact.shape[1], device=preact.device)
    for e in range(w13.shape[0]):  # the reference, one matmul per expert (a test, not the hot path)
        rows = (expert == e).nonzero().squeeze(1)
        want[rows] = x[token[rows]].float() @ w13[e].float().T
    torch.testing.assert_close(preact[:routed], want.to(preact.dtype), rtol=1.6e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 2048, 768, 16, 4, "random"), (300, 520, 200, 13, 4, "dropped")],
                         ids=shape_id)
def test_fused_fp32_gpu_matches_fp32_reference(shape, poison_cuda):
    """fp32 operands at real widths (tiles are tuned for 16-bit; fp32 must still fit shared memory)."""
    problem = make_problem(*shape, dtype=torch.float32, device="cuda")
    assert_close_to_reference(run_with_grads(megamoe.moe, *problem), problem)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_autotuned_configs_match_fp32_reference(monkeypatch, poison_cuda, mode):
    """The layer's default mode: Triton's autotuner picks each kernel's config on first use; later calls
    launch that config directly (bitwise the first call's results, which the chosen config computed). In the saved
    mode the act step writes dz over the products it reads, so its autotuning (from a fresh state here) must put
    them back after each trial."""
    from megamoe.kernels.expert_bwd import ACT_FROM_PREACT

    monkeypatch.setenv("MEGAMOE_AUTOTUNE", "1")
    monkeypatch.setattr(ACT_FROM_PREACT, "_chosen", {})
    monkeypatch.setattr(ACT_FROM_PREACT._tuned, "cache", {})
    problem = gpu_problem(2048, 1024, 512, 32, 4, "skewed")
    first = run_with_grads(moe_in(mode), *problem)
    assert_close_to_reference(first, problem)
    assert all(torch.equal(a, b) for a, b in zip(first, run_with_grads(moe_in(mode), *problem)))


@pytest.mark.gpu
def test_other_launch_mode_bf16_gpu_matches_fp32_reference(monkeypatch, poison_cuda):
    use_the_other_launch_mode(monkeypatch)
    problem = gpu_problem(2048, 1024, 512, 32, 4, "skewed")
    assert_close_to_reference(run_with_grads(megamoe.moe, *problem), problem)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_no_host_sync_in_forward_and_backward(mode):
    problem = gpu_problem(512, 256, 128, 16, 4, "random")
    run_with_grads(moe_in(mode), *problem)  # compile outside the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_with_grads(moe_in(mode), *problem)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_cuda_graph_replays_with_new_routing(mode):
    x, idx, w, w13, w2, dy = gpu_problem(512, 256, 128, 16, 4, "random")
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    static_idx = idx.clone()

    def step():
        y = megamoe.moe(leaves[0], static_idx, leaves[1], leaves[2], leaves[3], save_for_backward=mode)
        return [y, *torch.autograd.grad(y, leaves, dy)]

    replay, outs = cuda_graphed(step)
    for seed in (1, 2):
        new_idx = gpu_problem(512, 256, 128, 16, 4, "skewed", seed=seed)[1]
        static_idx.copy_(new_idx)
        replay()
        expected = run_with_grads(moe_in(mode), x, new_idx, w, w13, w2, dy)
        for a, b in zip(outs, expected):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
def test_torch_compile_fullgraph_without_recompiles(mode):
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(moe_in(mode), fullgraph=True)
    x, idx, w, w13, w2, dy = gpu_problem(512, 256, 128, 16, 4, "random")
    for seed in range(3):  # different per-expert counts each step
        idx = gpu_problem(512, 256, 128, 16, 4, "skewed" if seed else "random", seed=seed)[1]
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            out = run_with_grads(compiled, x, idx, w, w13, w2, dy)
        expected = run_with_grads(moe_in(mode), x, idx, w, w13, w2, dy)
        for a, b in zip(out, expected):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", SAVE_MODES)
@pytest.mark.parametrize("low_peak", [False, True])
def test_backward_peak_memory_frees_dy_rows_before_the_dx_rows_and_dw13(monkeypatch, low_peak, mode):
    """The backward's peak (bf16) over what it starts with: the larger of its two busiest moments, the act step (x
    and dy sorted rows, dh', dz, h·w) and dW13 with the dx combine (x rows, dz, dx slot rows, and the gradients:
    dw2, dw13, dx), within 5% -- so dy's rows and h·w must be freed before dx's rows and dW13 are allocated (held
    until the end, they add N·(D + I) elements to the second moment). In the low-peak order
    (``autograd.LOW_PEAK_BACKWARD``) dW13 and the dx GEMM each hold one N x D block (x's rows, then dx's slot rows)
    beside dz and the gradients. In the saved mode dz takes the saved products' memory (counted in the start)."""
    import megamoe.autograd

    monkeypatch.setattr(megamoe.autograd, "LOW_PEAK_BACKWARD", low_peak)
    # Weights large beside the rows (as at the real layers), so that dW13's moment is the peak, and the low-peak
    # order's bound lies under the default order's peak.
    T, D, I, E, K = 4096, 512, 256, 64, 4
    x, idx, w, w13, w2, dy = gpu_problem(T, D, I, E, K, "random")
    leaves = [t.requires_grad_() for t in (x, w, w13, w2)]
    y = megamoe.moe(x, idx, w, w13, w2, save_for_backward=mode)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y.backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    n = T * K
    dz = 0 if mode == "preact" else 2 * 2 * n * I
    act_step = 2 * (2 * n * D + 2 * n * I) + dz
    grads = sum(t.numel() * t.element_size() for t in leaves)
    dw13_step = 2 * (1 if low_peak else 2) * n * D + dz + grads
    assert peak <= 1.05 * max(act_step, dw13_step), (peak, act_step, dw13_step)


@pytest.mark.gpu
def test_custom_ops_pass_opcheck():
    from megamoe import autograd as ops

    x, idx, w, w13, w2, dy = gpu_problem(300, 128, 64, 8, 2, "random")
    plan = plan_op(idx, 8)
    torch.library.opcheck(plan_op, (idx, 8))
    torch.library.opcheck(ops._experts_fwd, (x.requires_grad_(), idx, w.requires_grad_(), w13, w2, *plan))
    torch.library.opcheck(ops._experts_bwd, (dy, x.detach(), idx, w.detach(), w13, w2, *plan, None))
    torch.library.opcheck(ops._experts_fwd_saved, (x, idx, w, w13, w2, *plan))
    _, preact = ops._experts_fwd_saved(x.detach(), idx, w.detach(), w13, w2, *plan)
    torch.library.opcheck(ops._experts_bwd, (dy, x.detach(), idx, w.detach(), w13, w2, *plan, preact))


@pytest.mark.gpu
def test_recomputed_forward_is_bitwise_equal_under_checkpointing():
    from torch.utils.checkpoint import checkpoint

    problem = gpu_problem(2048, 1024, 512, 32, 4, "random")
    plain = run_with_grads(megamoe.moe, *problem)
    ckpt = run_with_grads(lambda *a: checkpoint(megamoe.moe, *a, use_reentrant=False), *problem)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_every_weight_gradient_config_matches_a_per_expert_reference(monkeypatch):
    """Each config autotuning may pick for the weight gradients (tile shapes, warps) gives each expert's
    sum of outer products, an expert without rows exact zeros, over experts whose rows end mid-step."""
    from megamoe.kernels import expert_bwd

    x, idx, _, _, _, dy = make_problem(150, 136, 72, 5, 2, "skewed", device=DEVICE)
    idx[idx == 3] = 4  # expert 3 gets no rows
    plan = build_plan(idx, 5)
    x_sorted, dy_sorted = expert_bwd.gather_rows(x, dy, plan, 2)
    bounds = plan.offsets_E1.tolist()
    expected = torch.stack([x_sorted[lo:hi].T @ dy_sorted[lo:hi] for lo, hi in itertools.pairwise(bounds)])
    for config in [expert_bwd.WGRAD.default, *expert_bwd.WGRAD.candidates]:
        monkeypatch.setattr(expert_bwd.WGRAD, "default", config)
        dw = expert_bwd.expert_wgrad(x_sorted, dy_sorted, plan, x.dtype, gemm=None)
        assert torch.equal(dw[3], torch.zeros_like(dw[3])), config
        torch.testing.assert_close(dw, expected, rtol=1e-5, atol=1e-4, msg=lambda m, c=config: f"{c}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("p, q, counts", [
    (136, 72, [0, 1, 63, 64, 65, 200, 0, 130]),  # P, Q past the tile; experts empty, under one step, mid-step
    (1536, 2048, [1024 + 37 * (i % 5) - 70 for i in range(128)]),  # the 30B dW13 shape at 16k tokens
    (1536, 2048, [40 + 30 * (i % 3) for i in range(128)]),  # ~60 blocks per program of 2-4 K-steps
    # empty experts between non-empty ones in one program's blocks, and blocks of one K-step
    (1536, 2048, [(0, 1, 17, 32, 33, 40)[i % 6] for i in range(128)]),
])
@pytest.mark.parametrize("taken", [False, True], ids=["dealt", "taken"])
def test_warp_specialized_weight_gradients_match_a_per_expert_reference(p, q, counts, taken, poison_cuda):
    """The Gluon kernel on the GPU, its blocks dealt before the launch or taken in turn (``gluon_sm90.WGRAD_TAKEN``):
    each expert's sum of outer products, an empty expert exact zeros, and rows past the last expert (never written:
    NaN here) or of the next expert never leak in."""
    from megamoe.kernels.gluon_sm90 import expert_wgrad_ws

    offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device="cuda")
    routed = int(offsets[-1])
    a = torch.randn(routed + 45, p, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(routed + 45, q, device="cuda", dtype=torch.bfloat16)
    a[routed:], b[routed:] = float("nan"), float("nan")
    dw = torch.empty(len(counts), p, q, device="cuda", dtype=torch.bfloat16)
    expert_wgrad_ws(a, b, offsets, dw, taken=taken)
    bounds = offsets.tolist()
    expected = torch.stack([a[lo:hi].float().T @ b[lo:hi].float() for lo, hi in itertools.pairwise(bounds)])
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), e
    torch.testing.assert_close(dw.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def act_reference(x_sorted, dh, w13, weights_TK, plan, routed):
    """The act step in fp32 from the sorted x rows and dh' (the formulas of docs/DESIGN.md, "Backward"): dz = [dg | du]
    times the routing weight, h·w for the routed sorted rows, and each slot's d(routing weight) = dh'·h (dropped
    slots 0)."""
    inter = w13.shape[1] // 2
    bounds = itertools.pairwise(plan.offsets_E1.tolist())
    gu = torch.cat([x_sorted[lo:hi].float() @ w13[e].float().T for e, (lo, hi) in enumerate(bounds)])
    g, u = gu[:, :inter], gu[:, inter:]
    slots = plan.row_slot_N[:routed].long()
    w = weights_TK.reshape(-1)[slots].float()[:, None]
    d = dh[:routed].float()
    sig = torch.sigmoid(g)
    silu = g * sig
    h = silu * u
    dz = torch.cat([d * u * (sig + silu * (1 - sig)) * w, d * silu * w], dim=1)
    dweight = torch.zeros(plan.row_slot_N.numel(), device=d.device)
    dweight[slots] = (d * h).sum(1)
    return dz, h * w, dweight


@pytest.mark.parametrize("shape", [(40, 48, 72, 5, 2, "dropped"), (33, 32, 136, 4, 3, "empty")], ids=str)
def test_act_kernel_computes_the_formula(shape):
    """The act kernel (``act_bwd_into``: the Triton kernel in the interpreter, the Gluon one on sm90) against the act
    step written in fp32 (``act_reference``), the reference the Gluon kernel's GPU test checks too: dz, h·w and the
    d(routing weight) per slot; I past the tile and over two 64-column partial groups, dropped slots, an expert
    without rows."""
    from megamoe.kernels import expert_bwd

    x, idx, weights, w13, w2, dy = make_problem(*shape, device=DEVICE)
    plan = build_plan(idx, shape[3])
    routed = int(plan.offsets_E1[-1])
    x_sorted, dy_sorted = expert_bwd.gather_rows(x, dy, plan, shape[4])
    dh = expert_bwd.dh_sorted(dy_sorted, w2, plan)
    dz, hw, part = expert_bwd.act_bwd_outputs(plan.row_slot_N.numel(), 2 * shape[2], x)
    expert_bwd.act_bwd_into(x_sorted, dh, w13, weights, plan, dz, hw, part)
    for got, want in zip((dz[:routed], hw[:routed], part.sum(0)), act_reference(x_sorted, dh, w13, weights, plan, routed)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def edge_routing_problem(num_tokens, dim, inter, num_experts, top_k):
    """A skewed bf16 problem on the GPU with expert 3 given no rows and every 7th token's first slot dropped;
    returns the problem, its plan and the routed row count."""
    problem = make_problem(num_tokens, dim, inter, num_experts, top_k, "skewed", device="cuda", dtype=torch.bfloat16)
    idx = problem[1]
    idx[idx == 3] = 4  # expert 3 gets no rows
    idx[::7, 0] = -1  # dropped slots
    plan = build_plan(idx, num_experts)
    return problem, plan, int(plan.offsets_E1[-1])


GLUON_SHAPES = [(300, 136, 72, 5, 2), (4096, 2048, 768, 128, 8)]  # D, I past the tile; the 30B layer's D and I
# The side copies move 8 // top_k items per pass (ws._items_per_pass): also top_k 1 and 3, with item counts
# that are not a multiple of it and D over several of the copies' column chunks.
SIDE_COPY_SHAPES = [*GLUON_SHAPES, (1001, 2088, 72, 5, 1), (333, 520, 72, 5, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, dim, inter, num_experts, top_k", GLUON_SHAPES)
def test_warp_specialized_dh_matches_a_per_expert_reference(num_tokens, dim, inter, num_experts, top_k, poison_cuda):
    """The Gluon dh' kernel on the GPU: every routed sorted row equals dy_row W2[e] in fp32, with an expert
    without rows, dropped slots, and NaN rows past the routed ones (read by the last tile, never stored)."""
    from megamoe.kernels import expert_bwd
    from megamoe.kernels.gluon_sm90 import ws_supported

    (_, _, _, _, w2, _), plan, routed = edge_routing_problem(num_tokens, dim, inter, num_experts, top_k)
    dy_sorted = torch.randn(plan.row_slot_N.numel(), dim, device="cuda", dtype=torch.bfloat16)
    dy_sorted[routed:] = float("nan")
    assert ws_supported(dy_sorted)
    bounds = itertools.pairwise(plan.offsets_E1.tolist())
    expected = torch.cat([dy_sorted[lo:hi].float() @ w2[e].float() for e, (lo, hi) in enumerate(bounds)])
    got = expert_bwd.dh_sorted(dy_sorted, w2, plan)[:routed]
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, dim, inter, num_experts, top_k", SIDE_COPY_SHAPES)
def test_dh_kernel_copies_x_into_sorted_rows_beside_its_mmas(num_tokens, dim, inter, num_experts, top_k, poison_cuda):
    """``sorted_rows_and_dh`` on the GPU, where the dh' kernel copies x's rows beside its MMAs: the routed
    x and dy rows equal ``gather_rows``' and dh' equals the kernel's without the copy, bit for bit (an expert
    without rows, dropped slots; D inside one of the copy's 1 024-column chunks and over two)."""
    from megamoe.kernels import expert_bwd

    (x, _, _, _, w2, dy), plan, routed = edge_routing_problem(num_tokens, dim, inter, num_experts, top_k)
    x_sorted, dy_sorted, dh = expert_bwd.sorted_rows_and_dh(x, dy, w2, plan, top_k)
    want_x, want_dy = expert_bwd.gather_rows(x, dy, plan, top_k)
    assert torch.equal(x_sorted[:routed], want_x[:routed])
    assert torch.equal(dy_sorted[:routed], want_dy[:routed])
    assert torch.equal(dh[:routed], expert_bwd.dh_sorted(want_dy, w2, plan)[:routed])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, dim, inter, num_experts, top_k", SIDE_COPY_SHAPES)
def test_weight_gradient_kernel_combines_dx_beside_its_mmas(num_tokens, dim, inter, num_experts, top_k, poison_cuda):
    """``expert_wgrad_and_combine`` on the GPU, where the dW13 kernel reduces the dx slot rows beside its
    MMAs: dW and the combined rows equal ``expert_wgrad`` and ``combine`` bit for bit, with dropped slots
    whose rows hold NaN (never read), an expert without rows; D inside one of the combine's 512-column chunks
    and over four."""
    from megamoe.kernels import expert_bwd

    (x, idx, _, _, _, dy), plan, _ = edge_routing_problem(num_tokens, dim, inter, num_experts, top_k)
    x_sorted, dy_sorted = expert_bwd.gather_rows(x, dy, plan, top_k)
    slots = torch.randn(idx.numel(), dim, device="cuda", dtype=torch.bfloat16)
    slots[(idx.reshape(-1) < 0).nonzero().squeeze(1)] = float("nan")
    dw, combined = expert_bwd.expert_wgrad_and_combine(x_sorted, dy_sorted, plan, x.dtype, slots, idx, x.dtype)
    assert torch.equal(dw, expert_bwd.expert_wgrad(x_sorted, dy_sorted, plan, x.dtype, gemm="dw13"))
    want = combine(slots, idx, x.dtype)
    assert not want.isnan().any()
    assert torch.equal(combined, want)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, dim, inter, num_experts, top_k", GLUON_SHAPES)
def test_warp_specialized_act_kernel_matches_the_triton_kernel(num_tokens, dim, inter, num_experts, top_k, poison_cuda):
    """The Gluon act kernel on the GPU against the act step in fp32 (``act_reference``) and the Triton kernel on the
    same sorted rows and dh': dz and h·w of every routed row, every d(routing weight) partial, and exact zeros for
    dropped slots' partials (I past the tile, an expert without rows, rows past the routed ones never written: NaN
    here)."""
    from megamoe.kernels import expert_bwd

    (x, idx, weights, w13, w2, dy), plan, routed = edge_routing_problem(num_tokens, dim, inter, num_experts, top_k)
    x_sorted, dy_sorted = expert_bwd.gather_rows(x, dy, plan, top_k)
    dh = expert_bwd.dh_sorted(dy_sorted, w2, plan)

    def act(gluon):
        dz, hw, part = expert_bwd.act_bwd_outputs(plan.row_slot_N.numel(), 2 * inter, x)
        expert_bwd.act_bwd_into(x_sorted, dh, w13, weights, plan, dz, hw, part, gluon=gluon)
        return dz[:routed].float(), hw[:routed].float(), part

    outs = {gluon: act(gluon) for gluon in (True, False)}
    for got, want in zip(outs[True], outs[False]):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    dz, hw, part = outs[True]
    for got, want in zip((dz, hw, part.sum(0)), act_reference(x_sorted, dh, w13, weights, plan, routed)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    dropped = (idx.reshape(-1) < 0).nonzero().squeeze(1)
    assert torch.equal(outs[True][2][:, dropped], torch.zeros_like(outs[True][2][:, dropped]))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, dim, inter, num_experts, top_k", GLUON_SHAPES)
def test_warp_specialized_up_kernel_matches_a_per_expert_reference(num_tokens, dim, inter, num_experts, top_k,
                                                                   poison_cuda):
    """The Gluon up kernel (x rows gathered from their tokens by cp.async) on the GPU: h of every routed
    sorted row equals silu(x W1[e]^T) * (x W3[e]^T) in fp32, with D and I past the tile, an expert without
    rows and dropped slots; and the same h as the Triton kernel; storing the gate/up products beside h (the saved
    mode), the same h and those products in fp32."""
    from megamoe.kernels import expert_fwd
    from megamoe.kernels.gluon_sm90 import ws_supported

    (x, _, _, w13, _, _), plan, routed = edge_routing_problem(num_tokens, dim, inter, num_experts, top_k)
    assert ws_supported(x)
    rows_x = x[plan.row_slot_N[:routed].long() // top_k].float()
    bounds = itertools.pairwise(plan.offsets_E1.tolist())
    gu = torch.cat([rows_x[lo:hi] @ w13[e].float().T for e, (lo, hi) in enumerate(bounds)])
    expected = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    h = expert_fwd.up_swiglu_fwd(x, w13, plan, top_k)[:routed]
    preact = torch.empty(plan.row_slot_N.numel(), 2 * inter, device="cuda", dtype=x.dtype)
    h_saved = expert_fwd.up_swiglu_fwd(x, w13, plan, top_k, preact_NH=preact)[:routed]
    got = h.float()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    torch.testing.assert_close(h_saved.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    torch.testing.assert_close(preact[:routed].float(), gu, rtol=1e-2, atol=1e-2 * gu.abs().max().item())
    triton_h = expert_fwd.up_swiglu_fwd(x, w13, plan, top_k, gluon=False)[:routed].float()
    torch.testing.assert_close(got, triton_h, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["up", "up_saved", "dh", "act", "dw13", "dw13_alone", "dw2"])
def test_warp_specialized_kernel_traced_is_bitwise_the_untraced_and_stamps_every_block(kernel):
    """The bf16 Gluon kernels' block trace (``trace=``, read by ``tools.kernels_trace``) changes no output bit, and
    every program's MMA partition (and the act kernel's epilogue partition) stamps each of its blocks in time order,
    each kernel launched as the tool launches it; among the weight gradients' blocks, an expert without rows."""
    from megamoe.bench.common import make_problem as bench_problem
    from megamoe.kernels import gluon_sm90 as g
    from tools.kernels_trace import launches

    num_tokens, dim, inter, num_experts, top_k = 1024, 512, 256, 16, 4
    problem = list(bench_problem(num_tokens, dim, inter, num_experts, top_k, "random", torch.bfloat16, "cuda", 5))
    problem[1] = torch.where(problem[1] == num_experts - 1, 0, problem[1])  # expert 15 without rows (0 twice in
    # some tokens' slots: to the kernels, two rows like any others)
    launch, fresh, _, parts = launches(tuple(problem), num_experts)[kernel]
    counts = torch.bincount(problem[1].reshape(-1), minlength=num_experts).tolist()
    busy_tiles = sum(-(-c // BLOCK_M) for c in counts)
    up_blocks = busy_tiles * inter // 128
    num_blocks = {"up": up_blocks, "up_saved": up_blocks, "act": up_blocks,
                  "dh": busy_tiles * -(-inter // 256), "dw13": num_experts * (2 * inter // 128) * (dim // 256),
                  "dw13_alone": num_experts * (2 * inter // 128) * (dim // 256),
                  "dw2": num_experts * (dim // 128) * -(-inter // 256)}[kernel]
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.full((g.trace_size(programs),), -1, device="cuda", dtype=torch.int64)
    plain, traced = fresh(), fresh()
    launch(plain, None)
    launch(traced, trace)
    assert all(map(torch.equal, plain, traced))
    check_block_trace(trace, programs, num_blocks, parts)
    from tools.kernels_trace import WGRAD_KERNELS
    from tools.wgrad_schedule import dealt_before_launch, layer_blocks

    if kernel in WGRAD_KERNELS and dealt_before_launch(WGRAD_KERNELS[kernel]):
        # read by the blocks' expert rows as the tool reads them: every block, once
        from tools.block_trace import blocks_by_rows

        dealt, bk = layer_blocks(WGRAD_KERNELS[kernel], counts, dim, inter, programs)
        found = blocks_by_rows(trace.cpu(), len(dealt), 0, dealt, bk)
        assert sum(c["blocks"] for c in found["classes"].values()) == num_blocks and found["traced"]
        assert sum(c["share"] for c in found["classes"].values()) == pytest.approx(1.0)
        assert found["classes"]["tiny"]["blocks"] >= num_blocks // num_experts  # expert 15's, without rows
        assert 0 <= found["tail_us"] <= found["span_us"]
        assert not any(c[k] < 0 for c in found["classes"].values() for k in ("wait", "main", "rest"))  # NaN: none


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["by_size", "taken"])
@pytest.mark.parametrize("combine", [False, True], ids=["dW2", "dW13 with the combine"])
def test_warp_specialized_weight_gradients_in_size_order_are_bitwise_the_same(combine, order):
    """The bf16 Gluon weight gradients with their blocks dealt in order of their experts' rows (``by_size``), or those
    blocks taken in turn from a counter (``taken``), write every block, bitwise as in expert order: a skewed routing
    with experts without rows, 512 blocks over the SMs (full rounds dealt from alternate ends, then a partial one; or
    taken, with blocks of no K-step among them)."""
    from megamoe.kernels import gluon_sm90

    gen = torch.Generator().manual_seed(11)
    num_experts, p, q, top_k = 64, 512, 512, 2
    counts = skewed_expert_rows(num_experts, gen)
    idx = torch.repeat_interleave(torch.arange(num_experts), counts)[:, None].to(torch.int32)
    plan = build_plan(idx.cuda(), num_experts)
    rows = idx.numel()
    a = torch.randn(rows, p, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(rows, q, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.randn(rows, q, generator=gen).to("cuda", torch.bfloat16)  # (T * top_k, D) for the combine
    topk_idx = torch.randint(0, num_experts, (rows // top_k, top_k), generator=gen).cuda()
    outs = {}
    for variant in ("expert order", order):
        dw = torch.full((num_experts, p, q), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = torch.full((rows // top_k, q), float("nan"), device="cuda", dtype=torch.bfloat16)
        gluon_sm90.expert_wgrad_ws(a, b, plan.offsets_E1, dw, (slots, topk_idx, out) if combine else None,
                                   by_size=variant == "by_size", taken=variant == "taken")
        outs[variant] = (dw, out) if combine else (dw, )
    assert not outs[order][0].isnan().any()  # every block written (experts without rows: zeros)
    assert all(map(torch.equal, outs["expert order"], outs[order]))


def test_warp_specialized_launchers_pass_each_kernel_exactly_its_parameters(monkeypatch):
    """Each bf16 Gluon launcher hands its kernel every parameter the kernel declares and no other, in each of its
    variants (a name gone from one side would fail only at a GPU launch), through TMA descriptors that Triton accepts
    (block shapes, strides): the launches captured on a CPU."""
    from megamoe.kernels import gluon_sm90 as g

    launched = capture_launches(monkeypatch, g,
                                ("_wgrad_ws_kernel", "_dh_ws_kernel", "_act_ws_kernel", "_up_ws_kernel"))
    bf16 = torch.bfloat16
    num_experts, num_tokens, top_k, dim, inter = 4, 64, 2, 256, 256
    rows = num_tokens * top_k
    topk_idx = torch.arange(rows).remainder(num_experts).view(num_tokens, top_k)
    plan = build_plan(topk_idx, num_experts)
    trace = torch.empty(g.trace_size(132), dtype=torch.int64)
    x, x_sorted = torch.zeros(num_tokens, dim, dtype=bf16), torch.zeros(rows, dim, dtype=bf16)
    w13, w2 = torch.zeros(num_experts, 2 * inter, dim, dtype=bf16), torch.zeros(num_experts, dim, inter, dtype=bf16)
    dh, dz = torch.zeros(rows, inter, dtype=bf16), torch.zeros(rows, 2 * inter, dtype=bf16)
    for combined, by_size, taken, tr in ((None, False, False, None), ((x_sorted, topk_idx, x), True, False, trace),
                                         (None, None, True, None)):
        g.expert_wgrad_ws(dz, x_sorted, plan.offsets_E1, torch.zeros_like(w13), combined, by_size=by_size, taken=taken,
                          trace=tr)
    for copy_x, tr in ((None, None), ((x, x_sorted, plan.row_slot_N, top_k), trace)):
        g.dh_ws(x_sorted, w2, dh, plan, BLOCK_M, copy_x, trace=tr)
    g.act_bwd_ws(x_sorted, dh, w13, torch.ones(rows), plan, dz, dh, torch.zeros(inter // 64, rows), BLOCK_M, 64,
                 trace=trace)
    for preact, tr in ((None, None), (dz, trace)):
        g.up_swiglu_ws(x, w13, dh, plan, top_k, BLOCK_M, preact, trace=tr)
    assert_launches_pass_parameters(launched, 8)
