"""Does multicasting the weight tile to a 2-CTA cluster make a Gluon bf16 GEMM faster on Hopper? (Issue "Ahead of
SonicMoE in bf16": SonicMoE's forward GEMMs load each weight tile once for a cluster of two CTAs.)

One dense GEMM, C (M, N) = A (M, K) Bᵀ, B (N, K), both K-major, the up projection's shape, in one kernel with two
modes that differ only in how B's tile reaches shared memory:

- ``multicast``: the cluster's two CTAs compute row blocks 2 m and 2 m + 1 of the same column block; each loads half
  of B's (BN, 64) tile per K-step and multicasts it into both CTAs' ring slot. A slot is refilled only once both CTAs'
  MMAs are done with it: each CTA releases it on its own ``empty`` barrier and its peer's (two arrivals a phase), the
  peer's by a remote arrive at the CTA's scope (PTX's default; at the cluster's scope it cost ~0.3 us a K-step and
  the mode lost 11-46%: docs/FACTS.md).
- ``own``: the same cluster launch, ring and barriers; each CTA loads both halves of B's tile into its own slot alone
  (one arrival a phase).

Both modes: a (128, BN) block a CTA, not persistent; a loader warpgroup filling a ring of ``stages`` slots of A
(128, 64) and B (BN, 64) and an MMA partition of two warpgroups (64 rows each, one MMA in flight, a slot released once
the MMA after it is issued), which then writes the block through shared memory by TMA stores. Every copy is issued
from inline PTX (``tools.multicast`` says how a Gluon kernel names its tensor maps and buffers there), the barriers,
the MMAs and the warp specialisation are Gluon's. (A first version without a loader, whose MMA warps refilled each
released slot themselves, lost 15-42% with the multicast; it too released the peer's slot at the cluster's scope;
docs/PERFORMANCE.md.)

``python -m tools.multicast_gemm [--preset P] [--out DIR]`` on an sm90 GPU: checks both modes against torch's matmul
and times them (``do_bench`` medians) beside torch's matmul (cuBLAS) on the preset's up projection (M = 16 384 x 8
rows); JSON into ``--out``. Without a GPU it compiles both modes for sm_90a and reports the multicast in the SASS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.provenance import write_record
from tools.multicast import CLUSTER, HOPPER, compile_at_own_offsets, sass_of

BM, BK = 128, 64  # a CTA's rows; K-step (one 128-byte swizzle panel of bf16)
NUM_WARPS = 8
SWIZZLED = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=CLUSTER)
PARAMS_PER_DESC = 5  # a 2-D tensor descriptor argument: the tensor map, then two sizes and two strides
SHAPES = {"qwen3-30b-a3b": (2048, 1536), "qwen3-235b-a22b": (4096, 3072)}  # (D, 2I): the up projection's K and N


@gluon.jit
def _loader(a_ring, b_ring, full, empty, row0, col0, rank, k_steps, LOAD_ASM: gl.constexpr, SYNC_ASM: gl.constexpr):
    """Producer partition (a warpgroup, one thread issuing): each K-step's A and B tiles into the ring, a slot refilled
    once it is released (by both CTAs' MMAs where B is multicast: ``empty`` counts two arrivals then). Between the
    cluster's barriers (``SYNC_ASM``), which every thread of both CTAs must reach."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    BN: gl.constexpr = b_ring.type.shape[1]
    gl.inline_asm_elementwise(SYNC_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    for k in range(k_steps):
        s = k % STAGES
        mbarrier.wait(empty.index(s), ((k // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(s), (128 + BN) * 64 * 2)
        gl.inline_asm_elementwise(LOAD_ASM, "=r,r,r,r,r,r", [s, k * 64, row0, col0, rank], dtype=gl.int32,
                                  is_pure=False, pack=1)
    gl.inline_asm_elementwise(SYNC_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _mma(a_ring, b_ring, full, empty, c_buf, row0, col0, rank, k_steps, ACC_LAYOUT: gl.constexpr,
         RELEASE_ASM: gl.constexpr, STORE_ASM: gl.constexpr, SYNC_ASM: gl.constexpr):
    """MMA partition (two warpgroups): one MMA in flight, each slot released once the MMA after it is issued; then
    the block through shared memory to C by TMA. Between the cluster's barriers, as the loader."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    BN: gl.constexpr = b_ring.type.shape[1]
    # this CTA's barriers (initialised by these threads) and the peer's, before either CTA copies or arrives
    gl.inline_asm_elementwise(SYNC_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    acc = gl.zeros([128, BN], gl.float32, ACC_LAYOUT)
    for k in range(k_steps):
        s = k % STAGES
        mbarrier.wait(full.index(s), (k // STAGES) & 1)
        acc = warpgroup_mma(a_ring.index(s), b_ring.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        if k > 0:  # step k - 1's MMA is done in every warp: its slot goes back to the loaders
            gl.thread_barrier()
            gl.inline_asm_elementwise(RELEASE_ASM, "=r,r,r", [(k - 1) % STAGES, rank], dtype=gl.int32,
                                      is_pure=False, pack=1)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    c_buf.store(acc.to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()
    gl.inline_asm_elementwise(STORE_ASM, "=r,r,r", [row0, col0], dtype=gl.int32, is_pure=False, pack=1)
    # no CTA exits while its peer may still copy into it or arrive on its barriers
    gl.inline_asm_elementwise(SYNC_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def multicast_gemm_kernel(a_desc, b_desc, c_desc, num_n, k_steps, BN: gl.constexpr, STAGES: gl.constexpr,
                          EMPTY_ARRIVALS: gl.constexpr, ACC_LAYOUT: gl.constexpr, BAR_LAYOUT: gl.constexpr,
                          SMEM_LAYOUT: gl.constexpr, RANK_ASM: gl.constexpr, SYNC_ASM: gl.constexpr,
                          LOAD_ASM: gl.constexpr, RELEASE_ASM: gl.constexpr, STORE_ASM: gl.constexpr):
    """A cluster (program) of two CTAs; CTA r computes C's rows [(2 m + r) 128, +128) x columns [n BN, +BN)."""
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, 64], SMEM_LAYOUT)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 64], SMEM_LAYOUT)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR_LAYOUT)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR_LAYOUT)
    c_buf = gl.allocate_shared_memory(gl.bfloat16, [128, BN], SMEM_LAYOUT)
    rank = gl.inline_asm_elementwise(RANK_ASM, "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    pid = gl.program_id(0)
    row0 = ((pid // num_n) * 2 + rank) * 128
    col0 = (pid % num_n) * BN
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=EMPTY_ARRIVALS)
    # The cluster's barriers are in the partitions: every thread of both CTAs must arrive on one, and the worker
    # warps wait for their partition from the kernel's start (a barrier here, outside the partitions, hangs).
    gl.warp_specialize([
        (_mma, (a_ring, b_ring, full, empty, c_buf, row0, col0, rank, k_steps, ACC_LAYOUT, RELEASE_ASM, STORE_ASM,
                SYNC_ASM)),
        (_loader, (a_ring, b_ring, full, empty, row0, col0, rank, k_steps, LOAD_ASM, SYNC_ASM)),
    ], [4], [48])


def _global(offset: int, reg: str) -> str:
    return f"mov.u32 {reg}, global_smem; add.u32 {reg}, {reg}, {offset};"


def _desc(index: int, reg: str) -> str:
    """The address of the kernel's ``index``-th tensor descriptor argument's tensor map into ``reg`` (a .b64)."""
    return f"mov.b64 {reg}, multicast_gemm_kernel_param_{index * PARAMS_PER_DESC}; cvta.param.u64 {reg}, {reg};"


def _load_asm(offsets: dict[str, int], bn: int, multicast: bool) -> str:
    """The loader's first thread loads slot $1's A (128, 64) at (row $3, k $2) and B's tile at (row $4, k $2): in
    ``multicast`` its half $5 into both CTAs (mask 0b11), else both halves into its own CTA; each copy completes bytes
    on ``full[$1]`` of the CTA it lands in."""
    half = bn // 2
    b_copy = ("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
              + (".multicast::cluster" if multicast else ""))
    if multicast:
        b_copies = f"""mad.lo.u32 d, $5, {half * 128}, d; mad.lo.u32 y, $5, {half}, $4;
 @p {b_copy} [d], [mb, {{$2, y}}], [f], mask;"""
    else:
        b_copies = f"""@p {b_copy} [d], [mb, {{$2, $4}}], [f];
 add.u32 d, d, {half * 128}; add.u32 y, $4, {half};
 @p {b_copy} [d], [mb, {{$2, y}}], [f];"""
    return f"""{{
 .reg .pred p; .reg .b32 t, d, f, y; .reg .b64 ma, mb; .reg .b16 mask;
 mov.u32 t, %tid.x; and.b32 t, t, 127; setp.eq.u32 p, t, 0; mov.u16 mask, 3;
 {_global(offsets['full'], 'f')} mad.lo.u32 f, $1, 8, f;
 {_desc(0, 'ma')} {_desc(1, 'mb')}
 {_global(offsets['a_ring'], 'd')} mad.lo.u32 d, $1, {128 * 128}, d;
 @p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [d], [ma, {{$2, $3}}], [f];
 {_global(offsets['b_ring'], 'd')} mad.lo.u32 d, $1, {bn * 128}, d;
 {b_copies}
 mov.u32 $0, 0;
}}"""


def _release_asm(offsets: dict[str, int], multicast: bool) -> str:
    """Thread 0 arrives on ``empty[$1]`` of its CTA and, with ``multicast``, of its peer (CTA $2 ^ 1), at the CTA's
    scope: the slot was read by the MMAs, retired before the arrive, and the peer only overwrites it by TMA."""
    remote = """xor.b32 r, $2, 1; mapa.shared::cluster.u32 r, e, r;
 @p mbarrier.arrive.shared::cluster.b64 _, [r];""" if multicast else ""
    return f"""{{
 .reg .pred p; .reg .b32 t, e, r;
 mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;
 {_global(offsets['empty'], 'e')} mad.lo.u32 e, $1, 8, e;
 @p mbarrier.arrive.shared::cta.b64 _, [e];
 {remote}
 mov.u32 $0, 0;
}}"""


def _store_asm(offsets: dict[str, int], bn: int) -> str:
    """Thread 0 (the MMA partition's threads' shared stores fenced to the async proxy and joined) stores the block
    (128, BN) by TMA from its 64-column panels (each 128 rows of 128 bytes, one after another) to rows $1, columns
    $2 + 64 j, and waits until they are read."""
    stores = "\n ".join(f"add.u32 x, $2, {64 * j}; add.u32 s, c, {j * 128 * 128}; "
                        f"@p cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [mc, {{x, $1}}], [s];"
                        for j in range(bn // 64))
    return f"""{{
 .reg .pred p; .reg .b32 t, c, s, x; .reg .b64 mc;
 mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;
 {_global(offsets['c_buf'], 'c')} {_desc(2, 'mc')}
 {stores}
 @p cp.async.bulk.commit_group; @p cp.async.bulk.wait_group.read 0;
 mov.u32 $0, 0;
}}"""


RANK_ASM = "mov.u32 $0, %cluster_ctarank;"
SYNC_ASM = ("fence.mbarrier_init.release.cluster; barrier.cluster.arrive.release.aligned; "
            "barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;")
NAMES = ("a_ring", "b_ring", "full", "empty", "c_buf")


def constexprs(offsets: dict[str, int], bn: int, stages: int, multicast: bool) -> dict:
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, bn, 16],
                                    cga_layout=CLUSTER)
    return {"BN": bn, "STAGES": stages, "EMPTY_ARRIVALS": 2 if multicast else 1, "ACC_LAYOUT": acc,
            "BAR_LAYOUT": mbarrier.MBarrierLayout(cga_layout=[[0]]), "SMEM_LAYOUT": SWIZZLED, "RANK_ASM": RANK_ASM,
            "SYNC_ASM": SYNC_ASM, "LOAD_ASM": _load_asm(offsets, bn, multicast),
            "RELEASE_ASM": _release_asm(offsets, multicast), "STORE_ASM": _store_asm(offsets, bn)}


def _compile(offsets: dict[str, int], bn: int, stages: int, multicast: bool):
    given = constexprs(offsets, bn, stages, multicast)
    signature = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{SWIZZLED}>",
                 "b_desc": f"tensordesc<bf16[{bn // 2}, {BK}],{SWIZZLED}>",
                 "c_desc": f"tensordesc<bf16[{BM}, 64],{SWIZZLED}>", "num_n": "i32", "k_steps": "i32",
                 **{name: "constexpr" for name in given}}
    source = GluonASTSource(fn=multicast_gemm_kernel, signature=signature, constexprs=given)
    return triton.compile(source, target=HOPPER, options={"num_warps": NUM_WARPS, "num_ctas": 2})


def compile_gemm(bn: int, stages: int, multicast: bool):
    """The kernel compiled for sm_90a with its buffers' offsets in its asm, and the offsets
    (``tools.multicast.compile_at_own_offsets``)."""
    return compile_at_own_offsets(lambda offsets: _compile(offsets, bn, stages, multicast), NAMES)


def gemm(a: torch.Tensor, b: torch.Tensor, offsets: dict[str, int], bn: int, stages: int,
         multicast: bool) -> torch.Tensor:
    """C = A Bᵀ by the kernel (M a multiple of 256, N of ``bn``, K of 64 with at least ``stages`` steps)."""
    (m, k), n = a.shape, b.shape[0]
    if m % (2 * BM) or n % bn or k % BK or k // BK < stages:
        raise ValueError(f"shape ({m}, {n}, {k}) does not tile by ({2 * BM}, {bn}, {BK}) with {stages} K-steps")
    c = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
    descs = (TensorDescriptor.from_tensor(a, [BM, BK], SWIZZLED),
             TensorDescriptor.from_tensor(b, [bn // 2, BK], SWIZZLED),
             TensorDescriptor.from_tensor(c, [BM, 64], SWIZZLED))
    multicast_gemm_kernel[(m // (2 * BM) * (n // bn),)](*descs, n // bn, k // BK,
                                                         **constexprs(offsets, bn, stages, multicast),
                                                         num_warps=NUM_WARPS, num_ctas=2)
    return c


VARIANTS = [(bn, stages, multicast) for bn, stages in ((128, 4), (256, 3)) for multicast in (False, True)]


def variant_name(bn: int, stages: int, multicast: bool) -> str:
    return f"128x{bn}, {stages} stages, B " + ("multicast" if multicast else "own")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(SHAPES), default="qwen3-235b-a22b")
    p.add_argument("--rows", type=int, default=16384 * 8, help="M: the routed rows")
    p.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    compiled = {v: compile_gemm(*v) for v in VARIANTS}
    for v, (kernel, offsets) in compiled.items():
        sass = sass_of(kernel)
        print(f"{variant_name(*v)}: offsets {offsets}, shared {kernel.metadata.shared} B, "
              f"SASS multicast {'UTMALDG.2D.MULTICAST' in sass}")
    if not torch.cuda.is_available():
        print("no GPU: compiled only (timings need an H100 or H200)")
        return
    from triton.testing import do_bench

    k, n = SHAPES[args.preset]
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
    want = a @ b.t()
    flops = 2 * args.rows * n * k
    rows = [{"variant": "torch matmul (cuBLAS)", "ms": do_bench(lambda: a @ b.t(), warmup=25, rep=500)}]
    for v, (_, offsets) in compiled.items():
        got = gemm(a, b, offsets, *v)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        if err > 1e-2:
            raise SystemExit(f"{variant_name(*v)}: relative error {err:.2e} against torch's matmul")
        rows.append({"variant": variant_name(*v), "rel_err": err,
                     "ms": do_bench(lambda v=v, offsets=offsets: gemm(a, b, offsets, *v), warmup=25, rep=500)})
    for row in rows:
        row["tflops"] = flops / row["ms"] / 1e9
        print(f"{row['variant']:<40} {row['ms']:8.3f} ms {row['tflops']:7.1f} TF/s")
    if args.out is not None:
        write_record(args.out, f"multicast-gemm-{args.preset}.json",
                     " ".join(["python -m tools.multicast_gemm", *(sys.argv[1:] if argv is None else argv)]),
                     preset=args.preset, m=args.rows, n=n, k=k, rows=rows)


if __name__ == "__main__":
    main()
