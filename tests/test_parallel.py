"""Expert parallelism with real processes: the all-to-all path against the one-device layer.

CPU tests run R gloo processes (each rank: its own tokens, global expert ids, its E/R experts) and
compare outputs and every gradient with the one-device fp32 reference on the gathered problem. Under
the interpreter (no GPU) ``megamoe.moe(group=...)`` runs the fused kernels for the local experts, so
those cases also check that the fused kernels compose with the exchange.
"""

import copy
import faulthandler
import functools
import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megamoe
from megamoe import autograd, reference
from megamoe.api import backend_for, ep_path
from megamoe.kernels import quant
from megamoe.parallel.all_to_all import moe_all_to_all
from tests.helpers import (
    make_problem,
    run_with_grads,
    speed_up_the_interpreter,
)

TIMEOUT_S = 300  # a hang fails the test instead of stalling CI

# (name, tokens per rank, D, I, experts per rank, K, routing)
CASES = [
    ("uneven tokens, a rank with none", [7, 0, 12, 5], 32, 16, 2, 3, "random"),
    ("all rows to rank 0's experts", [6, 9, 4, 8], 32, 16, 2, 2, "to-rank-0"),
    ("dropped slots", [10, 3, 8, 6], 40, 24, 3, 2, "dropped"),
]


def global_problem(case, num_ranks):
    _, sizes, dim, inter, per_rank, top_k, routing = case
    sizes = sizes[:num_ranks]
    num_experts = per_rank * num_ranks
    top_k = min(top_k, num_experts)  # a group of one has only per_rank experts (K = E is a case of its own)
    x, idx, w, w13, w2, dy = make_problem(sum(sizes), dim, inter, num_experts, top_k,
                                          "random" if routing == "to-rank-0" else routing, seed=len(sizes))
    if routing == "to-rank-0":
        idx = idx.remainder(per_rank)  # experts [0, per_rank) live on rank 0: every other rank receives nothing
        idx = torch.stack([idx[:, 0], (idx[:, 0] + 1) % per_rank], dim=1)[:, :top_k]  # distinct ids per token
    return sizes, per_rank, (x, idx, w, w13, w2, dy)


def check_rank(case, rank, num_ranks, group, fn, device="cpu"):
    """``fn(*local problem)`` on this rank (its tensors on ``device``) against the fp32 one-device
    reference on the whole problem."""
    sizes, per_rank, (x, idx, w, w13, w2, dy) = global_problem(case, num_ranks)
    tok = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    exp = slice(rank * per_rank, (rank + 1) * per_rank)
    local = [t.to(device) for t in (x[tok], idx[tok], w[tok], w13[exp].contiguous(), w2[exp].contiguous(), dy[tok])]
    out = [t.cpu() for t in run_with_grads(fn, *local)]
    ref = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), x, idx, w, w13, w2, dy)
    ref_local = [ref[0][tok], ref[1][tok], ref[2][tok], ref[3][exp], ref[4][exp]]
    for name, o, r in zip(["y", "dx", "dtopk_weights", "dw13", "dw2"], out, ref_local):
        assert o.shape == r.shape, f"{case[0]}, rank {rank}: {name} shape {tuple(o.shape)} != {tuple(r.shape)}"
        err = (o.float() - r).abs().max().item() if r.numel() else 0.0
        bound = 1e-5 * max(1.0, r.abs().max().item() if r.numel() else 0.0)
        assert err <= bound, f"{case[0]}, rank {rank}: {name} max err {err:.2e} > {bound:.2e}"


