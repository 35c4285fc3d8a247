"""Forward expert kernels: gather → [gate|up] GEMM → SwiGLU → h, and h → down GEMM → weighted slot rows.

Shape legend: T tokens, K slots per token, E experts, D hidden, I intermediate, N = T*K slots,
NT tiles (see plan.py). Rows of ``h`` are in expert-sorted order; slot rows are token-major (t*K + k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.api import sm_count, warn_once
from megamoe.kernels.plan import BLOCK_M, Plan
from megamoe.kernels.tuning import TunedKernel, configs
from megamoe.kernels.ws import up_swiglu_ws, ws_supported


def descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over all of ``t`` (contiguous, rows 16-byte multiples: see ``api.fused_supports``);
    its block shape is set per config at launch (``TunedKernel.blocks``). TMA also needs the start
    16-byte aligned: a tensor that is not (a weight view at an odd offset into a larger buffer) is
    copied, with a one-time warning, since that copy is paid on every call."""
    if t.data_ptr() % 16:
        warn_once(f"megamoe: a {tuple(t.shape)} operand does not start 16-byte aligned; copying it on every "
                  "call (slow). Allocate the expert weights aligned (any fresh tensor is).")
        t = t.clone()
    return TensorDescriptor.from_tensor(t, [1] * t.dim())


