"""``megamoe.checkpoint_context``: under activation checkpointing a block recomputes everything but megamoe's
forward, which runs once per training step (plain full checkpointing runs it twice), with the gradients of the
un-checkpointed block, bitwise; through ``torch.utils.checkpoint`` directly and through transformers'
``gradient_checkpointing_enable``."""

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

import megamoe
import megamoe.autograd
from tests.helpers import make_problem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def count_calls(monkeypatch, module, kinds: dict[str, str]) -> dict[str, int]:
    """Calls of ``module``'s functions, counted per kind: ``kinds`` maps each function's name to its kind
    ("forward" or "backward"); the functions are replaced for the test (every caller looks them up in ``module``)."""
    calls = {"forward": 0, "backward": 0}

    def counting(kind, body):
        def counted_body(*args, **kwargs):
            calls[kind] += 1
            return body(*args, **kwargs)

        return counted_body

    for name, kind in kinds.items():
        monkeypatch.setattr(module, name, counting(kind, getattr(module, name)))
    return calls


@pytest.fixture
def counted(monkeypatch):
    """Calls of megamoe's forward and backward bodies (eager Function and custom ops alike)."""
    return count_calls(monkeypatch, megamoe.autograd,
                       {name: name.split("_")[1] for name in ("experts_forward", "experts_forward_fp8",
                                                              "experts_backward", "experts_backward_fp8")})


def before_experts(x: torch.Tensor) -> torch.Tensor:
    """What the test blocks recompute before the experts: elementwise, so that every graph inductor compiles of a
    block (forward, recompute, with or without checkpointing) computes it to the same bits. A LayerNorm did not: its
    reduction, fused differently in each graph, rounded differently (on the H200, in different cases from run to
    run: y one fp32 ulp apart from the block compiled without checkpointing; in the saved mode dx and dw13 ~1e-6
    apart from plain checkpointing, the saved products coming from the forward's norm and the weight gradients'
    rows from the recompute's), which blurred the bitwise checks of megamoe's own results."""
    return torch.nn.functional.silu(x)


def block_problem(mode="none", precision="bf16", after=None):
    """A residual block around the experts, with something to recompute before them; ``after``: applied to the
    experts' output before the residual sum (an op whose backward reads a value computed from that output)."""
    dim, inter = (128, 128) if precision == "fp8" else (32, 16)  # FP8's 128-column groups
    x, idx, w, w13, w2, dy = make_problem(40, dim, inter, 6, 3, "random", device=DEVICE)

    def block(x, w, w13, w2):
        y = megamoe.moe(before_experts(x), idx, w, w13, w2, save_for_backward=mode, precision=precision)
        return x + (y if after is None else after(y))

    return block, (x, w, w13, w2), dy


def grads(fn, leaves, dy):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("mode, precision", [("none", "bf16"), ("preact", "bf16"), ("none", "fp8")])
def test_checkpointed_block_runs_megamoe_forward_once_with_the_same_gradients(counted, monkeypatch, mode, precision):
    """Eagerly: megamoe's forward once per step under the helper (twice under plain checkpointing), the gradients of
    the block without checkpointing, bitwise; in FP8 the weights quantised once per step (w13, w2) either way."""
    from megamoe.kernels import quant

    quantised = count_calls(monkeypatch, quant, {"quantize_weight": "forward"})
    per_step = 2 if precision == "fp8" else 0
    block, leaves, dy = block_problem(mode, precision)
    plain = grads(block, leaves, dy)
    assert counted == {"forward": 1, "backward": 1}
    assert quantised["forward"] == per_step
    counted.update(forward=0, backward=0)
    quantised.update(forward=0)
    helped = grads(_checkpointed(block, helper=True), leaves, dy)
    assert counted == {"forward": 1, "backward": 1}, "megamoe's forward ran again in the recompute"
    assert quantised["forward"] == per_step, "the FP8 weight copies were made again"
    assert all(torch.equal(a, b) for a, b in zip(plain, helped))
    counted.update(forward=0, backward=0)
    quantised.update(forward=0)
    full = grads(_checkpointed(block, helper=False), leaves, dy)
    assert counted == {"forward": 2, "backward": 1}  # what the helper saves: one forward per step
    assert quantised["forward"] == per_step, "the recompute made the FP8 weight copies again"
    assert all(torch.equal(a, b) for a, b in zip(plain, full))