def _worker(rank, num_ranks, init_file, test):
    # A rank still running shortly before spawn() gives up prints where it is (the parent's own dump,
    # from a time limit around pytest, shows only the join).
    faulthandler.dump_traceback_later(TIMEOUT_S - 20, exit=False)
    speed_up_the_interpreter()
    on_gpus = test in ("fused", "fsdp_gpu")
    if on_gpus:  # one GPU per rank (symmetric memory for the fused path)
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_gpus else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=num_ranks)
    try:
        group = dist.group.WORLD
        if test == "fused":
            assert ep_path(torch.empty(1, 32, device="cuda"), torch.empty(1, 32, 16, device="cuda")) == "fused"
            # compiled with fullgraph before any eager call: the workspace is set up while the compiler traces
            compiled = torch.compile(lambda *a: megamoe.moe(*a, group=group, comm_sms=0), fullgraph=True)
            check_rank(CASES[0], rank, num_ranks, group, compiled, device=f"cuda:{rank}")
            # the default, the workspace reused across calls in both modes, and each direction in its own mode
            for comm_sms in (None, 0, 2, 0, None, (0, 2), (2, 0)):
                for case in CASES:
                    check_rank(case, rank, num_ranks, group,
                               lambda *a, c=comm_sms: megamoe.moe(*a, group=group, comm_sms=c), device=f"cuda:{rank}")
            for comm_sms in (0, 2):  # the saved-activation mode: each owner keeps its received rows' products
                for case in CASES:
                    check_rank(case, rank, num_ranks, group,
                               lambda *a, c=comm_sms: megamoe.moe(*a, group=group, comm_sms=c,
                                                                  save_for_backward="preact"), device=f"cuda:{rank}")
            check_fp8_rank(CASES[0], rank, num_ranks, group, f"cuda:{rank}", exact=True)
            check_steps(rank, num_ranks, group, f"cuda:{rank}", steps=200)
            check_bench(group, torch.device("cuda", rank))
            x, idx, w, w13, w2, _ = make_problem(8, 32, 16, 2 * num_ranks, 2, "random", device=f"cuda:{rank}")
            for too_many in (100_000, (0, 100_000)):
                with pytest.raises(ValueError, match="leaves none of this GPU's"):
                    megamoe.moe(x, idx, w, w13[:2].contiguous(), w2[:2].contiguous(), group=group, comm_sms=too_many,
                                max_tokens_per_rank=8)
        elif test == "compiled_first_call":
            check_compiled_first_call(group)
        elif test == "reset":
            check_reset_workspaces(group)
        elif test == "shard_experts":
            check_shard_experts(group)
        elif test == "baseline":
            for case in CASES:
                check_rank(case, rank, num_ranks, group,
                           lambda *a: moe_all_to_all(*a, group, experts=reference.moe_grouped_mm))
        elif test == "api":
            # The workers inherit TRITON_INTERPRET from conftest: the local experts run the fused kernels.
            assert backend_for(torch.empty(0)) == "triton"
            check_ep_selection(group)
            for mode in ("none", "preact"):  # the all-to-all path's local experts in either memory mode
                for case in CASES:
                    check_rank(case, rank, num_ranks, group,
                               lambda *a, m=mode: megamoe.moe(*a, group=group, save_for_backward=m))
            check_steps(rank, num_ranks, group, "cpu", steps=3)  # the GPU test's 200-step check, checked itself
            check_fp8_rank(CASES[0], rank, num_ranks, group, "cpu", exact=False)
        elif test == "layer":
            check_layer(rank, num_ranks, group)
        elif test == "bench":
            check_bench(group, torch.device("cpu"))
        elif test == "signature":
            from megamoe.parallel.workspace import check_same_on_every_rank

            check_same_on_every_rank(group, hidden_size=64, dtype=torch.bfloat16)
            with pytest.raises(ValueError, match=r"different hidden_size: rank 0: hidden_size=64; rank 1: "
                                                 r"hidden_size=65"):
                check_same_on_every_rank(group, hidden_size=64 + rank, dtype=torch.bfloat16)
        elif test == "fsdp":
            check_fsdp(rank, num_ranks, "cpu")
        elif test == "fsdp_fp8":
            check_fsdp(rank, num_ranks, "cpu", precision="fp8")
        elif test in ("fsdp_fp8_call", "fsdp_fp8_ahead"):
            check_fsdp(rank, num_ranks, "cpu", precision="fp8", weight_cache=test.removeprefix("fsdp_fp8_"))
        elif test == "fsdp_gpu":
            check_fsdp(rank, num_ranks, f"cuda:{rank}")
        elif test == "ep_fsdp":
            check_ep_fsdp(rank, num_ranks)
        # No rank tears down while another still talks to it (without this barrier gloo aborted a rank at
        # exit about one run in five, with a TCP rendezvous).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, in which a C++ thread still joinable is destroyed
    # now and then ("terminate called without an active exception", SIGABRT; seen in about one full CI
    # run in ten, in a different test each time, after every check had passed). A failure above raises
    # before this line, and mp.spawn reports it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fp8_slot_rows(x, idx, w, w13, w2, mode="none"):
    """The all-to-all path's FP8 layer on one device: each slot's row through its expert with routing weight 1 (the
    one-device FP8 layer, rows in slot order, as an owner receives them source by source), then weighted and summed
    per token in fp32."""
    rows = megamoe.moe(x.repeat_interleave(idx.shape[1], 0), idx.reshape(-1, 1), torch.ones_like(w).reshape(-1, 1),
                       w13, w2, precision="fp8", save_for_backward=mode)
    return (rows.view(*idx.shape, x.shape[1]).float() * w[..., None].float()).sum(1).to(x.dtype)