def tile_grid(plan: Plan, n_dim: int):
    """1-D grid over every (sub-tile of every plan tile) × N-block, as a function of the config."""
    return lambda cfg: (plan.tile_expert_NT.numel() * (BLOCK_M // cfg["BM"]) * triton.cdiv(n_dim, cfg["BN"]),)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (tests) use exact fp32 products; tf32 would miss the reference by ~1e-3.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, BM: tl.constexpr, TILE_M: tl.constexpr):
    """Expert, first sorted row, sorted rows, row mask and N-block of program ``pid`` of a 1-D tile grid,
    which covers BM rows (a sub-tile when BM < TILE_M) of a plan tile. The grid runs the N-blocks of one
    (sub-)tile next to each other, so its gathered rows are read from DRAM once and then hit in L2 (a
    tile-major order re-reads them from DRAM once per N-block)."""
    split: tl.constexpr = TILE_M // BM
    pid_m = pid // num_n
    pid_t = pid_m // split
    e = tl.load(tile_expert_ptr + pid_t)
    row0 = tl.load(tile_row_ptr + pid_t) + (pid_m % split) * BM
    row_end = tl.load(offsets_ptr + e + 1)
    rows = row0 + tl.arange(0, BM)
    return e, row0, rows, rows < row_end, pid % num_n


# Most expert-parallel ranks the kernels' wait loops handle (one node).
MAX_EP_RANKS = tl.constexpr(16)


@triton.jit
def _stamp(trace_ptr, at, k, TRACE: tl.constexpr):
    """Expert parallelism's trace (``parallel.dispatch.SENDER_TRACE``): ``trace[at + k] = now`` (the GPU's global
    timer, ns) if TRACE and ``at >= 0``."""
    if TRACE:
        tl.store(trace_ptr + at + k, globaltimer(), mask=at >= 0)


@triton.jit
def _wait_rows(arrived_ptr, counts_ptr, first, e, E, R, EB: tl.constexpr):
    """Expert parallelism: spin until every source's rows of my experts ``first`` to ``e`` (at most EB of
    them) are in my receive buffers (``arrived[s, l] == counts[s, l]`` for every source s; acquire). The
    backward's dh' tiles (``dispatch._dh_rows_tile``) wait for their own expert (``first = e``, EB 1); the
    forward up kernel for every expert up to its own, since a token row it reads was sent with the token's
    first slot at this owner, whose expert may be a lower one (``dispatch._send_rows``). The senders go
    expert by expert, so a tile whose rows are here starts at once either way."""
    srcs = tl.arange(0, MAX_EP_RANKS)[:, None]
    ls = first + tl.arange(0, EB)[None, :]
    m = (srcs < R) & (ls <= e)
    want = tl.load(counts_ptr + srcs * E + ls, mask=m, other=0)
    while tl.sum(tl.sum(((tl.atomic_add(arrived_ptr + srcs * E + ls, 0, mask=m, sem="acquire", scope="sys") != want)
                         & m).to(tl.int32), axis=1), axis=0) > 0:
        pass


@triton.jit
def _wait_rows_upto(arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, e, E, R, EB: tl.constexpr):
    """The forward up tile's wait (``_wait_rows`` for experts 0..e), skipped when ``ready`` says another tile
    of this call has already seen them all in. ``ready`` (int64) holds epoch * (E + 1) + n once a tile of
    the call with that epoch has seen experts 0..n-1 in: only ever raised (atomic max), so it needs no reset,
    and an earlier call's value is below this call's base. Its release and acquire pass the senders'
    releases, which that tile acquired, on to this one. The full wait costs ~2 µs per tile whose rows are long
    in (docs/NOTES.md §46); this check, one atomic."""
    base = tl.load(epoch_ptr).to(tl.int64) * (E + 1)
    if tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu") <= base + e:
        _wait_rows(arrived_ptr, counts_ptr, 0, e, E, R, EB)
        tl.atomic_max(ready_ptr, base + e + 1, sem="release", scope="gpu")


@triton.jit
def _rows_k_block(a_ptrs, rmask, ks, k0, D, EVEN_K: tl.constexpr):
    """The (BM, BK) block at column k0 of rows read through pointers (``a_ptrs``: their column-k0 entries),
    zero past the rows (``rmask``) and, unless EVEN_K, past D."""
    if EVEN_K:
        return tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
    return tl.load(a_ptrs, mask=rmask[:, None] & (ks + k0 < D)[None, :], other=0.0)


@triton.jit
def _up_swiglu_fwd_kernel(
    x_ptr,  # (T, D)
    w13_desc,  # (E, 2, I, D) view of w13: [:, 0] gate rows, [:, 1] up rows; block (1, 1, BN, BK)
    h_ptr,  # (N, I) out: silu(x W1g^T) * (x W1u^T), sorted rows
    row_slot_ptr,  # (N,) int32
    offsets_ptr,  # (E+1,) int32
    tile_expert_ptr,  # (NT,) int32
    tile_row_ptr,  # (NT,) int32
    arrived_ptr, counts_ptr,  # (R, E) int32 each: expert parallelism only (WAIT_ROWS), see _wait_rows
    ready_ptr, epoch_ptr,  # (1,) int64 and (1,) int32: expert parallelism only, see _wait_rows_upto
    D, I, E, top_k, R,
    WAIT_ROWS: tl.constexpr,  # 0, or a power of two >= E: each tile first waits for the rows of experts 0..e
    PREC: tl.constexpr, TILE_M: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
):
    _up_swiglu_tile(tl.program_id(0), x_ptr, w13_desc, h_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                    arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, D, I, E, top_k, R, WAIT_ROWS, PREC, TILE_M, BM, BN,
                    BK, EVEN_K)


@triton.jit
def _up_swiglu_tile(pid, x_ptr, w13_desc, h_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                    arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, D, I, E, top_k, R, WAIT_ROWS: tl.constexpr,
                    PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    EVEN_K: tl.constexpr, trace_ptr=None, trace_at=-1, TRACE: tl.constexpr = False):
    """Program ``pid`` of the up kernel's grid (arguments as for ``_up_swiglu_fwd_kernel``); the EP
    kernel that also sends rows runs it on its programs past the senders (TRACE: it stamps ``trace_at + 1`` when a
    busy tile's rows are in, ``dispatch.SENDER_TRACE``)."""
    e, _, rows, rmask, pid_n = _tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, tl.cdiv(I, BN), BM, TILE_M)
    if e >= E:
        return
    if WAIT_ROWS:
        _wait_rows_upto(arrived_ptr, counts_ptr, ready_ptr, epoch_ptr, e, E, R, WAIT_ROWS)
    _stamp(trace_ptr, trace_at, 1, TRACE)
    slots = tl.load(row_slot_ptr + rows, mask=rmask, other=0)
    tok = (slots // top_k).to(tl.int64)  # int64: T*D overflows int32 at real sizes
    n0 = pid_n * BN
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * D + ks[None, :]
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        a = _rows_k_block(a_ptrs, rmask, ks, k0, D, EVEN_K)
        # The descriptor zero-fills past this expert's I rows and past D: no masks on the weights.
        bg = w13_desc.load([e, 0, n0, k0]).reshape(BN, BK)
        bu = w13_desc.load([e, 1, n0, k0]).reshape(BN, BK)
        acc_g = tl.dot(a, bg.T, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, bu.T, acc_u, input_precision=PREC)
        a_ptrs += BK
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    cols = n0 + tl.arange(0, BN)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * I + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < I)[None, :])


