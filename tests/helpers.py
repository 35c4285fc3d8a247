"""Shared test helpers: problem generation, the shape matrix, the tolerance rule, and two patches that speed up
Triton's interpreter without changing what it computes."""

from __future__ import annotations

import math
import os

import pytest
import torch

from megamoe import reference
from megamoe.bench.common import grads_of as run_with_grads


def speed_up_the_interpreter():
    """Both patches below, under ``TRITON_INTERPRET=1`` only (with the kernels compiled, nothing). conftest calls it
    for the test session; ranks that a test spawns, which do not run conftest, call it themselves."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    patch_the_language_once_per_launch()
    look_up_numpy_dtypes_in_one_table()


def look_up_numpy_dtypes_in_one_table():
    """The interpreter finds the numpy dtype that holds a Triton type's values (``interpreter._get_np_dtype``, at
    every splat, cast and masked load) by building a table of 19 numpy dtypes at each call: ~14 us, 8% of an FP8
    test's time. Here each scalar type's answer is the interpreter's own, asked once and kept."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    ask = interpreter._get_np_dtype
    table = {}

    def look_up(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):  # unhashable (its __eq__ has no __hash__): the interpreter's answer
            return np.dtype(np.uint64)
        if tt_dtype not in table:
            table[tt_dtype] = ask(tt_dtype)
        return table[tt_dtype]

    interpreter._get_np_dtype = look_up