def check_fp8_rank(case, rank, num_ranks, group, device, exact):
    """``megamoe.moe(group=..., precision="fp8")`` on this rank, in both memory modes, against one device on the
    gathered problem (``case``'s tokens and routing at FP8's dims, D = I = 128): where ``exact`` (the fused path:
    each row's own GEMMs and combine) against the one-device FP8 layer, y, dx and d(routing weight) bit for bit;
    else (the all-to-all path, whose owners run the experts with routing weight 1 and whose sources weight the
    returned rows) against :func:`fp8_slot_rows`, to fp32 rounding; dw13 and dw2 to the order of fp32 sums."""
    name, sizes, _, _, per_rank, top_k, routing = case
    sizes, per_rank, (x, idx, w, w13, w2, dy) = global_problem((name, sizes, 128, 128, per_rank, top_k, routing),
                                                               num_ranks)
    tok = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    exp = slice(rank * per_rank, (rank + 1) * per_rank)
    whole = [t.to(device) for t in (x, idx, w, w13, w2, dy)]
    local = [whole[0][tok], whole[1][tok], whole[2][tok], whole[3][exp].contiguous(), whole[4][exp].contiguous(),
             whole[5][tok]]
    saved = autograd.FP8_WGRAD_X_SCALES
    autograd.FP8_WGRAD_X_SCALES = "layer"  # one GPU only: refused by name, before anything is sent
    try:
        with pytest.raises(ValueError, match="MEGAMOE_FP8_WGRAD_X_SCALES"):
            megamoe.moe(*local[:5], group=group, precision="fp8")
    finally:
        autograd.FP8_WGRAD_X_SCALES = saved
    for mode in ("none", "preact"):
        out = run_with_grads(functools.partial(megamoe.moe, group=group, precision="fp8", save_for_backward=mode),
                             *local)
        one_device = functools.partial(megamoe.moe, precision="fp8", save_for_backward=mode) if exact else \
            functools.partial(fp8_slot_rows, mode=mode)
        ref = run_with_grads(one_device, *whole)
        ref = [ref[0][tok], ref[1][tok], ref[2][tok], ref[3][exp], ref[4][exp]]
        for what, o, r, tol in zip(["y", "dx", "dtopk_weights", "dw13", "dw2"], out, ref,
                                   [0.0 if exact else 1e-6] * 3 + [1e-5] * 2):
            bound = tol * r.abs().max().item() if r.numel() else 0.0
            err = (o - r).abs().max().item() if r.numel() else 0.0
            assert err <= bound, f"FP8 {name}, {mode}, rank {rank}: {what} max err {err:.2e} > {bound:.2e}"


def check_steps(rank, num_ranks, group, device, steps):
    """``steps`` consecutive steps of ``moe(group=...)`` (forward and backward; on GPUs the fused path with
    the default comm_sms), each with new routing and a new token count on every rank (none, at times),
    without a hang; the last one against the fp32 reference."""
    local = slice(2 * rank, 2 * rank + 2)
    fn = functools.partial(megamoe.moe, group=group, max_tokens_per_rank=16)
    for step in range(steps):
        *_, w13, w2, _ = make_problem(1, 32, 16, 2 * num_ranks, 2, "random", device=device, seed=step)  # every rank's
        x, idx, w, *_, dy = make_problem((7 * step + 5 * rank) % 17, 32, 16, 2 * num_ranks, 2, "random",
                                         device=device, seed=steps * (rank + 1) + step)  # this rank's own tokens
        out = run_with_grads(fn, x, idx, w, w13[local].contiguous(), w2[local].contiguous(), dy)
    ref = run_with_grads(lambda *a: reference.moe_loop(*a, fp32=True), x.cpu(), idx.cpu(), w.cpu(), w13.cpu(),
                         w2.cpu(), dy.cpu())  # this rank's tokens through every expert, as the ranks' do
    for name, o, r in zip(["y", "dx", "dtopk_weights"], out, ref):
        torch.testing.assert_close(o.cpu(), r, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"step {steps}, {n}: {m}")


