"""``megamoe.moe``: the functional MoE experts, its argument checks, and the choice of backend.

Shape legend: T tokens, K experts per token, E experts (all of them: under expert parallelism each of R ranks
holds E/R, see ``moe``'s ``group``), D hidden size, I expert intermediate size.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from megamoe import autograd, reference
from megamoe.autograd import fused_moe
from megamoe.env import debug_checks_enabled, interpreting, warn_once
from megamoe.kernels.quant import check_fp8_dims
from megamoe.parallel.all_to_all import moe_all_to_all
from megamoe.parallel.fused import comm_sms_ok, comm_sms_pair, moe_fused_ep

PRECISIONS = ("bf16", "fp8")
SAVE_MODES = ("none", "preact")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def backend_for(x: torch.Tensor, fp8: bool = False) -> str:
    """Which implementation :func:`moe` runs for an input on ``x``'s device: ``"triton"`` or ``"reference"``.

    ``MEGAMOE_BACKEND=reference`` forces the reference (for debugging). The fused Triton kernels run on
    Hopper (compute capability 9.0) or newer GPUs — they read the weights through TMA descriptors — and
    on CPU tensors under ``TRITON_INTERPRET=1`` (tests). Everything else runs
    :func:`megamoe.reference.moe_grouped_mm` — same numbers, slower. Shapes the kernels cannot take
    are checked separately (:func:`fused_supports`). ``fp8``: the blockwise FP8 kernels, on Hopper; before
    Hopper (no FP8 tensor cores) a one-time warning and the bf16 kernels' reference path.
    """
    forced = os.environ.get("MEGAMOE_BACKEND", "auto")
    if forced not in ("auto", "reference"):
        raise ValueError(f"MEGAMOE_BACKEND must be auto or reference, got {forced!r}")
    if forced == "reference":
        return "reference"
    if x.is_cuda:
        # Not the cached device_capability: this runs inside torch.compile regions, where Dynamo warns on every
        # functools.cache-wrapped call it traces.
        if torch.cuda.get_device_capability(x.device) >= (9, 0):
            return "triton"
        warn_once("megamoe: GPU older than Hopper (sm90); running the (slow) reference implementation"
                  + (" in bf16 (precision='fp8' needs Hopper's FP8 tensor cores)" if fp8 else ""))
        return "reference"
    return "triton" if interpreting() else "reference"


def fused_supports(x: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the fused kernels take these shapes: TMA needs rows of D and I elements to be multiples of
    16 bytes. Real layers always are (D and I are multiples of 64); otherwise :func:`moe` warns once and
    runs the reference. Shapes and dtypes only, so that ``torch.compile`` traces it (weights that do not
    start 16-byte aligned are handled inside the op: see ``kernels.expert_fwd.descriptor``)."""
    size = x.dtype.itemsize
    return x.shape[1] * size % 16 == 0 and w2.shape[2] * size % 16 == 0


def ep_path(x: torch.Tensor, w2: torch.Tensor) -> str:
    """Which exchange :func:`moe` runs with ``group=...``: ``"fused"`` or ``"all_to_all"``.

    ``MEGAMOE_EP`` (default ``auto``): ``auto`` picks the fused protocol (:mod:`megamoe.parallel.fused`)
    wherever it runs — CUDA tensors, the fused backend (sm90+) and shapes :func:`fused_supports` takes —
    and otherwise the all-to-all baseline, with a one-time warning for CUDA tensors (it synchronises
    with the host); ``fused`` raises ``ValueError`` where the fused protocol cannot run; ``all_to_all``
    always runs the baseline (TorchTitan's host-synced ``all_to_all_single`` around megamoe's local
    experts).
    """
    ep = os.environ.get("MEGAMOE_EP", "auto")
    if ep not in ("auto", "all_to_all", "fused"):
        raise ValueError(f"MEGAMOE_EP must be auto, all_to_all or fused, got {ep!r}")
    if ep == "all_to_all":
        return ep
    if x.is_cuda and backend_for(x) == "triton" and fused_supports(x, w2):
        return "fused"
    if ep == "fused":
        raise ValueError("MEGAMOE_EP=fused needs CUDA tensors on sm90+ with 16-byte rows")
    if x.is_cuda:
        warn_once("megamoe: the fused expert-parallel path cannot run here (it needs sm90+ and 16-byte rows); "
                  "running the all-to-all baseline, which synchronises with the host")
    return "all_to_all"