@triton.jit
def _sorted_rows_matmul(a_desc, w_desc, e, row0, n0, K, W_K_LAST: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """fp32 (BM, BN) = A[row0 : row0+BM, :K] @ W[e][:K, n0 : n0+BN], both through TMA. A holds sorted rows
    (block (BM, BK)); rows past the expert's end belong to the next expert, and the caller masks them at
    the store. W is (E, N, K) when ``W_K_LAST`` (block (1, BN, BK)), else (E, K, N) (block (1, BK, BN)).
    The descriptors zero-fill past K and past the expert's N, so the loop needs no masks."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_desc.load([row0, k0])
        if W_K_LAST:
            b = w_desc.load([e, n0, k0]).reshape(BN, BK).T
        else:
            b = w_desc.load([e, k0, n0]).reshape(BK, BN)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _busy_tiles(offsets_ptr, E, EB: tl.constexpr, TILE_M: tl.constexpr):
    """How many plan tiles hold rows (they come first in the tile table): the sum over experts of
    ceil(rows / TILE_M). EB: a power of two >= E."""
    experts = tl.arange(0, EB)
    lo = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
    hi = tl.load(offsets_ptr + experts + 1, mask=experts < E, other=0)
    return tl.sum((hi - lo + TILE_M - 1) // TILE_M, axis=0)


@triton.jit
def _sorted_rows_gemm_kernel(
    a_desc,  # (N, K) sorted rows; block (BM, BK)
    w_desc,  # (E, N_OUT, K) if W_K_LAST, block (1, BN, BK); else (E, K, N_OUT), block (1, BK, BN)
    weights_ptr,  # (N,) routing weight of each slot (flat t*K + k); read only if WEIGHTED
    out_ptr,  # (N, N_OUT) out: [weight *] (A W[e]), token-major slot rows if TO_SLOTS, else sorted rows
    row_slot_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
    N_OUT, K, E,
    PROGRAMS,  # the grid's size; read only if PERSISTENT
    W_K_LAST: tl.constexpr, WEIGHTED: tl.constexpr, TO_SLOTS: tl.constexpr, PERSISTENT: tl.constexpr,
    EB: tl.constexpr, PREC: tl.constexpr, TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):
    """A GEMM over sorted rows, each row times its expert's weight: the forward's down projection
    (h W2^T, weighted) and the backward's dx (dz W13, unweighted), whose output rows go back to slot
    order (TO_SLOTS), and the backward's dh' (dy W2), whose output rows stay sorted.

    A config knob: without PERSISTENT, one program per (sub-)tile × N-block of the tile grid, idle tiles
    return at once. With PERSISTENT, PROGRAMS programs (one per SM) stride over the busy tiles (counted
    from the expert offsets; EB: a power of two >= E) in one flattened loop, so Triton's pipeliner loads
    the next tile's operands during this tile's epilogue."""
    num_n = tl.cdiv(N_OUT, BN)
    if PERSISTENT:
        work = _busy_tiles(offsets_ptr, E, EB, TILE_M) * (TILE_M // BM) * num_n
        for pid in tl.range(tl.program_id(0), work, PROGRAMS, flatten=True):
            _sorted_rows_gemm_tile(pid, a_desc, w_desc, weights_ptr, out_ptr, row_slot_ptr, offsets_ptr,
                                   tile_expert_ptr, tile_row_ptr, N_OUT, K, E, num_n, W_K_LAST, WEIGHTED, TO_SLOTS,
                                   False, PREC, TILE_M, BM, BN, BK)
    else:
        _sorted_rows_gemm_tile(tl.program_id(0), a_desc, w_desc, weights_ptr, out_ptr, row_slot_ptr, offsets_ptr,
                               tile_expert_ptr, tile_row_ptr, N_OUT, K, E, num_n, W_K_LAST, WEIGHTED, TO_SLOTS,
                               True, PREC, TILE_M, BM, BN, BK)


@triton.jit
def _sorted_rows_gemm_tile(pid, a_desc, w_desc, weights_ptr, out_ptr, row_slot_ptr, offsets_ptr, tile_expert_ptr,
                           tile_row_ptr, N_OUT, K, E, num_n, W_K_LAST: tl.constexpr, WEIGHTED: tl.constexpr,
                           TO_SLOTS: tl.constexpr, SKIP_IDLE: tl.constexpr, PREC: tl.constexpr,
                           TILE_M: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One BM × BN output block of ``_sorted_rows_gemm_kernel``. SKIP_IDLE: return on an idle tile (a
    persistent caller visits busy tiles only)."""
    e, row0, rows, rmask, pid_n = _tile_rows(pid, tile_expert_ptr, tile_row_ptr, offsets_ptr, num_n, BM, TILE_M)
    if SKIP_IDLE and e >= E:
        return
    n0 = pid_n * BN
    acc = _sorted_rows_matmul(a_desc, w_desc, e, row0, n0, K, W_K_LAST, BM, BN, BK, PREC)
    cols = n0 + tl.arange(0, BN)
    out_rows = rows.to(tl.int64)
    if TO_SLOTS or WEIGHTED:
        slots = tl.load(row_slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
        if TO_SLOTS:
            out_rows = slots
        if WEIGHTED:
            acc = acc * tl.load(weights_ptr + slots, mask=rmask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + out_rows[:, None] * N_OUT + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < N_OUT)[None, :])


# Defaults: best of the sweep on the 30B layer (docs/NOTES.md); candidates: the runners-up there and
# larger-N/K shapes for wider layers.
UP = TunedKernel(
    _up_swiglu_fwd_kernel, default=configs((128, 128, 64, 8, 3))[0],
    candidates=configs((128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4)),
    key=["D", "I"], even_k=lambda a: a["D"] % a["BK"] == 0,
    blocks=lambda c: {"w13_desc": [1, 1, c["BN"], c["BK"]]},
)
DOWN = TunedKernel(
    _sorted_rows_gemm_kernel, default=configs((128, 256, 64, 8, 3), PERSISTENT=True)[0],
    candidates=configs((128, 256, 64, 8, 4), (128, 128, 64, 8, 4), PERSISTENT=True)
    + configs((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3), PERSISTENT=False),
    key=["N_OUT", "K"], even_k=None,  # the descriptors zero-fill the K tail
    blocks=lambda c: {"a_desc": [c["BM"], c["BK"]], "w_desc": [1, c["BN"], c["BK"]]},
    constants={"W_K_LAST": True, "WEIGHTED": True, "TO_SLOTS": True},
)


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent kernel: one per SM (4 in the interpreter, so that each strides)."""
    if device.type != "cuda":
        return 4
    return sm_count(device.index)


def up_swiglu_fwd(x_TD, w13_EHD, plan: Plan, top_k: int, arrivals: tuple | None = None,
                  gluon: bool = True) -> torch.Tensor:
    """h (N, I) in x's dtype, rows in expert-sorted order (rows past the routed count are not written); on sm90
    with 16-bit operands (x 16-byte aligned) through the warp-specialized Gluon kernel ``ws._up_ws_kernel``.
    ``arrivals``: expert parallelism only, ``(arrived, counts, ready, epoch)`` — (R, E) int32 each, (1,) int64,
    (1,) int32: each tile first waits for the rows of its expert and the lower ones (see ``_wait_rows_upto``);
    always the Triton kernel.
    ``gluon=False``: the Triton kernel even where the Gluon one would run (to autotune it for the
    expert-parallel kernel that follows its choice)."""
    num_slots = plan.row_slot_N.numel()
    num_experts, two_i, dim = w13_EHD.shape
    inter = two_i // 2
    h_NI = torch.empty(num_slots, inter, device=x_TD.device, dtype=x_TD.dtype)
    if num_slots == 0:  # an empty batch (a TMA descriptor cannot be empty)
        return h_NI
    if gluon and arrivals is None and ws_supported(x_TD) and x_TD.data_ptr() % 16 == 0:
        up_swiglu_ws(x_TD, w13_EHD, h_NI, plan, top_k, BLOCK_M)
        return h_NI
    arrived, counts, ready, epoch = arrivals or (plan.offsets_E1,) * 4  # unread without arrivals
    UP[tile_grid(plan, inter)](
        x_TD, descriptor(w13_EHD.view(num_experts, 2, inter, dim)), h_NI, plan.row_slot_N, plan.offsets_E1,
        plan.tile_expert_NT, plan.tile_row_NT, arrived, counts, ready, epoch,
        dim, inter, num_experts, top_k, counts.shape[0] if arrivals else 1,
        WAIT_ROWS=triton.next_power_of_2(num_experts) if arrivals else 0, PREC=dot_precision(x_TD.dtype),
        TILE_M=BLOCK_M, dtype=x_TD.dtype,
    )
    return h_NI


def sorted_rows_gemm(kernel: TunedKernel, a_NK, w_E, weights_N, plan: Plan, n_out: int) -> torch.Tensor:
    """Launch ``_sorted_rows_gemm_kernel`` as ``kernel`` (DOWN, DX or DH) configures it: (N, n_out), ``a_NK``
    (sorted rows) times each row's expert weight ``w_E[e]``, scaled by ``weights_N`` if given, in slot
    rows (DOWN, DX: dropped slots' rows are not written) or sorted rows (DH: rows past the routed count
    are not written)."""
    num_slots, k = a_NK.shape
    out = torch.empty(num_slots, n_out, device=a_NK.device, dtype=a_NK.dtype)
    if num_slots == 0:  # an empty batch (a TMA descriptor cannot be empty)
        return out
    programs, tiles = persistent_programs(a_NK.device), tile_grid(plan, n_out)
    kernel[lambda cfg: (programs,) if cfg["PERSISTENT"] else tiles(cfg)](
        descriptor(a_NK), descriptor(w_E), out if weights_N is None else weights_N, out,
        plan.row_slot_N, plan.offsets_E1, plan.tile_expert_NT, plan.tile_row_NT,
        n_out, k, w_E.shape[0], programs, EB=triton.next_power_of_2(w_E.shape[0]),
        PREC=dot_precision(a_NK.dtype), TILE_M=BLOCK_M, dtype=a_NK.dtype,
    )
    return out


def down_fwd(h_NI, w2_EDI, topk_weights_TK, plan: Plan) -> torch.Tensor:
    """Weighted expert outputs (N, D), one row per slot ``t*K + k``; dropped slots' rows are not written."""
    return sorted_rows_gemm(DOWN, h_NI, w2_EDI, topk_weights_TK.reshape(-1), plan, w2_EDI.shape[1])