def check_ep_selection(group):
    """MEGAMOE_EP picks the expert-parallel path; a bad value, or the fused path on CPU tensors, is a clear
    error rather than a silent fallback; by default CPU tensors take the all-to-all path."""
    x, idx, w, w13, w2, _ = make_problem(4, 32, 16, 2 * dist.get_world_size(group), 2, "random")
    local = (x, idx, w, w13[:2].contiguous(), w2[:2].contiguous())
    assert "MEGAMOE_EP" not in os.environ and ep_path(x, w2) == "all_to_all"
    for value, match in (("nccl", "MEGAMOE_EP must be"), ("fused", "needs CUDA tensors")):
        os.environ["MEGAMOE_EP"] = value
        try:
            with pytest.raises(ValueError, match=match):
                megamoe.moe(*local, group=group)
        finally:
            del os.environ["MEGAMOE_EP"]
    with pytest.raises(ValueError, match="fused expert-parallel path only"):
        megamoe.moe(*local, group=group, comm_sms=4)  # the all-to-all path sends through NCCL


def check_fsdp(rank, num_ranks, device, precision="bf16", weight_cache="step"):
    """A transformers Qwen3-MoE model with megamoe experts under FSDP2 (each decoder layer and the root
    ``fully_shard``-ed, so the expert weights are sharded over the ranks along the expert dimension), each rank on
    its own batches: two SGD steps leave every parameter where one process's model gets on the mean loss of all
    ranks' batches. On ``device`` (gloo on CPU, NCCL on GPUs: the model's parameters are DTensors there too).
    ``precision="fp8"``: the experts' FP8 weight copies are remade after the first step (FSDP2 all-gathers the
    updated weights into the same unsharded parameters, behind their version counters: a stale copy would run the
    second step on the first step's weights), and made once per step (the backward's all-gather, after the
    forward's reshard, hits the forward's copies: a miss would quantise each weight twice per step).
    The cached copies are the gathered weights', held after the backward (FSDP's reshard frees the bf16 ones only);
    ``weight_cache="call"`` (``megamoe.set_fp8_weight_cache``): each weight quantised in the forward and again in
    the backward, no copy held after it. ``"ahead"``: as ``"step"``, the optimizer step making none (its parameters
    are the DTensor shards, not the gathered weights that the layers read). No copy is held after an optimizer
    step under any policy."""
    from unittest import mock

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    import megamoe.integrations.transformers as hf_megamoe
    from tests.test_integrations import tiny_model

    # One decoder layer: the layer and the root sharded apart, at half the interpreter's time of two.
    sizes = {"hidden_size": 128, "moe_intermediate_size": 128} if precision == "fp8" else {}
    ref = tiny_model(device=device, layers=1, **sizes)
    ref.set_experts_implementation("megamoe")
    hf_megamoe.set_precision(ref, precision)
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, DTensor) and experts.gate_up_proj.placements == (Shard(0),)
    assert experts.gate_up_proj.to_local().shape[0] == ref.config.num_experts // num_ranks
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    megamoe.set_fp8_weight_cache(weight_cache)
    for step in range(2):
        batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 * step + r)).to(device)
                   for r in range(num_ranks)]
        with mock.patch.object(quant, "quantize_weight", wraps=quant.quantize_weight) as quantised:
            model(input_ids=batches[rank], labels=batches[rank]).loss.backward()
        # w13 and w2 once each (or in the forward and the backward each); bf16 quantises nothing
        expected = (4 if weight_cache == "call" else 2) if precision == "fp8" else 0
        assert quantised.call_count == expected, f"step {step}: weights quantised {quantised.call_count} times"
        # cached: the copies of the gathered (unsharded) weights, held after the backward; or none (under "ahead",
        # the reference model's optimizer made its weights' copies too: left out)
        ref_weights = {id(q) for q in ref.parameters()}
        held = [copies[0].shape[0] for owner, _, copies, _ in quant._weight_cache.values()
                if id(owner()) not in ref_weights]
        assert held == ([ref.config.num_experts] * 2 if weight_cache != "call" and precision == "fp8" else [])
        opt.step()
        assert not quant._weight_cache, "copies held after the optimizer step (made ahead from a DTensor shard?)"
        opt.zero_grad()
        (sum(ref(input_ids=b, labels=b).loss for b in batches) / num_ranks).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def check_ep_fsdp(rank, num_ranks):
    """Expert parallelism composed with FSDP2, laid out as TorchTitan does: a (dp, ep) mesh; each rank holds the
    experts of its ep index (``MegaMoE(ep_group=...)``, exchanged through the all-to-all path on CPU), sharded
    over dp; the replicated router sharded over every rank. Outputs equal one process's layer holding every
    expert, and so do the gradients: the router's as they are, the experts' up to the factor that a trainer
    divides them by (each expert's gradient sums the ep ranks' tokens, and FSDP averages over dp only; on NCCL
    ``set_gradient_divide_factor`` does it, gloo has no PREMUL_SUM)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp_size = 2
    ep_size = num_ranks // dp_size
    mesh = init_device_mesh("cpu", (dp_size, ep_size), mesh_dim_names=("dp", "ep"))
    dim, inter, num_experts, top_k = 32, 16, 4 * ep_size, 2
    per_rank, r_ep = num_experts // ep_size, mesh["ep"].get_local_rank()
    mine = slice(r_ep * per_rank, (r_ep + 1) * per_rank)
    torch.manual_seed(0)
    full = megamoe.MegaMoE(dim, inter, num_experts, top_k)
    layer = megamoe.MegaMoE(dim, inter, num_experts, top_k, ep_group=mesh["ep"].get_group())
    with torch.no_grad():
        layer.gate.weight.copy_(full.gate.weight)
        layer.w13.copy_(full.w13[mine])
        layer.w2.copy_(full.w2[mine])
    fully_shard(layer.gate, mesh=init_device_mesh("cpu", (num_ranks,)))
    fully_shard(layer, mesh=mesh["dp"])
    xs = [torch.randn(12, dim, generator=torch.Generator().manual_seed(r)) for r in range(num_ranks)]
    y = layer(xs[rank])
    y.square().mean().backward()
    (sum(full(x).square().mean() for x in xs) / num_ranks).backward()
    torch.testing.assert_close(y, full(xs[rank]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.gate.weight.grad.full_tensor(), full.gate.weight.grad, rtol=1e-4, atol=1e-6)
    for name in ("w13", "w2"):
        grad = getattr(layer, name).grad.full_tensor() / ep_size
        torch.testing.assert_close(grad, getattr(full, name).grad[mine], rtol=1e-4, atol=1e-6, msg=name)


def check_layer(rank, num_ranks, group):
    """``MegaMoE(ep_group=...)`` equals one layer holding every rank's experts, with the same router."""
    dim, inter, num_experts, top_k = 32, 16, 2 * num_ranks, 2
    torch.manual_seed(rank)  # each rank initialises its own experts
    layer = megamoe.MegaMoE(dim, inter, num_experts, top_k, ep_group=group)
    assert layer.w13.shape[0] == num_experts // num_ranks
    dist.broadcast(layer.gate.weight.data, src=0)  # the router is replicated
    full = megamoe.MegaMoE(dim, inter, num_experts, top_k)
    with torch.no_grad():
        full.gate.weight.copy_(layer.gate.weight)
        for name in ("w13", "w2"):
            parts = [torch.empty_like(getattr(layer, name)) for _ in range(num_ranks)]
            dist.all_gather(parts, getattr(layer, name).data)
            getattr(full, name).copy_(torch.cat(parts))
    x = torch.randn(3 + rank, 4, dim, generator=torch.Generator().manual_seed(100 + rank))
    y = layer(x)
    y.square().sum().backward()
    y_full = full(x)
    y_full.square().sum().backward()  # this rank's tokens only: weight grads differ, router grads too
    torch.testing.assert_close(y, y_full, rtol=1e-5, atol=1e-6)
    # Summed over ranks, the full layer's expert gradients are the EP layer's gathered ones.
    for name in ("w13", "w2"):
        total = getattr(full, name).grad.clone()
        dist.all_reduce(total)
        local = getattr(layer, name).grad
        per_rank = local.shape[0]
        torch.testing.assert_close(local, total[rank * per_rank:(rank + 1) * per_rank], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.gate.weight.grad, full.gate.weight.grad, rtol=1e-5, atol=1e-6)