def patch_the_language_once_per_launch():
    """The interpreter patches the ``triton.language`` modules that a function's globals name at each kernel launch,
    and again at each call of a ``@triton.jit`` helper inside the kernel, with the same builder: where the launch has
    patched the helper's modules already, the second patching changes nothing but costs ~2 ms a call, a fifth of an
    FP8 test's time. Here a helper's patching inside a launch covers only the modules not yet patched in it, and
    the launch's end undoes it with the launch's own. Triton 3.6 never undoes a helper's patching: after a kernel
    that calls ``tl.sum`` (a helper whose globals name ``triton.language.core``, which the launch did not patch),
    ``tl.core``'s builtins stayed bound to the interpreter's builder, and a Gluon kernel compiled later in the same
    process for sm_90a failed on them (``'InterpreterBuilder' object has no attribute 'get_blocked_layout'``)."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched = None  # the modules patched in the launch under way; None outside launches
    helpers = None  # the scopes of the helpers' patchings in the launch under way, undone at its end

    def modules(fn):
        return {value for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    def undo_helpers_then(restore, scopes):
        def undo():
            while scopes:
                scopes.pop().restore()
            restore()

        return undo

    def patch_once(fn):
        nonlocal helpers
        if patched is None:
            return patch(fn)
        wanted = modules(fn)
        if helpers is None:  # the launch's own patching: the launch undoes it at its end, the helpers' first
            helpers = []
            scope = patch(fn)
            scope.restore = undo_helpers_then(scope.restore, helpers)
            patched.update(wanted)
            return scope
        if not wanted <= patched:
            helpers.append(patch(fn))
            patched.update(wanted)
        return interpreter._LangPatchScope()

    def launch_patching_once(self, *args, **kwargs):
        nonlocal patched, helpers
        patched, helpers = set(), None
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched = helpers = None

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once


# (T, D, I, E, K, routing) — one comment per case: what it guards.
SHAPES = [
    (1, 32, 16, 4, 2, "random"),        # a single token
    (5, 32, 16, 4, 2, "random"),        # T smaller than any tile
    (40, 48, 24, 6, 3, "random"),       # E not a power of two
    (33, 32, 16, 8, 1, "random"),       # K = 1
    (17, 32, 16, 4, 4, "random"),       # K = E: every token visits every expert
    (29, 32, 16, 8, 2, "empty"),        # experts with no tokens (only the first 3 used)
    (37, 32, 16, 5, 1, "one"),          # every token to one expert
    (31, 32, 16, 6, 3, "dropped"),      # dropped slots (-1)
    (45, 40, 24, 5, 2, "random"),       # D and I not multiples of 16/32/64
]


ROUTING_KINDS = ("random", "empty", "one", "dropped", "skewed")


def make_routing(kind: str, num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    """Top-k expert ids and weights of ``kind``: ``random`` (uniform scores), ``empty`` (experts 3.. win only when
    top_k > 3), ``one`` (every token's first slot on the last expert), ``dropped`` (30% of the slots -1),
    ``skewed`` (expert popularity falling with its index)."""
    if kind not in ROUTING_KINDS:
        raise ValueError(f"routing {kind!r} not among {ROUTING_KINDS}")
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if kind == "skewed":
        scores = torch.randn(num_tokens, num_experts, generator=gen) - 1.5 * torch.log1p(
            torch.arange(num_experts, dtype=torch.float32))
    if kind == "empty":
        scores[:, 3:] -= 2.0  # experts 3.. only win when top_k > 3
    topk_idx = scores.topk(top_k, dim=1).indices
    if kind == "one":
        topk_idx[:, 0] = num_experts - 1
    if kind == "dropped":
        drop = torch.rand(num_tokens, top_k, generator=gen) < 0.3
        topk_idx = topk_idx.masked_fill(drop, -1)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return topk_idx, topk_weights


def make_problem(T, D, I, E, K, routing, dtype=torch.float32, device="cpu", seed=0, idx_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    w13 = torch.randn(E, 2 * I, D, generator=gen) / D**0.5
    w2 = torch.randn(E, D, I, generator=gen) / I**0.5
    topk_idx, topk_weights = make_routing(routing, T, E, K, gen)
    dy = torch.randn(T, D, generator=gen)
    cast = lambda t: t.to(device=device, dtype=dtype)
    return (cast(x), topk_idx.to(device=device, dtype=idx_dtype), topk_weights.to(device), cast(w13), cast(w2),
            cast(dy))


def gpu_problem(T, D, I, E, K, routing, seed=0):
    """A bf16 problem on the GPU (``make_problem``'s routings)."""
    return make_problem(T, D, I, E, K, routing, dtype=torch.bfloat16, device="cuda", seed=seed)


NAMES = ["y", "dx", "dtopk_weights", "dw13", "dw2"]


def assert_close_to_reference(out, problem, atol=1e-5, lowp=reference.moe_loop):
    """flash-attention's rule: |out - ref32| <= 2 * |ref_lowp - ref32| + atol, elementwise max, where
    ref_lowp is the reference computed in the test dtype (``lowp``: the reference function that computes in the
    precision under test, e.g. ``reference.moe_loop_fp8`` for the FP8 recipe)."""
    ref32 = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), *problem)
    ref_lp = run_with_grads(lowp, *problem)
    for name, o, r, rl in zip(NAMES, out, ref32, ref_lp):
        assert o.shape == r.shape, name
        assert torch.isfinite(o).all(), f"{name} has non-finite values"
        err = (o.float() - r).abs().max().item()
        bound = 2 * (rl.float() - r).abs().max().item() + atol * max(1.0, r.abs().max().item())
        assert err <= bound, f"{name}: max err {err:.3e} > bound {bound:.3e}"