def test_transformers_gradient_checkpointing_with_the_helper(counted):
    import megamoe.integrations.transformers as hf_megamoe
    from tests.test_integrations import step, tiny_model

    model = tiny_model()
    input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    layers = model.config.num_hidden_layers
    _, plain_loss, plain_grads = step(model, "megamoe", input_ids)
    assert counted["forward"] == layers
    counted.update(forward=0, backward=0)
    model = copy.deepcopy(model)
    hf_megamoe.enable_activation_checkpointing(model)
    model.train()
    _, loss, grads_ = step(model, "megamoe", input_ids)
    assert counted == {"forward": layers, "backward": layers}
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads_[n], plain_grads[n]) for n in plain_grads)


def _compiled(fn):
    # aot_eager: AOTAutograd traces the checkpointed region (as inductor's would) without inductor's codegen, so the
    # gradients stay bitwise those of eager.
    return torch.compile(fn, backend="aot_eager" if DEVICE == "cpu" else "inductor", fullgraph=True)


# Under inductor (on a GPU) the reference is the same function compiled without checkpointing: inductor's kernels
# round differently from eager's (~1e-6 here), and its backward fuses the recomputed ops differently from the saved
# ones, so the gradients that flow through them (the block's input gradient, through the recomputed op before the
# experts) may move by fp32 rounding (measured on the H200 with a LayerNorm there: 4.8e-7 at most). megamoe's output
# and the gradients of its weights stay bitwise.
INDUCTOR = DEVICE != "cpu"


def assert_same_block_grads(got, ref, compiled: bool):
    """(y, dx, *weight gradients) of a checkpointed block against its reference: y and the weight gradients
    bitwise; dx bitwise too unless inductor compiled the block (the recomputed op's backward fused differently:
    fp32's default tolerances, see INDUCTOR)."""
    y, dx, *weight_grads = got
    y_ref, dx_ref, *weight_grads_ref = ref
    assert torch.equal(y, y_ref)
    assert all(torch.equal(a, b) for a, b in zip(weight_grads, weight_grads_ref))
    if INDUCTOR and compiled:
        torch.testing.assert_close(dx, dx_ref, rtol=1.3e-6, atol=1e-5)
    else:
        assert torch.equal(dx, dx_ref)