def check_bench(group, device):
    """The EP benchmark's measuring code on the tiny preset: every impl is timed and agrees with the
    one-device reference (fp32 on CPU; bf16 on GPUs, where the fused protocol must be as close as the
    all-to-all path with the same local kernels), the compute-only (and, with the fused impl, the
    communication-only) halves of the overlap figure are measured, and the profile covers the fused
    forwards and forward+backward calls and the timed halves."""
    from megamoe.bench.ep import ERROR_TOKENS_PER_RANK, ep_impls, measure

    cuda = device.type == "cuda"
    names = ["a2a_megamoe", "fused"] if cuda else ["a2a_grouped_mm", "a2a_megamoe"]
    impls = ep_impls(names, group, ERROR_TOKENS_PER_RANK, comm_sms=(2, (0, 2)) if cuda else ())
    names += ["fused_sms2", "fused_sms0_2"] if cuda else []
    info = measure(impls, group, "tiny", 16, "skewed", device, iters=2, seed=0, profile=True)
    assert [r["impl"] for r in info["results"]] == names
    # The profile: a table per fused impl's forward and forward+backward and per timed half of the overlap figure.
    profiled = [line.split(" (")[0][6:] for line in info.pop("_profile").splitlines() if line.startswith("===== ")]
    assert profiled == [f"{n} {call}" for n in names if n.startswith("fused") for call in ("forward", "forward+backward")
                        ] + ["compute only forward", "compute only forward+backward"] + (
                            ["comm only forward"] if cuda else [])
    for r in info["results"]:
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, r
    errors = [r["max_rel_err"] for r in info["results"]]
    if cuda:
        assert max(errors[1:]) <= 2 * errors[0] + 1e-3, errors
        assert info["comm_only_fwd_ms"] > 0 and all(r["overlap_fwd"] > 0 for r in info["results"][1:])
    else:
        assert max(errors) < 1e-4, errors
        assert "comm_only_fwd_ms" not in info  # needs the fused impl (GPUs)
    assert info["exchange_fwd_ms"] > 0 and info["exchange_fwd_bytes_rank0"] > 0
    assert info["compute_only_fwd_ms"] > 0 and info["compute_only_fwd_bwd_ms"] > 0
    # What the result file feeds: the report's table (one row per impl and one for the run) and plot.
    from megamoe.bench.report import ep_table

    rows = ep_table([info]).splitlines()[2:]
    assert len(rows) == len(names) + 1 and all(f"| {n} |" in row for n, row in zip(names, rows))