def check_block_trace(trace: torch.Tensor, programs: int, num_blocks: int, parts: dict[str, int]) -> None:
    """A traced Gluon launch's stamps (``gluon_sm90.TRACE_BLOCKS``): the loader's blocks are ``num_blocks`` in all,
    each partition of ``parts`` (name -> its index) stamps the loader's blocks, a busy block's four points (a block
    with work for the partition: its first stage ready stamped) are in time order, and
    ``tools.block_trace.block_phases`` reads them: the phases that need a program's next block ("block", "share")
    where a program has two blocks or more, else none (a launch of fewer blocks than SMs)."""
    from megamoe.kernels import gluon_sm90 as g
    from tools.block_trace import LOADER, block_phases

    stamps = trace.view(programs, g.TRACE_PARTS.value, g.TRACE_BLOCKS.value, 2, g.TRACE_POINTS.value).cpu()
    blocks = (stamps[:, LOADER, :, 0, 0] >= 0).sum(1)  # the loader's blocks per program
    assert int(blocks.sum()) == num_blocks  # every block of the launch, once
    for part in parts.values():
        assert torch.equal((stamps[:, part, :, 0, 0] >= 0).sum(1), blocks)  # the partition stamps the loader's blocks
        cyc = stamps[:, part, :, 0]
        taken = cyc[..., 0] >= 0
        assert bool((cyc[..., 3][taken] >= cyc[..., 0][taken]).all())
        busy = taken & (cyc[..., 1] >= 0)  # an FP8 warpgroup whose 64 rows lie past the expert stamps only 0 and 3
        assert bool(busy.any())
        in_order = (cyc[..., 1] >= cyc[..., 0]) & (cyc[..., 2] >= cyc[..., 1]) & (cyc[..., 3] >= cyc[..., 2])
        assert bool(in_order[busy].all())
    phases = block_phases(trace.cpu(), programs, parts)
    for name in parts:
        assert phases[name]["main"] > 0 and phases[name]["wait"] >= 0
        if int(blocks.max()) >= 2:
            assert phases[name]["block"] >= phases[name]["main"] and 0 < phases[name]["share"] <= 1
        else:
            assert math.isnan(phases[name]["block"]) and math.isnan(phases[name]["share"])


def interpreter_only(gpu_counterpart: str):
    """Marks a test that holds a kernel to the interpreter's arithmetic (exact products, IEEE fp32 sums): skipped on a
    GPU, whose FP8 tensor cores sum a K-step's products more coarsely, so that one input's rounding to e4m3 can flip;
    ``gpu_counterpart`` (named in the skip's reason) bounds the GPU's kernels instead."""
    return pytest.mark.skipif(torch.cuda.is_available(),
                              reason=f"the interpreter's exact sums; on a GPU {gpu_counterpart} checks the kernels")


def capture_launches(monkeypatch, module, kernels: tuple[str, ...]) -> list:
    """Replace each of ``module``'s Gluon ``kernels`` (names) by a stand-in that records its launches instead of
    running them, for a CPU (the test skips on a GPU, where the kernels' own tests launch them), with 132 SMs
    (``sm_count`` of ``module`` and of ``gluon_sm90``, whose ``trace_args`` reads it): the returned list fills with
    (the kernel, the names of the arguments a launch passed, launch options aside), for
    ``assert_launches_pass_parameters``."""
    import pytest

    from megamoe.kernels import gluon_sm90

    if torch.cuda.is_available():
        pytest.skip("a CPU check of the launchers' arguments (on a GPU the kernels' own tests launch them)")
    for sms in {module, gluon_sm90}:
        monkeypatch.setattr(sms, "sm_count", lambda index: 132)
    launched = []

    def capture(kernel):
        class Launch:
            def __getitem__(self, grid):
                return lambda **kw: launched.append((kernel, set(kw) - {"maxnreg"}))
        return Launch()

    for name in kernels:
        monkeypatch.setattr(module, name, capture(getattr(module, name)))
    return launched


def assert_launches_pass_parameters(launched: list, count: int) -> None:
    """``count`` launches were captured (``capture_launches``), each passing its kernel exactly the parameters the
    kernel declares."""
    assert len(launched) == count
    for kernel, passed in launched:
        assert passed == set(kernel.arg_names), (kernel.fn.__name__, passed ^ set(kernel.arg_names))


def skewed_expert_rows(num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert, a few thousand, skewed as a power law (the largest ~4 000) in a random order, every ninth
    expert without rows: the weight gradients' blocks under a skewed routing, for their size-order tests."""
    counts = (4000 / torch.arange(1, num_experts + 1) ** 1.2).long()[torch.randperm(num_experts, generator=gen)]
    counts[::9] = 0
    return counts
