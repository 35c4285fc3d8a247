"""Forward expert kernels: gather → [gate|up] GEMM → SwiGLU → h, and h → down GEMM → weighted slot rows; and
the sorted-rows GEMM kernel that the down projection shares with the backward's dh' and dx.

Shape legend: T tokens, K slots per token, E experts, D hidden, I intermediate, N = T*K slots,
NT tiles (see plan.py). Rows of ``h`` are in expert-sorted order; slot rows are token-major (t*K + k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamoe.env import fp8_pow2_scales
from megamoe.kernels.common import (
    busy_tiles,
    descriptor,
    dot_precision,
    persistent_programs,
    rows_k_block,
    sorted_rows_matmul,
    tile_grid,
    tile_rows,
)
from megamoe.kernels.gluon_fp8_sm90 import (
    fp8_rows_gemm_ws,
    fp8_up_swiglu_ws,
    fp8_ws_supported,
)
from megamoe.kernels.gluon_sm90 import up_swiglu_ws, ws_supported
from megamoe.kernels.plan import BLOCK_M, Plan
from megamoe.kernels.quant import quantize_groups
from megamoe.kernels.tuning import TunedKernel, configs


@triton.jit
def _up_swiglu_fwd_kernel(
    x_ptr,  # (T, D)
    w13_desc,  # (E, 2, I, D) view of w13: [:, 0] gate rows, [:, 1] up rows; block (1, 1, BN, BK)
    h_ptr,  # (N, I) out: silu(x W1g^T) * (x W1u^T), sorted rows
    row_slot_ptr,  # (N,) int32
    offsets_ptr,  # (E+1,) int32
    tile_expert_ptr,  # (NT,) int32
    tile_row_ptr,  # (NT,) int32
    preact_ptr,  # (N, 2I) out, if SAVE_PREACT: [x W1g^T | x W1u^T] (the gate/up pre-activation), sorted rows
    x_scale_ptr,  # (D/128, T) fp32, if SCALED: x's 1x128 scales (x and w13 then e4m3: kernels.quant)
    w_scale_ptr,  # (E, 2I/128, D/128) fp32, if SCALED: w13's 128x128 block scales
    h_scale_ptr,  # (I/128, N) fp32 out, if SCALED: h's 1x128 scales (h then written as e4m3)
    T, N, D, I, E, top_k,
    SAVE_PREACT: tl.constexpr, SCALED: tl.constexpr, PREC: tl.constexpr, TILE_M: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, POW2: tl.constexpr = False,
    STORE_H: tl.constexpr = True,  # False (with SAVE_PREACT): the products only
):
    e, _, rows, rmask, pid_n = tile_rows(tl.program_id(0), tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                         tl.cdiv(I, BN), BM, TILE_M)
    if e >= E:
        return
    up_swiglu_block(x_ptr, w13_desc, h_ptr, row_slot_ptr, e, rows, rmask, pid_n, D, I, top_k, PREC, BM, BN, BK,
                    EVEN_K, preact_ptr, SAVE_PREACT, x_scale_ptr, w_scale_ptr, h_scale_ptr, T, N, SCALED, POW2,
                    STORE_H)


@triton.jit
def up_swiglu_block(x_ptr, w13_desc, h_ptr, row_slot_ptr, e, rows, rmask, pid_n, D, I, top_k, PREC: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, preact_ptr=None,
                    SAVE_PREACT: tl.constexpr = False, x_scale_ptr=None, w_scale_ptr=None, h_scale_ptr=None, T=0, N=0,
                    SCALED: tl.constexpr = False, POW2: tl.constexpr = False, STORE_H: tl.constexpr = True):
    """One BM x BN block of h for expert ``e``'s sorted ``rows`` (``rmask``: those of the expert) and N-block
    ``pid_n`` (arguments as for ``_up_swiglu_fwd_kernel``): x rows gathered through the row map, both GEMMs,
    the SwiGLU; with SAVE_PREACT also both products, rounded to h's dtype, into ``preact``. SCALED: x and w13
    in blockwise FP8 (BK = BN = 128), each K-block's products promoted with their scales, and h quantised
    1x128 (the block's columns are one group) with its scales (POW2: power-of-two ones). Without STORE_H only the
    products are written (h_ptr and h_scale_ptr unread). The expert-parallel
    owner's up tiles run it once their rows are in (``parallel.owner``)."""
    slots = tl.load(row_slot_ptr + rows, mask=rmask, other=0)
    tok = (slots // top_k).to(tl.int64)  # int64: T*D overflows int32 at real sizes
    n0 = pid_n * BN
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * D + ks[None, :]
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    if SCALED:
        w_gate = (e * (2 * I // 128) + pid_n) * (D // 128)  # this N-block's gate scales; its up ones I/128 later
        w_up = w_gate + (I // 128) * (D // 128)
    for k0 in range(0, D, BK):
        a = rows_k_block(a_ptrs, rmask, ks, k0, D, EVEN_K)
        # The descriptor zero-fills past this expert's I rows and past D: no masks on the weights.
        bg = w13_desc.load([e, 0, n0, k0]).reshape(BN, BK)
        bu = w13_desc.load([e, 1, n0, k0]).reshape(BN, BK)
        if SCALED:
            sa = tl.load(x_scale_ptr + (k0 // 128) * T + tok, mask=rmask, other=0.0)
            acc_g += tl.dot(a, bg.T) * (sa * tl.load(w_scale_ptr + w_gate + k0 // 128))[:, None]
            acc_u += tl.dot(a, bu.T) * (sa * tl.load(w_scale_ptr + w_up + k0 // 128))[:, None]
        else:
            acc_g = tl.dot(a, bg.T, acc_g, input_precision=PREC)
            acc_u = tl.dot(a, bu.T, acc_u, input_precision=PREC)
        a_ptrs += BK
    cols = n0 + tl.arange(0, BN)
    omask = rmask[:, None] & (cols < I)[None, :]
    if STORE_H:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :]
        if SCALED:
            h_q, h_s = quantize_groups(h, POW2)
            tl.store(h_ptrs, h_q, mask=omask)
            tl.store(h_scale_ptr + pid_n * N + rows, h_s, mask=rmask)
        else:
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=omask)
    if SAVE_PREACT:
        preact_ptrs = preact_ptr + rows[:, None].to(tl.int64) * 2 * I + cols[None, :]
        tl.store(preact_ptrs, acc_g.to(preact_ptr.dtype.element_ty), mask=omask)
        tl.store(preact_ptrs + I, acc_u.to(preact_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _sorted_rows_gemm_kernel(
    a_desc,  # (N, K) sorted rows; block (BM, BK)
    w_desc,  # (E, N_OUT, K) if W_K_LAST, block (1, BN, BK); else (E, K, N_OUT), block (1, BK, BN)
    weights_ptr,  # (N,) routing weight of each slot (flat t*K + k); read only if WEIGHTED
    out_ptr,  # (N, N_OUT) out: [weight *] (A W[e]), token-major slot rows if TO_SLOTS, else sorted rows
    row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
    a_scale_ptr,  # (K/128, N) fp32 row scales of A, if SCALED (blockwise FP8: kernels.quant)
    w_scale_ptr,  # (E, N_OUT/128, K/128) fp32 block scales of W, if SCALED
    N_OUT, K, E,
    M,  # rows of A (the row scales' stride); read only if SCALED
    PROGRAMS,  # the grid's size; read only if PERSISTENT
    W_K_LAST: tl.constexpr, WEIGHTED: tl.constexpr, TO_SLOTS: tl.constexpr, PERSISTENT: tl.constexpr,
    SCALED: tl.constexpr, EB: tl.constexpr, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
    row_dest_ptr=None,  # (N,) int64, read if ROW_DEST: row r at out_ptr + row_dest[r] 16-byte units (TO_SLOTS)
    ROW_DEST: tl.constexpr = False,
):
    """A GEMM over sorted rows, each row times its expert's weight: the forward's down projection
    (h W2^T, weighted) and the backward's dx (dz W13, unweighted), whose output rows go back to slot
    order (TO_SLOTS), and the backward's dh' (dy W2), whose output rows stay sorted.

    A config knob: without PERSISTENT, one program per (sub-)tile × N-block of the tile grid, idle tiles
    return at once. With PERSISTENT, PROGRAMS programs (one per SM) stride over the busy tiles (counted
    from the expert offsets; EB: a power of two >= E) in one flattened loop, so Triton's pipeliner loads
    the next tile's operands during this tile's epilogue. SCALED: FP8 operands with their scales (BK = 128,
    W_K_LAST; see ``common.sorted_rows_matmul``). ROW_DEST: each output row anywhere in the address space (an
    expert-parallel owner's rows into their sources' slots; ``gluon_fp8_sm90_details.rows.rows_ws_kernel`` alike)."""
    num_n = tl.cdiv(N_OUT, BN)
    if PERSISTENT:
        work = busy_tiles(offsets_ptr, E, EB, TILE_M) * (TILE_M // BM) * num_n
        for pid in tl.range(tl.program_id(0), work, PROGRAMS, flatten=True):
            _sorted_rows_gemm_tile(pid, a_desc, w_desc, weights_ptr, out_ptr, row_slot_ptr, offsets_ptr,
                                   tile_expert_ptr, tile_row_ptr, N_OUT, K, E, num_n, W_K_LAST, WEIGHTED, TO_SLOTS,
                                   False, PREC, TILE_M, BM, BN, BK, a_scale_ptr, w_scale_ptr, M, SCALED, row_dest_ptr,
                                   ROW_DEST)
    else:
        _sorted_rows_gemm_tile(tl.program_id(0), a_desc, w_desc, weights_ptr, out_ptr, row_slot_ptr, offsets_ptr,
                               tile_expert_ptr, tile_row_ptr, N_OUT, K, E, num_n, W_K_LAST, WEIGHTED, TO_SLOTS,
                               True, PREC, TILE_M, BM, BN, BK, a_scale_ptr, w_scale_ptr, M, SCALED, row_dest_ptr,
                               ROW_DEST)


@triton.jit
def _sorted_rows_gemm_tile(pid, a_desc, w_desc, weights_ptr, out_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr,
                           tile_row_ptr, N_OUT, K, E, num_n, W_K_LAST: tl.constexpr, WEIGHTED: tl.constexpr,
                           TO_SLOTS: tl.constexpr, SKIP_IDLE: tl.constexpr, PREC: tl.constexpr,
                           TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           a_scale_ptr, w_scale_ptr, M, SCALED: tl.constexpr, row_dest_ptr, ROW_DEST: tl.constexpr):
    """One BM × BN output block of ``_sorted_rows_gemm_kernel``. SKIP_IDLE: return on an idle tile (a
    persistent caller visits busy tiles only)."""
    e, row0, rows, rmask, pid_n = tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, BM, TILE_M)
    if SKIP_IDLE and e >= E:
        return
    n0 = pid_n * BN
    acc = sorted_rows_matmul(a_desc, w_desc, e, row0, n0, K, W_K_LAST, BM, BN, BK, PREC, a_scale_ptr, w_scale_ptr, M,
                             N_OUT, SCALED)
    cols = n0 + tl.arange(0, BN)
    out_rows = rows.to(tl.int64)
    if TO_SLOTS or WEIGHTED:
        slots = tl.load(row_slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        if TO_SLOTS:
            out_rows = slots
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + slots, mask=rmask, other=0.0).to(tl.float32)[:, None]
    row_start = out_rows * N_OUT
    if ROW_DEST:  # in 16-byte units
        unit: tl.constexpr = 128 // out_ptr.dtype.element_ty.primitive_bitwidth
        row_start = tl.load(row_dest_ptr + rows, mask=rmask, other=0) * unit
    out_ptrs = out_ptr + row_start[:, None] + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < N_OUT)[None, :])


# Defaults: best of the sweep on the 30B layer (docs/PERFORMANCE.md); candidates: the runners-up there and
# larger-N/K shapes for wider layers.
UP = TunedKernel(
    _up_swiglu_fwd_kernel, default=configs((128, 128, 64, 8, 3))[0],
    candidates=configs((128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4)),
    key=["D", "I"], even_k=lambda a: a["D"] % a["BK"] == 0,
    blocks=lambda c: {"w13_desc": [1, 1, c["BN"], c["BK"]]}, constants={"SCALED": False},
)
# Blockwise FP8 (kernels.quant): BK = 128, one scale per operand row or block per K-step; BN = 128, so that a
# block's h columns are one 1x128 group. Never autotuned (a fixed config; ``TunedKernel`` tunes 16-bit operands
# only): the Triton FP8 kernels serve the interpreter and GPUs without the Gluon ones.
UP_FP8 = TunedKernel(
    _up_swiglu_fwd_kernel, default=configs((128, 128, 128, 8, 3))[0], candidates=[], key=["D", "I"],
    even_k=lambda a: True, blocks=UP.blocks, constants={"SCALED": True},
)


def sorted_rows_gemm_kernel(**tuned) -> TunedKernel:
    """``_sorted_rows_gemm_kernel`` as a :class:`TunedKernel` (``tuned``: its arguments): the down projection
    here, dh' and dx in expert_bwd.py."""
    return TunedKernel(_sorted_rows_gemm_kernel, **tuned)


DOWN = sorted_rows_gemm_kernel(
    default=configs((128, 256, 64, 8, 3), PERSISTENT=True)[0],
    candidates=configs((128, 256, 64, 8, 4), (128, 128, 64, 8, 4), PERSISTENT=True)
    + configs((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3), PERSISTENT=False),
    key=["N_OUT", "K"], even_k=None,  # the descriptors zero-fill the K tail
    blocks=lambda c: {"a_desc": [c["BM"], c["BK"]], "w_desc": [1, c["BN"], c["BK"]]},
    constants={"W_K_LAST": True, "WEIGHTED": True, "TO_SLOTS": True, "SCALED": False},
)
# The FP8 variant of a sorted-rows GEMM: (BM, BN, num_warps, stages) as the bf16 kernel's default, BK = 128.
FP8_ROWS_CONFIG = configs((128, 128, 128, 8, 3), PERSISTENT=False)[0]
DOWN_FP8 = sorted_rows_gemm_kernel(default=FP8_ROWS_CONFIG, candidates=[], key=DOWN.key, even_k=None, blocks=DOWN.blocks,
                                   constants={**DOWN.constants, "SCALED": True})


def up_swiglu_fwd(x_TD, w13_EHD, plan: Plan, top_k: int, gluon: bool = True,
                  preact_NH: torch.Tensor | None = None) -> torch.Tensor:
    """h (N, I) in x's dtype, rows in expert-sorted order (rows past the routed count are not written); on sm90
    with 16-bit operands (x 16-byte aligned) through the warp-specialized Gluon kernel (``gluon_sm90``).
    ``gluon=False``: the Triton kernel even where the Gluon one would run (to autotune it for the
    expert-parallel kernel that follows its choice). ``preact_NH``: (N, 2I) in x's dtype, also written: each
    sorted row's gate and up products (the saved-activation mode)."""
    num_slots, inter = plan.row_slot_N.numel(), w13_EHD.shape[1] // 2
    h_NI = torch.empty(num_slots, inter, device=x_TD.device, dtype=x_TD.dtype)
    if num_slots == 0:  # an empty batch (a TMA descriptor cannot be empty)
        return h_NI
    if gluon and ws_supported(x_TD) and x_TD.data_ptr() % 16 == 0:
        up_swiglu_ws(x_TD, w13_EHD, h_NI, plan, top_k, BLOCK_M, preact_NH)
        return h_NI
    _launch_up(UP, x_TD, w13_EHD, h_NI, plan, top_k, preact_NH)
    return h_NI


def _launch_up(kernel: TunedKernel, x_TD, w13_EHD, h_NI, plan: Plan, top_k: int, preact_NH, x_scale=None,
               w13_scale=None, h_scale=None) -> None:
    num_experts, two_i, dim = w13_EHD.shape
    kernel[tile_grid(plan, two_i // 2)](
        x_ptr=x_TD, w13_desc=descriptor(w13_EHD.view(num_experts, 2, two_i // 2, dim)), h_ptr=h_NI,
        row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, preact_ptr=preact_NH, x_scale_ptr=x_scale, w_scale_ptr=w13_scale,
        h_scale_ptr=h_scale, T=x_TD.shape[0], N=plan.row_slot_N.numel(), D=dim, I=two_i // 2, E=num_experts,
        top_k=top_k, SAVE_PREACT=preact_NH is not None, STORE_H=h_NI is not None, PREC=dot_precision(x_TD.dtype),
        TILE_M=BLOCK_M, POW2=x_scale is not None and fp8_pow2_scales(), dtype=x_TD.dtype,
    )


def up_swiglu_fp8(xq_TD, xs, w13q_EHD, w13s, plan: Plan, top_k: int,
                  preact_NH: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The up kernel on blockwise FP8 operands (``kernels.quant``: x (T, D) e4m3 with its (D/128, T) scales, w13
    (E, 2I, D) e4m3 with its (E, 2I/128, D/128) block scales): (h (N, I) e4m3, its (I/128, N) scales), sorted rows
    (rows past the routed count are not written). ``preact_NH``: as for ``up_swiglu_fwd``."""
    num_slots, inter = plan.row_slot_N.numel(), w13q_EHD.shape[1] // 2
    h_NI = torch.empty(num_slots, inter, device=xq_TD.device, dtype=xq_TD.dtype)
    h_s = torch.empty(inter // 128, num_slots, device=xq_TD.device, dtype=torch.float32)
    if num_slots == 0:
        return h_NI, h_s
    if fp8_ws_supported(xq_TD, torch.bfloat16 if preact_NH is None else preact_NH.dtype):
        fp8_up_swiglu_ws(xq_TD, xs, w13q_EHD, w13s, h_NI, h_s, plan, top_k, preact=preact_NH)
    else:
        _launch_up(UP_FP8, xq_TD, w13q_EHD, h_NI, plan, top_k, preact_NH, xs, w13s, h_s)
    return h_NI, h_s


def up_products_fp8(xq_TD, xs, w13q_EHD, w13s, plan: Plan, top_k: int, preact_NH: torch.Tensor) -> None:
    """:func:`up_swiglu_fp8` writing only the gate and up products into ``preact_NH`` (N, 2I): the FP8 backward's
    recompute, which has no use for h."""
    if plan.row_slot_N.numel() == 0:
        return
    if fp8_ws_supported(xq_TD, preact_NH.dtype):
        fp8_up_swiglu_ws(xq_TD, xs, w13q_EHD, w13s, None, None, plan, top_k, preact=preact_NH)
    else:
        _launch_up(UP_FP8, xq_TD, w13q_EHD, None, plan, top_k, preact_NH, xs, w13s)


def sorted_rows_gemm(kernel: TunedKernel, a_NK, w_E, weights_N, plan: Plan, n_out: int,
                     scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out_dtype: torch.dtype | None = None,
                     dest: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Launch ``_sorted_rows_gemm_kernel`` as ``kernel`` (DOWN, DX or DH) configures it: (N, n_out), ``a_NK``
    (sorted rows) times each row's expert weight ``w_E[e]``, scaled by ``weights_N`` if given, in slot
    rows (DOWN, DX: dropped slots' rows are not written) or sorted rows (DH: rows past the routed count
    are not written). For a SCALED kernel (FP8 operands, ``w_E`` (E, n_out, K)) ``scales`` = (a's (K/128, N) row
    scales, w's (E, n_out/128, K/128) block scales); the output is in ``out_dtype`` (default: a's dtype). ``dest`` =
    (base, row_dest): a SCALED DOWN or DX kernel's rows written anywhere instead, row r at ``base``'s first element
    plus ``row_dest[r]`` (int64) 16-byte units (an expert-parallel owner's rows into their sources' slots); returns
    ``base``."""
    num_slots, k = a_NK.shape
    if dest is None:
        out = torch.empty(num_slots, n_out, device=a_NK.device, dtype=out_dtype or a_NK.dtype)
    else:  # (a kernel that autotunes would write there once per config tried)
        assert kernel.constants["SCALED"] and kernel.constants["TO_SLOTS"] and dest[1].dtype == torch.int64
        out = dest[0]
    if num_slots == 0:  # an empty batch (a TMA descriptor cannot be empty)
        return out
    a_scale, w_scale = scales or (None, None)
    programs, tiles = persistent_programs(a_NK.device), tile_grid(plan, n_out)
    kernel[lambda cfg: (programs,) if cfg["PERSISTENT"] else tiles(cfg)](
        a_desc=descriptor(a_NK), w_desc=descriptor(w_E), weights_ptr=weights_N, out_ptr=out,
        row_slot_ptr=plan.row_slot_N, offsets_ptr=plan.offsets_E1, tile_expert_ptr=plan.tile_expert_NT,
        tile_row_ptr=plan.tile_row_NT, a_scale_ptr=a_scale, w_scale_ptr=w_scale, N_OUT=n_out, K=k, E=w_E.shape[0],
        M=num_slots, PROGRAMS=programs, EB=triton.next_power_of_2(w_E.shape[0]), PREC=dot_precision(a_NK.dtype),
        TILE_M=BLOCK_M, row_dest_ptr=None if dest is None else dest[1], ROW_DEST=dest is not None, dtype=a_NK.dtype,
    )
    return out


def down_fwd(h_NI, w2_EDI, topk_weights_TK, plan: Plan) -> torch.Tensor:
    """Weighted expert outputs (N, D), one row per slot ``t*K + k``; dropped slots' rows are not written."""
    return sorted_rows_gemm(DOWN, h_NI, w2_EDI, topk_weights_TK.reshape(-1), plan, w2_EDI.shape[1])


def sorted_rows_gemm_fp8(kernel: TunedKernel, a_NK, a_s, w_E, w_s, weights_N, plan: Plan, out_dtype: torch.dtype, *,
                         block_n: int | None = None,
                         dest: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``sorted_rows_gemm`` of a SCALED ``kernel`` (DOWN_FP8, DH_FP8 or DX_FP8) on blockwise FP8 operands: a (N, K)
    e4m3 sorted rows with their (K/128, N) scales, w (E, n_out, K) e4m3 with its (E, n_out/128, K/128) block scales;
    the output in ``out_dtype``. On sm90 with a bf16 output through the warp-specialized Gluon kernel
    (``gluon_fp8_sm90``), which ``kernel``'s constants configure (weighted, to slot rows), in blocks of ``block_n``
    columns (None: the kernel's default, ``gluon_fp8_sm90.fp8_rows_gemm_ws``).
    ``dest``: as for ``sorted_rows_gemm`` (DOWN_FP8, DX_FP8; ``base`` in ``out_dtype``)."""
    num_slots, n_out = a_NK.shape[0], w_E.shape[1]
    if not (num_slots and fp8_ws_supported(a_NK, out_dtype)):
        return sorted_rows_gemm(kernel, a_NK, w_E, weights_N, plan, n_out, scales=(a_s, w_s), out_dtype=out_dtype,
                                dest=dest)
    out = torch.empty(num_slots, n_out, device=a_NK.device, dtype=out_dtype) if dest is None else dest[0]
    fp8_rows_gemm_ws(a_NK, a_s, w_E, w_s, out, plan, weights=None if weights_N is None else weights_N.float(),
                     to_slots=kernel.constants["TO_SLOTS"], row_dest=None if dest is None else dest[1],
                     block_n=block_n)
    return out


def down_fp8(hq_NI, hs, w2q_EDI, w2s, topk_weights_TK, plan: Plan, out_dtype: torch.dtype,
             dest: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``down_fwd`` on blockwise FP8 operands (h (N, I) e4m3 with its (I/128, N) scales, w2 (E, D, I) e4m3 with
    its (E, D/128, I/128) block scales), the rows in ``out_dtype``; ``dest``: as for ``sorted_rows_gemm``."""
    return sorted_rows_gemm_fp8(DOWN_FP8, hq_NI, hs, w2q_EDI, w2s, topk_weights_TK.reshape(-1), plan, out_dtype,
                                dest=dest)