def test_compute_only_problem_is_each_ranks_received_rows():
    """The EP benchmark's compute-only figure runs each rank's experts on exactly the rows routed to them."""
    from megamoe.bench.ep import received_problem

    num_ranks, per_rank = 3, 2
    problem = make_problem(20, 16, 8, num_ranks * per_rank, 3, "dropped", seed=1)
    x, idx = problem[0], problem[1]
    total = 0
    for rank in range(num_ranks):
        rx, ridx, rw, w13, w2, rdy = received_problem(problem, rank, num_ranks)
        mine = (idx >= rank * per_rank) & (idx < (rank + 1) * per_rank)
        token = mine.nonzero()[:, 0]
        assert torch.equal(rx, x[token]) and torch.equal(rdy, problem[5][token])
        assert torch.equal(ridx[:, 0], idx[mine] - rank * per_rank) and bool((rw == 1).all())
        experts = slice(rank * per_rank, (rank + 1) * per_rank)
        assert torch.equal(w13, problem[3][experts]) and torch.equal(w2, problem[4][experts])
        total += rx.shape[0]
    assert total == int((idx >= 0).sum())


def spawn(test: str, num_ranks: int) -> None:
    # A file rendezvous: no port to race for, and no store that dies with rank 0.
    init_file = tempfile.mktemp(prefix="megamoe-test-pg-")
    ctx = mp.start_processes(_worker, args=(num_ranks, init_file, test), nprocs=num_ranks, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{test} with {num_ranks} ranks did not finish in {TIMEOUT_S} s (hang?)")


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_all_to_all_baseline_equals_one_device_reference(num_ranks):
    spawn("baseline", num_ranks)


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_moe_with_group_equals_one_device_reference(num_ranks):
    spawn("api", num_ranks)


def test_layer_with_ep_group_equals_one_layer():
    spawn("layer", 2)


def test_ranks_that_disagree_on_the_layer_are_refused():
    """The fused path's workspace is made only if every rank passed the same sizes and dtype (each rank raises
    ValueError naming what differs, instead of exchanging mismatched rows)."""
    spawn("signature", 2)


def test_fsdp2_with_megamoe_experts_equals_one_process():
    spawn("fsdp", 2)


def test_fsdp2_with_megamoe_fp8_experts_equals_one_process():
    spawn("fsdp_fp8", 2)


def test_fsdp2_with_megamoe_fp8_experts_holding_no_weight_copies_equals_one_process():
    spawn("fsdp_fp8_call", 2)


def test_fsdp2_with_megamoe_fp8_experts_copies_made_ahead_equals_one_process():
    spawn("fsdp_fp8_ahead", 2)


def test_expert_parallelism_composes_with_fsdp2():
    spawn("ep_fsdp", 4)


def test_ep_benchmark_measures_every_impl():
    spawn("bench", 2)



@pytest.mark.gpu
def test_fused_ep_group_of_one_equals_one_device_reference():
    """The fused protocol over real symmetric memory with one rank (the issue's 'group of size 1')."""
    spawn("fused", 1)


@pytest.mark.gpu
def test_fsdp2_on_the_gpus_equals_one_process():
    """FSDP2 over NCCL, one rank per GPU (one rank where the machine has one GPU: the sharded DTensor path)."""
    spawn("fsdp_gpu", min(torch.cuda.device_count(), 2))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")
def test_fused_ep_on_every_gpu_equals_one_device_reference():
    spawn("fused", min(torch.cuda.device_count(), 8))


@pytest.mark.loopback
def test_fused_ep_compiles_fullgraph_from_its_first_call():
    """The fused layer compiled with fullgraph before any eager call (``check_compiled_first_call``), in a process
    of its own: what the compiler caches there stays there."""
    spawn("compiled_first_call", 1)


@pytest.mark.loopback
def test_reset_workspaces_brings_the_fused_layer_back_after_a_wait_gave_up():
    spawn("reset", 1)


def test_shard_experts_passes_its_ep_options_to_every_call():
    spawn("shard_experts", 1)


# dynamo's refusal of a dynamic size to the fused layer's set-up, in torch 2.13's words or 2.11's
DYNAMO_REFUSES_A_DYNAMIC_SIZE = (r"assume_constant_result argument conversion failed"
                                 r"|SymNodeVariable\(\) is not a constant")


def check_shard_experts(group) -> None:
    """``shard_experts(model, group, max_tokens_per_rank=, comm_sms=)`` of the transformers integration in a group of
    one (gloo): options no path takes are refused before any module changes; then every experts module calls
    ``megamoe.moe`` with the group and those options, and the model's logits are the unsharded model's. Patches
    ``megamoe.moe``: a worker's process ends with the check."""
    import megamoe.integrations.transformers as hf_megamoe
    from tests.test_integrations import tiny_model

    calls = []
    moe = megamoe.moe
    megamoe.moe = lambda *a, **kw: calls.append(kw) or moe(*a, **kw)
    model = tiny_model(device="cpu")  # the all-to-all path of CPU tensors: gloo carries it
    model.set_experts_implementation("megamoe")
    input_ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
    for bad, match in (({"comm_sms": -1}, "comm_sms must be"), ({"max_tokens_per_rank": 0}, "max_tokens_per_rank")):
        with pytest.raises(ValueError, match=match):
            hf_megamoe.shard_experts(model, group, **bad)
    assert not any(hasattr(m, hf_megamoe.EP_GROUP) for m in model.modules())
    assert len(hf_megamoe.shard_experts(model, group, max_tokens_per_rank=16, comm_sms=0)) == 2
    calls.clear()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert [(c["group"], c["max_tokens_per_rank"], c["comm_sms"]) for c in calls] == [(group, 16, 0)] * 2
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def check_reset_workspaces(group) -> None:
    """``fused.reset_workspaces``, the documented way back after an expert-parallel wait gave up: until it runs every
    call of the layer raises the wait's record (naming the reset), after it the layer's output and gradients are the
    first call's, bit for bit. One gloo rank over the loopback workspace (symmetric memory needs GPUs); the record
    is written as a wait that gave up writes it (tests/test_ep_faults.py makes real ones, phase by phase), and read
    at once on a GPU too (``MEGAMOE_DEBUG=1``). Patches the fused module: a worker's process ends with the check."""
    from megamoe.parallel import fused
    from megamoe.parallel.workspace import CONTROL, loopback_workspaces

    os.environ["MEGAMOE_DEBUG"] = "1"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fused.symmetric_workspace = lambda group, num_local, capacity, max_tokens, max_slots, dim, dtype: \
        loopback_workspaces(1, num_local, capacity, max_tokens, max_slots, dim, dtype, device)[0]
    x, idx, w, w13, w2, dy = make_problem(24, 32, 16, 4, 2, "random", device=device)

    def layer(x, idx, w, w13, w2):
        return fused.moe_fused_ep(x, idx, w, w13, w2, group, None, 0)

    first = run_with_grads(layer, x, idx, w, w13, w2, dy)
    (ws,) = [ws for key, ws in fused._WORKSPACES.items() if key[0] == group.group_name]
    ws.control[CONTROL["err_stage"]] = 5  # an owner never wrote back
    ws.control[CONTROL["err_epoch"]] = 1
    for _ in range(2):  # every later call, not only the next one
        with pytest.raises(RuntimeError, match=r"wait gave up on rank 0 .* in call 1, .*reset_workspaces"):
            layer(x, idx, w, w13, w2)
    fused.reset_workspaces(group)
    assert ws.error() is None
    again = run_with_grads(layer, x, idx, w, w13, w2, dy)
    for name, a, b in zip(["y", "dx", "dtopk_weights", "dw13", "dw2"], first, again):
        assert torch.equal(a, b), name


def check_compiled_first_call(group) -> None:
    """The fused layer compiled with fullgraph before any eager call: its set-up (the ranks' token-count agreement,
    the workspace's allocation; collectives, not traceable) runs once, while the compiler traces, and the compiled
    layer's output and gradients are the eager layer's, bit for bit. One gloo rank, over the loopback workspace
    (symmetric memory needs GPUs; the GPU tests run the real one). Patches the fused module: a worker's process
    ends with the check."""
    from megamoe.parallel import fused
    from megamoe.parallel.workspace import loopback_workspaces

    device = "cuda" if torch.cuda.is_available() else "cpu"
    set_up = {"workspaces": 0, "all_reduce": 0}

    def loopback_workspace(group, num_local, capacity, max_tokens, max_slots, dim, dtype):
        set_up["workspaces"] += 1
        return loopback_workspaces(1, num_local, capacity, max_tokens, max_slots, dim, dtype, device)[0]

    def counted_all_reduce(*args, _all_reduce=dist.all_reduce, **kwargs):
        set_up["all_reduce"] += 1
        return _all_reduce(*args, **kwargs)

    fused.symmetric_workspace = loopback_workspace
    dist.all_reduce = counted_all_reduce
    x, idx, w, w13, w2, dy = make_problem(24, 32, 16, 4, 2, "random", device=device)

    def layer(x, idx, w, w13, w2):
        return fused.moe_fused_ep(x, idx, w, w13, w2, group, None, 0)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    got = run_with_grads(compiled, x, idx, w, w13, w2, dy)
    assert set_up == {"workspaces": 1, "all_reduce": 1}
    eager = run_with_grads(layer, x, idx, w, w13, w2, dy)
    again = run_with_grads(compiled, x, idx, w, w13, w2, dy)
    assert set_up == {"workspaces": 1, "all_reduce": 1}, "the set-up ran again"
    for name, a, b, c in zip(["y", "dx", "dtopk_weights", "dw13", "dw2"], got, eager, again):
        assert torch.equal(a, b) and torch.equal(c, b), name
    # A new token count: a recompile with it dynamic (torch.compile's automatic dynamic shapes), on the count
    # agreed at the first call.
    fewer = (x[:20], idx[:20], w[:20], w13, w2, dy[:20])
    assert all(torch.equal(a, b) for a, b in zip(run_with_grads(compiled, *fewer), run_with_grads(layer, *fewer)))
    assert set_up == {"workspaces": 1, "all_reduce": 1}
    # Dynamic sizes of the layer itself (dynamic=True), and a token count marked dynamic at the first call (no number
    # to agree on): dynamo refuses them to the set-up's constant functions, in its words of torch 2.13
    # ("assume_constant_result argument conversion failed") or 2.11 ("SymNodeVariable() is not a constant").
    fused._AGREED_MAX_TOKENS.clear()
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=DYNAMO_REFUSES_A_DYNAMIC_SIZE):
        torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")(x, idx, w, w13, w2)
    torch._dynamo.reset()
    marked = [x.detach().clone(), idx.clone()]
    for t in marked:
        torch._dynamo.mark_dynamic(t, 0)
    with pytest.raises(RuntimeError, match=DYNAMO_REFUSES_A_DYNAMIC_SIZE):
        torch.compile(layer, fullgraph=True, backend="aot_eager")(marked[0], marked[1], w, w13, w2)
    sized = torch.compile(lambda x, idx, w, w13, w2: fused.moe_fused_ep(x, idx, w, w13, w2, group, 24, 0),
                          fullgraph=True, backend="aot_eager")
    assert torch.equal(sized(marked[0], marked[1], w, w13, w2), eager[0])
    assert set_up == {"workspaces": 1, "all_reduce": 1}