class _Block(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return self.block(*args)


def _context(helper: bool) -> dict:
    """The checkpoint's context_fn: megamoe's helper, or none (torch's plain checkpointing; dynamo refuses torch's
    default passed by name)."""
    return {"context_fn": megamoe.checkpoint_context} if helper else {}


def _checkpointed(fn, helper: bool):
    return lambda *a: checkpoint(fn, *a, use_reentrant=False, **_context(helper))


# How training stacks put the checkpoint and the compiler together: the checkpoint inside a compiled function (each
# block compiled, prime-rl's whole-model compile), TorchTitan's order (the checkpoint wrapper, then the block
# compiled), and an eager checkpoint around a compiled block (transformers' per-layer compile where its checkpoint
# wraps the layer's call, as in transformers 5.17: there inductor may write a later kernel's result into the storage
# of megamoe's output once its graph no longer reads it, while the policy still holds that output for the
# recompute). Each takes helper=False for plain checkpointing wired the same way.
ORDERS = {
    "compiled around the checkpoint": lambda block, helper=True: _compiled(_checkpointed(block, helper)),
    "checkpoint wrapper, then compiled": lambda block, helper=True: _compiled(
        checkpoint_wrapper(_Block(block), **_context(helper))),
    "checkpoint around the compiled block": lambda block, helper=True: _checkpointed(_compiled(block), helper),
}
# The eager wiring and the compiled orders.
WIRINGS = {"eager": lambda block, helper=True: _checkpointed(block, helper), **ORDERS}


@pytest.mark.parametrize("wiring", WIRINGS)
def test_the_helper_recomputes_the_routing_plan(monkeypatch, wiring):
    """The policy saves the outputs of megamoe's forward ops only: the routing plan's op runs again in the recompute,
    eagerly and compiled (saved, its int32 vectors would be what a checkpointed block holds beyond plain
    checkpointing)."""
    import torch._dynamo

    from megamoe.kernels import plan

    torch._dynamo.reset()
    built = count_calls(monkeypatch, plan, {"build_plan": "forward"})  # the plan op's body
    block, leaves, dy = block_problem()
    grads(WIRINGS[wiring](block), leaves, dy)
    assert built["forward"] == 2, "the routing plan was saved, not recomputed"


@pytest.mark.parametrize("after, precision", [(None, "bf16"), (torch.sigmoid, "bf16"), (None, "fp8")],
                         ids=["sum", "sigmoid", "fp8"])
@pytest.mark.parametrize("order", ORDERS)
def test_compiled_checkpointed_block_runs_megamoe_forward_once_with_the_same_gradients(counted, monkeypatch, order,
                                                                                      after, precision):
    """Under torch.compile, in each order, megamoe's forward runs once per step with the gradients of the block
    without checkpointing (compiled alike under inductor; uncompiled on CPU, where the aot_eager backend keeps eager's
    bits). In a compiled region the helper hands torch its two dispatch modes (torch refuses wrapped ones there);
    around a compiled block it keeps a private copy of megamoe's output. ``after=torch.sigmoid``: the recompute feeds
    the held output to an op whose saved result the backward reads. In FP8 the backward (and the recompute) meet the
    weights the forward quantised: two weight quantisations per step (w13, w2), as without checkpointing."""
    import torch._dynamo

    from megamoe.kernels import quant

    torch._dynamo.reset()
    quantised = count_calls(monkeypatch, quant, {"quantize_weight": "forward"})
    block, leaves, dy = block_problem(precision=precision, after=after)
    plain = grads(_compiled(block) if INDUCTOR else block, leaves, dy)
    counted.update(forward=0, backward=0)
    quantised.update(forward=0)
    got = grads(ORDERS[order](block), leaves, dy)
    assert counted == {"forward": 1, "backward": 1}, "megamoe's forward ran again in the recompute"
    assert quantised["forward"] == (2 if precision == "fp8" else 0), "the FP8 weight copies were made again"
    assert_same_block_grads(got, plain, compiled=True)


def test_whole_transformers_model_compiled_fullgraph_with_the_helper(counted):
    """A transformers Qwen3-MoE checkpointed with the helper, then compiled whole with fullgraph: megamoe's forward
    once per layer and step, the loss and every gradient of the plain eager model."""
    import torch._dynamo

    import megamoe.integrations.transformers as hf_megamoe
    from tests.test_integrations import tiny_model

    torch._dynamo.reset()
    model = tiny_model()
    model.set_experts_implementation("megamoe")
    input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    layers = model.config.num_hidden_layers

    def loss_and_grads(m, run=None):
        m.zero_grad()
        loss = (m if run is None else run)(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    plain_loss, plain_grads = loss_and_grads(model, run=_compiled(model) if INDUCTOR else None)
    counted.update(forward=0, backward=0)
    checkpointed = copy.deepcopy(model)
    hf_megamoe.enable_activation_checkpointing(checkpointed)
    checkpointed.train()
    loss, grads_ = loss_and_grads(checkpointed, run=_compiled(checkpointed))
    assert counted == {"forward": layers, "backward": layers}, "megamoe's forward ran again in the recompute"
    if INDUCTOR:  # the recomputed ops fused differently (see INDUCTOR): fp32 rounding
        torch.testing.assert_close(loss, plain_loss, rtol=1.3e-6, atol=1e-5)
        for n in plain_grads:
            torch.testing.assert_close(grads_[n], plain_grads[n], rtol=1.3e-6, atol=1e-5, msg=n)
    else:
        assert torch.equal(loss, plain_loss)
        assert all(torch.equal(grads_[n], plain_grads[n]) for n in plain_grads)


@pytest.mark.gpu
def test_checkpointed_block_holds_its_input_and_megamoe_output_only():
    """Between forward and backward a block checkpointed with the helper holds a copy of megamoe's output (T, D)
    beyond the block's input and output: nothing of its intermediates, not its routing plan (recomputed)."""
    x, idx, w, w13, w2, dy = make_problem(4096, 1024, 512, 32, 4, "random", dtype=torch.bfloat16, device="cuda")
    norm = torch.nn.LayerNorm(1024, device="cuda", dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w13, w2)]

    def block(x, w, w13, w2):
        return x + megamoe.moe(norm(x), idx, w, w13, w2)

    def forward():
        return _checkpointed(block, helper=True)(*leaves)

    forward().backward(dy)  # compile and autotune outside the measurement
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    num_slots, num_experts = idx.numel(), w13.shape[0]
    plan = 4 * (num_experts + 1 + num_slots + 2 * (-(-num_slots // 128) + num_experts))
    expected = x.numel() * x.element_size()
    assert expected <= held < expected + plan, f"held {held} B, megamoe's output {expected} B (its plan: {plan} B)"


def ep_block_problem(comm_sms, save_preact=False, fp8=False):
    """A residual block around the fused expert-parallel layer on one virtual rank (the loopback workspace: the
    protocol's kernels, its exchange to itself included), with its counted forward bodies; ``fp8``: in blockwise
    FP8."""
    from megamoe.parallel import fused
    from megamoe.parallel.workspace import loopback_workspaces

    (dim, inter), experts, top_k, tokens = (128, 128) if fp8 else (32, 16), 4, 2, 24
    x, idx, w, w13, w2, dy = make_problem(tokens, dim, inter, experts, top_k, "random", device=DEVICE)
    (ws,) = loopback_workspaces(1, experts, tokens * top_k, tokens, tokens * top_k, dim, x.dtype, DEVICE)

    def block(x, w, w13, w2):
        return x + fused.fused_ep(before_experts(x), idx, w, w13, w2, ws, (comm_sms, comm_sms), save_preact, fp8=fp8)

    return block, (x, w, w13, w2), dy


@pytest.fixture
def counted_ep(monkeypatch):
    """Calls of the fused EP layer's forward and backward bodies (eager Function and custom ops alike)."""
    from megamoe.parallel import fused

    return count_calls(monkeypatch, fused, {"ep_forward": "forward", "ep_backward": "backward"})


@pytest.mark.loopback
@pytest.mark.parametrize("comm_sms, save_preact, fp8", [(0, False, False), (2, False, False), (0, True, False),
                                                         (0, False, True), (0, True, True)])
@pytest.mark.parametrize("wiring", WIRINGS)
def test_checkpointed_expert_parallel_block_runs_its_exchange_once(counted_ep, monkeypatch, wiring, comm_sms,
                                                                    save_preact, fp8):
    """The fused EP layer under the helper, eagerly and compiled in either order, in bf16 and in FP8: its forward,
    the exchange with the peers included, runs once per step (plain checkpointing runs it twice: the count sees a
    recompute), and the gradients are those of the un-checkpointed block; under inductor, bitwise those of plain
    checkpointing wired the same way (see INDUCTOR). In FP8 the owner's weights are quantised twice per step (w13,
    w2), the backward and any recompute meeting the forward's copies."""
    import torch._dynamo

    from megamoe.kernels import quant

    torch._dynamo.reset()
    quantised = count_calls(monkeypatch, quant, {"quantize_weight": "forward"})
    per_step = 2 if fp8 else 0
    block, leaves, dy = ep_block_problem(comm_sms, save_preact, fp8)
    plain = grads(block, leaves, dy)
    assert quantised["forward"] == per_step
    counted_ep.update(forward=0, backward=0)
    quantised.update(forward=0)
    grads(WIRINGS["eager"](block, helper=False), leaves, dy)
    assert counted_ep == {"forward": 2, "backward": 1}
    assert quantised["forward"] == per_step, "the recompute made the FP8 weight copies again"
    if INDUCTOR and wiring != "eager":
        plain = grads(WIRINGS[wiring](block, helper=False), leaves, dy)
    counted_ep.update(forward=0, backward=0)
    quantised.update(forward=0)
    got = grads(WIRINGS[wiring](block), leaves, dy)
    assert counted_ep == {"forward": 1, "backward": 1}, "the EP layer's forward ran again in the recompute"
    assert quantised["forward"] == per_step, "the FP8 weight copies were made again"
    differ = {name: (a - b).abs().max().item() for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, plain)
              if not torch.equal(a, b)}
    assert not differ, f"not bitwise equal (largest absolute difference): {differ}"


@pytest.mark.loopback
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_expert_parallel_custom_ops_pass_opcheck(fp8):
    from megamoe.kernels.plan import plan_op
    from megamoe.parallel import fused
    from megamoe.parallel.workspace import loopback_workspaces

    dim, inter = (128, 128) if fp8 else (32, 16)
    x, idx, w, w13, w2, dy = make_problem(12, dim, inter, 4, 2, "random", device=DEVICE)
    (ws,) = loopback_workspaces(1, 4, 24, 12, 24, dim, x.dtype, DEVICE)
    number = ws.number
    plan = plan_op(idx, 4)
    precision = (fp8, True)  # the ops' trailing fp8 and fp8_wgrad
    torch.library.opcheck(fused._ep_fwd, (x.requires_grad_(), idx, w.requires_grad_(), w13.requires_grad_(),
                                         w2.requires_grad_(), *plan, number, 0, 0, *precision))
    torch.library.opcheck(fused._ep_bwd, (dy, x.detach(), idx, w.detach(), w13.detach(), w2.detach(), *plan, number,
                                         0, None, *precision))
    torch.library.opcheck(fused._ep_fwd_saved, (x, idx, w, w13, w2, *plan, number, 0, 0, *precision))
    _, preact = fused._ep_fwd_saved(x.detach(), idx, w.detach(), w13.detach(), w2.detach(), *plan, number, 0, 0,
                                    *precision)
    torch.library.opcheck(fused._ep_bwd, (dy, x.detach(), idx, w.detach(), w13.detach(), w2.detach(), *plan, number,
                                         0, preact, *precision))