def _check_tensor(name: str, t, dim: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")


def validate(x, topk_idx, topk_weights, w13, w2, num_ranks: int = 1) -> None:
    """Raise ``TypeError``/``ValueError`` naming the bad argument. With ``num_ranks`` > 1 (expert
    parallelism) the weights hold this rank's E/R experts and expert ids range over all E. Host-side only: no device sync,
    except that expert ids are range-checked eagerly on CPU or with ``MEGAMOE_DEBUG=1``; on a GPU, and under
    ``torch.compile``, they are checked by ``torch._assert_async`` (a bad id fails the computation, never a wrong
    answer)."""
    # fp64: CPU tensors only, where the reference implementation runs it (torch.autograd.gradcheck)
    cpu = isinstance(x, torch.Tensor) and x.device.type == "cpu"
    dtypes = (*FLOAT_DTYPES, torch.float64) if cpu else FLOAT_DTYPES
    _check_tensor("x", x, 2, dtypes)
    _check_tensor("topk_idx", topk_idx, 2, _INDEX_DTYPES)
    _check_tensor("topk_weights", topk_weights, 2, dtypes)
    _check_tensor("w13", w13, 3, (x.dtype,))
    _check_tensor("w2", w2, 3, (x.dtype,))
    num_tokens, dim = x.shape
    if topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx must have T={num_tokens} rows like x, got shape {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights must have the shape of topk_idx {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}"
        )
    if topk_idx.shape[1] < 1:
        raise ValueError("topk_idx must have at least one slot per token (K >= 1)")
    num_local, two_i, w13_dim = w13.shape
    num_experts = num_local * num_ranks
    if num_local < 1:
        raise ValueError("w13 must hold at least one expert")
    if w13_dim != dim:
        raise ValueError(f"w13 must be (E, 2*I, D) with D={dim} (x's hidden size), got shape {tuple(w13.shape)}")
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13 must be (E, 2*I, D) with gate rows then up rows; got odd/zero 2*I={two_i}")
    inter = two_i // 2
    if tuple(w2.shape) != (num_local, dim, inter):
        raise ValueError(f"w2 must be (E, D, I) = ({num_local}, {dim}, {inter}) to match w13 {tuple(w13.shape)} "
                         f"(E, 2*I, D) and x's D, got {tuple(w2.shape)}")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w13", w13), ("w2", w2)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; all inputs must share a device")
    for name, t in (("w13", w13), ("w2", w2)):  # x may be a view: moe copies it
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() once, outside the training step)")
    if topk_idx.numel():
        in_range = ((topk_idx >= -1) & (topk_idx < num_experts)).all()
        # Eagerly on CPU (or in debug mode) the ids are read on the host for a ValueError naming the bad one; a
        # compiled graph cannot branch on them, so there (as on a GPU) an assert fails the computation instead.
        if (not x.is_cuda or debug_checks_enabled()) and not torch.compiler.is_compiling():
            if not bool(in_range):
                bad = topk_idx[(topk_idx < -1) | (topk_idx >= num_experts)][0].item()
                raise ValueError(f"topk_idx holds expert id {bad}, outside [0, {num_experts}) (or -1 for a dropped slot)")
        else:
            torch._assert_async(in_range, f"megamoe: topk_idx holds an expert id outside [-1, {num_experts})")


def check_ep_options(max_tokens_per_rank, comm_sms) -> None:
    """``ValueError`` for a ``max_tokens_per_rank`` or ``comm_sms`` that no path takes (see :func:`moe`)."""
    if max_tokens_per_rank is not None and (not isinstance(max_tokens_per_rank, int)
                                            or isinstance(max_tokens_per_rank, bool) or max_tokens_per_rank < 1):
        raise ValueError(f"max_tokens_per_rank must be None or a positive int, got {max_tokens_per_rank!r}")
    if comm_sms is not None and not comm_sms_ok(comm_sms):
        raise ValueError(f"comm_sms must be None, an int >= 0 or a pair (forward, backward) of them, got {comm_sms!r}")


def moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    group=None,
    precision: str = "bf16",
    max_tokens_per_rank: int | None = None,
    comm_sms: int | tuple[int, int] | None = None,
    save_for_backward: str = "none",
) -> torch.Tensor:
    """Mixture-of-Experts SwiGLU experts with routing already done. Differentiable in ``x``,
    ``topk_weights``, ``w13`` and ``w2``; keeps no activations beyond its inputs on the fused path.

    ``y[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(w13[e,:I] @ x[t]) * (w13[e,I:] @ x[t]))``, ``e = topk_idx[t,k]``.

    Args:
        x: (T, D) activations, bf16 (fp16/fp32 accepted: computed in their own dtype; fp64 on CPU tensors runs
            the reference implementation, for ``torch.autograd.gradcheck``). Any strides: a view is copied.
        topk_idx: (T, K) int32/int64 expert ids in [0, E); -1 marks a dropped slot. An id out of range raises
            ``ValueError`` on CPU tensors or with ``MEGAMOE_DEBUG=1``; on a GPU or in a compiled graph a
            device-side assert fails the step instead (no host sync for the check).
        topk_weights: (T, K) fp32/bf16/fp16 routing weights (gradient returned in this dtype).
        w13: (E, 2*I, D) gate rows [0, I) then up rows [I, 2I), dtype of ``x``, contiguous
            (Hugging Face ``Qwen3MoeExperts.gate_up_proj`` layout).
        w2: (E, D, I) down projection, dtype of ``x``, contiguous (HF ``down_proj`` layout).
        group: ``torch.distributed`` process group for expert parallelism (EP); ``None`` for one GPU.
            Under EP each rank passes its own tokens, *global* expert ids in [0, E) and the weights of
            its own E/R experts (rank r owns experts [r*E/R, (r+1)*E/R)); every rank of the group must
            call with the same D, I and E/R. The exchange is chosen by ``MEGAMOE_EP`` (see
            :func:`ep_path`): by default the fused protocol (:mod:`megamoe.parallel.fused`: device-side
            dispatch through symmetric memory, no host sync) wherever it runs — CUDA tensors on sm90+
            with 16-byte rows — and elsewhere the all-to-all baseline
            (:func:`megamoe.parallel.all_to_all.moe_all_to_all`, host-synchronising; a one-time
            warning on a GPU) with megamoe's local experts.
        max_tokens_per_rank: fused EP only: the most tokens any rank passes in one call; sizes the
            symmetric-memory workspace (``R * max_tokens_per_rank * K`` receive rows of D, twice, and
            ``R * max_tokens_per_rank`` token rows of D per rank), the same on every rank. ``None``:
            agreed at the first call (the largest T of any rank, one collective), and a later call with
            more tokens raises ``ValueError``. Given, it also lets a compiled first call's token count be
            dynamic. A positive int (``ValueError`` otherwise); unused by the other paths, which size nothing
            ahead.
        comm_sms: fused EP only: N > 0 sends the rows to their owners from N programs (one SM each)
            of the gate/up kernel's launch (forward) and of the dh' kernel's launch
            (backward) while their other programs compute on the rows already in — communication
            overlapping the GEMMs; fewer than the GPU's SMs. 0 sends them in a kernel of its own, on
            every SM, before the expert kernels. A pair ``(forward, backward)`` of such counts sets the
            two directions apart. ``None`` (default): ``parallel.fused.DEFAULT_COMM_SMS`` (32, measured), or 0
            on a GPU with at most 64 SMs (``parallel.fused.default_comm_sms``). With ``precision="fp8"`` 0 only
            (``None`` means 0; ``ValueError`` otherwise): its rows are sent by a kernel of their own. Off the
            fused path (one GPU, or the all-to-all exchange) there is nothing to send: ``None`` or 0 only
            (``ValueError`` otherwise).
        precision: ``"bf16"`` — GEMM operands in the input dtype, fp32 accumulation. ``"fp8"``: blockwise e4m3
            GEMMs, DeepSeek-V3's recipe (``megamoe.kernels.quant``): x, h, dy and dz scaled per row per 128
            columns, the weights per 128x128 block (FP8 copies of both orientations made once and cached until
            the weights change: ``kernels.quant.fp8_weight``; or made at every call and kept by none:
            ``megamoe.set_fp8_weight_cache("call")``), fp32 scales and accumulation, promoted every 128
            of K; the routing weights, SwiGLU and combine in fp32; the weight gradients in FP8 from operands
            quantised 128x1 along the tokens (``megamoe.autograd.FP8_WGRAD``, ``MEGAMOE_FP8_WGRAD=0``: in bf16 from
            the unquantised rows; ``megamoe.autograd.FP8_WGRAD_X_SCALES``, ``MEGAMOE_FP8_WGRAD_X_SCALES=layer`` or
            ``expert``: x's with one scale per channel over the layer's tokens, or over each expert's, in dW13: faster,
            options of the recipe, one GPU only). D and I must be multiples of 128 (``ValueError`` otherwise). With
            ``group`` the fused path sends each token's row to its owners in e4m3 with its scales (D + D/32 bytes
            against 2D in bf16) and takes the rows back in x's dtype; the backward's x and dy rows cross in x's
            dtype. On a GPU before Hopper a one-time warning and the bf16 reference.
        save_for_backward: what the fused path keeps between forward and backward. ``"none"`` (default):
            only the inputs and the routing plan; the backward recomputes the gate/up GEMM — the mode for
            activation-checkpointed training, where megamoe's forward need not run twice. ``"preact"``: also
            the gate/up pre-activation, (T·K, 2I) in x's dtype — K·2I·2 bytes per token in bf16 (24 KiB for the
            Qwen3-30B-A3B layer, 48 KiB for Qwen3-235B-A22B) — so the backward skips that GEMM (18 instead of
            22·T·K·D·I FLOPs per step); for training without checkpointing when memory allows. On sm90 the
            Gluon up kernel writes them beside h. With
            ``group`` the fused path keeps, per rank, the products of the rows it receives in a buffer sized for
            the most it can receive (``parallel.fused.preact_buffer``: (R·T_max·K, 2I), R times the one-GPU bytes);
            the all-to-all path keeps its local experts' products. The reference path keeps whatever autograd
            keeps in either mode.

    Returns:
        y: (T, D) in the dtype of ``x``.

    Backend: fused Triton kernels on CUDA (sm90+) for shapes :func:`fused_supports` takes — see
    :func:`backend_for`; elsewhere (with a one-time warning on a GPU) the TorchTitan-style reference
    :func:`megamoe.reference.moe_grouped_mm` (same math, slower), or the per-expert loop where ``torch._grouped_mm`` cannot take the shapes (rows not 16-byte aligned).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if save_for_backward not in SAVE_MODES:
        raise ValueError(f"save_for_backward must be one of {SAVE_MODES}, got {save_for_backward!r}")
    check_ep_options(max_tokens_per_rank, comm_sms)
    if isinstance(x, torch.Tensor):
        x = x.contiguous()  # activations arrive as views (a slice of a wider tensor); the kernels read dense rows
    if group is not None:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        validate(x, topk_idx, topk_weights, w13, w2, num_ranks=dist.get_world_size(group))
        if precision == "fp8":
            check_fp8_dims(x.shape[1], w2.shape[2])
            if autograd.FP8_WGRAD and autograd.FP8_WGRAD_X_SCALES != "tile":
                raise ValueError(f"x's FP8 weight-gradient scales {autograd.FP8_WGRAD_X_SCALES!r} "
                                 "(MEGAMOE_FP8_WGRAD_X_SCALES) are for one GPU: with group=... use 'tile'")
        if ep_path(x, w2) == "fused":
            return moe_fused_ep(x, topk_idx, topk_weights, w13, w2, group, max_tokens_per_rank, comm_sms,
                                save_preact=save_for_backward == "preact", fp8=precision == "fp8",
                                fp8_wgrad=autograd.FP8_WGRAD)
    if comm_sms is not None and max(comm_sms_pair(comm_sms)):
        raise ValueError("comm_sms > 0 applies to the fused expert-parallel path only (group=..., where "
                         "megamoe.api.ep_path picks it)")
    if group is not None:
        return moe_all_to_all(x, topk_idx, topk_weights, w13, w2, group,
                              experts=functools.partial(moe, save_for_backward=save_for_backward, precision=precision))
    validate(x, topk_idx, topk_weights, w13, w2)
    fp8 = precision == "fp8"
    if fp8:
        check_fp8_dims(x.shape[1], w2.shape[2])
    backend = "reference" if x.dtype == torch.float64 else backend_for(x, fp8)
    if backend == "triton" and not x.is_cuda and x.dtype == torch.bfloat16:
        raise TypeError("x is bfloat16 on the CPU under TRITON_INTERPRET=1: Triton's interpreter computes bf16 "
                        "products wrongly (off by orders of magnitude); use float32 or float16 there, or unset "
                        "TRITON_INTERPRET to run the reference implementation")
    if backend == "triton":
        if fused_supports(x, w2):
            return fused_moe(x, topk_idx, topk_weights, w13, w2, save_preact=save_for_backward == "preact", fp8=fp8)
        warn_once(f"megamoe: D={x.shape[1]} and I={w2.shape[2]} rows of {x.dtype} are not 16-byte multiples; "
                  "running the (slow) reference implementation")
    if fp8 and not (x.is_cuda and torch.cuda.get_device_capability(x.device) < (9, 0)):
        # the recipe in plain PyTorch (slow), its weight gradients as the kernels' switch says
        return reference.moe_loop_fp8(x, topk_idx, topk_weights, w13, w2, fp8_wgrad=autograd.FP8_WGRAD,
                                      x_scales=autograd.FP8_WGRAD_X_SCALES)
    if reference.grouped_mm_supports(x.shape[1], w2.shape[2], x.dtype):
        return reference.moe_grouped_mm(x, topk_idx, topk_weights, w13, w2)
    return reference.moe_loop(x, topk_idx, topk_weights, w13, w2)
