"""Can a Gluon kernel multicast a TMA load to a 2-CTA cluster? A probe for the bf16 GEMM core (SonicMoE's forward
GEMMs load each weight tile once for a cluster of two CTAs; docs/FACTS.md, "Triton 3.6 cannot emit TMA multicast").

Gluon (Triton 3.6) has no multicast argument and no way to turn a shared buffer or a tensor descriptor into a value
an inline asm could take. This kernel issues the multicast from inline PTX with the addresses named instead: the
tensor map is the kernel's by-value parameter ``<kernel>_param_0`` (its address by ``cvta.param``, as Triton's own
TMA lowering takes it), and each shared buffer is Triton's ``global_smem`` plus the offset its allocator gives it,
read back from a first compile (the compiler's allocation pass run on its TTGIR) and written into the asm of a
second compile, which must allocate the same offsets.

The kernel: a cluster of two CTAs; CTA r loads rows [32 r, 32 r + 32) of a (64, 64) bf16 tile (a (32, 64) box,
128-byte swizzle) and multicasts them into both CTAs' buffers; each CTA's mbarrier expects the whole tile. Then CTA
0 stores its tile through Gluon, each CTA dumps its raw (swizzled) buffer from asm, and each releases the slot to CTA
0 by a remote arrive on CTA 0's barrier (``mapa``), as a producer of a multicast slot must wait for every consumer.
Triton's barrier passes do not see shared memory touched only from asm: the asm orders itself (cluster barriers).

``python -m tools.multicast [--out DIR]``: compiles for sm_90a (no GPU needed) and reports whether the PTX holds the
``.multicast::cluster`` copy and the SASS its ``UTMALDG.2D.MULTICAST``; on a GPU also runs the kernel and checks that
both CTAs hold the whole tile (JSON into ``--out``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton._C.libtriton import ir, nvidia, passes
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe.provenance import write_record

HOPPER = GPUTarget("cuda", 90, 128)
CLUSTER = [[0, 0]]  # a 2-CTA cluster's CTA bit maps to no offset of a tile: every CTA holds all of it
ROWS, COLS, HALF = 64, 64, 32
TILE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=CLUSTER)


@gluon.jit
def multicast_probe_kernel(a_desc, out_ptr, raw_ptr, TILE_LAYOUT: gl.constexpr, REG_LAYOUT: gl.constexpr,
                           BAR_LAYOUT: gl.constexpr, LOAD_ASM: gl.constexpr, DUMP_ASM: gl.constexpr,
                           RELEASE_ASM: gl.constexpr):
    """``a_desc``: the (64, 64) tile in (32, 64) boxes; out: CTA 0's tile; raw (2, 8192) bytes: each CTA's buffer."""
    tile = gl.allocate_shared_memory(gl.bfloat16, [64, 64], TILE_LAYOUT)
    full = gl.allocate_shared_memory(gl.int64, [1], BAR_LAYOUT)
    rank = gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r", [], dtype=gl.int32, is_pure=True,
                                     pack=1)
    released = gl.allocate_shared_memory(gl.int64, [1], BAR_LAYOUT)  # CTA 0's: both CTAs are done with the tile
    mbarrier.init(full, count=1)
    mbarrier.init(released, count=2)
    # the barriers' init visible to the peer's copy engine before either CTA multicasts into the other
    gl.inline_asm_elementwise("fence.mbarrier_init.release.cluster; barrier.cluster.arrive.release.aligned; "
                              "barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)
    mbarrier.expect(full, 64 * 64 * 2)
    gl.inline_asm_elementwise(LOAD_ASM, "=r,r", [rank], dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.wait(full, 0)
    rows = gl.arange(0, 64, gl.SliceLayout(1, REG_LAYOUT))
    cols = gl.arange(0, 64, gl.SliceLayout(0, REG_LAYOUT))
    # the layout replicates the tile across the cluster, so Triton stores it from CTA 0 only
    gl.store(out_ptr + rows[:, None] * 64 + cols[None, :], tile.load(REG_LAYOUT))
    gl.inline_asm_elementwise(DUMP_ASM, "=r,l,r", [raw_ptr, rank], dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()
    gl.inline_asm_elementwise(RELEASE_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.wait(released, 0, pred=rank == 0)
    # no CTA exits while its peer may still write into it or arrive on its barrier
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
                              "mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


def _load_asm(tile: int, full: int) -> str:
    """Thread 0 of CTA $1 copies rows [32 $1, 32 $1 + 32) to byte 4096 $1 of the tile in both CTAs (mask 0b11): a
    half is four whole 1 KB swizzle atoms, so the box lands as the (64, 64) swizzled tile holds it."""
    return f"""{{
 .reg .pred p; .reg .b32 t, d, b, x, y; .reg .b64 m64; .reg .b16 mask;
 mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;
 mov.u32 d, global_smem; add.u32 b, d, {full}; add.u32 d, d, {tile}; mad.lo.u32 d, $1, {HALF * COLS * 2}, d;
 mov.u32 x, 0; mul.lo.u32 y, $1, {HALF}; mov.u16 mask, 3;
 mov.b64 m64, multicast_probe_kernel_param_0; cvta.param.u64 m64, m64;
 @p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [d], [m64, {{x, y}}], [b], mask;
 mov.u32 $0, 0;
}}"""


def _dump_asm(tile: int) -> str:
    """Each of 128 threads copies 64 bytes of its CTA's tile to raw + 8192 $2 (the bytes as they lie, swizzled)."""
    return f"""{{
 .reg .b32 t, a, w0, w1, w2, w3; .reg .b64 g, o;
 mov.u32 t, %tid.x; shl.b32 t, t, 6;
 mov.u32 a, global_smem; add.u32 a, a, {tile}; add.u32 a, a, t;
 mul.wide.u32 o, $2, {ROWS * COLS * 2}; add.u64 g, $1, o; cvt.u64.u32 o, t; add.u64 g, g, o;
 ld.shared.v4.b32 {{w0, w1, w2, w3}}, [a];    st.global.v4.b32 [g], {{w0, w1, w2, w3}};
 ld.shared.v4.b32 {{w0, w1, w2, w3}}, [a+16]; st.global.v4.b32 [g+16], {{w0, w1, w2, w3}};
 ld.shared.v4.b32 {{w0, w1, w2, w3}}, [a+32]; st.global.v4.b32 [g+32], {{w0, w1, w2, w3}};
 ld.shared.v4.b32 {{w0, w1, w2, w3}}, [a+48]; st.global.v4.b32 [g+48], {{w0, w1, w2, w3}};
 mov.u32 $0, 0;
}}"""


def _release_asm(released: int) -> str:
    """Thread 0 arrives on CTA 0's ``released`` barrier, whichever CTA it is in (its cluster address by ``mapa``)."""
    return f"""{{
 .reg .pred p; .reg .b32 t, e, r; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;
 mov.u32 e, global_smem; add.u32 e, e, {released};
 mapa.shared::cluster.u32 r, e, 0;
 @p mbarrier.arrive.release.cluster.shared::cluster.b64 _, [r];
 mov.u32 $0, 0;
}}"""


def constexprs(offsets: dict[str, int]) -> dict:
    """The kernel's constexprs with the shared buffers at ``offsets`` (bytes from ``global_smem``, by the kernel's
    variable names)."""
    return {"TILE_LAYOUT": TILE_LAYOUT, "REG_LAYOUT": gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=CLUSTER),
            "BAR_LAYOUT": mbarrier.MBarrierLayout(cga_layout=[[0]]),
            "LOAD_ASM": _load_asm(offsets["tile"], offsets["full"]), "DUMP_ASM": _dump_asm(offsets["tile"]),
            "RELEASE_ASM": _release_asm(offsets["released"])}


def _compile(offsets: dict[str, int]):
    given = constexprs(offsets)
    signature = {"a_desc": f"tensordesc<bf16[{HALF}, {COLS}],{TILE_LAYOUT}>", "out_ptr": "*bf16", "raw_ptr": "*i8",
                 **{name: "constexpr" for name in given}}
    source = GluonASTSource(fn=multicast_probe_kernel, signature=signature, constexprs=given,
                            attrs={(1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})
    return triton.compile(source, target=HOPPER, options={"num_warps": 4, "num_ctas": 2})


def shared_offsets(compiled) -> dict[str, int]:
    """Each shared buffer's offset (by its variable's name), from the allocation pass that Triton's lowering to LLVM
    runs, on the compiled kernel's TTGIR."""
    context = ir.context()
    ir.load_dialects(context)
    nvidia.load_dialects(context)
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir", delete=False) as f:
        f.write(compiled.asm["ttgir"])
    try:
        module = ir.parse_mlir_module(f.name, context)
    finally:
        os.unlink(f.name)
    module.context = context
    pm = ir.pass_manager(context)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, 86)
    pm.run(module, "allocate")
    return {name: int(offset) for name, offset in
            re.findall(r"%(\w+) = ttg.local_alloc \{allocation.offset = (\d+) : i32\}", str(module))}


def compile_at_own_offsets(compile_with, names: tuple[str, ...]):
    """(compiled, offsets): ``compile_with(offsets)`` (a kernel whose asm names the shared buffers ``names`` at those
    offsets from ``global_smem``) compiled twice: with every buffer at 0, to read where the allocator puts them, then
    with those offsets in its asm; the second compile must allocate them as the first did."""
    def named(compiled) -> dict[str, int]:
        return {name: offset for name, offset in shared_offsets(compiled).items() if name in names}

    offsets = named(compile_with(dict.fromkeys(names, 0)))
    compiled = compile_with(offsets)
    if named(compiled) != offsets:
        raise RuntimeError(f"the allocator moved the buffers: {offsets} -> {named(compiled)}")
    return compiled, offsets


def compile_probe():
    """The kernel compiled for sm_90a with its buffers' offsets in its asm (``compile_at_own_offsets``)."""
    return compile_at_own_offsets(_compile, ("tile", "full", "released"))


def sass_of(compiled) -> str:
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([str(bindir / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def report(compiled) -> dict:
    """What the compiled kernel holds: the multicast copy in PTX and SASS, the cluster barriers, the remote arrive."""
    ptx, sass = compiled.asm["ptx"], sass_of(compiled)
    return {"ptx_multicast": ".multicast::cluster" in ptx, "sass_multicast": "UTMALDG.2D.MULTICAST" in sass,
            "sass_cluster_barrier": "UCGABAR_ARV" in sass and "UCGABAR_WAIT" in sass,
            "ptx_remote_arrive": "mapa.shared::cluster" in ptx, "num_ctas": compiled.metadata.num_ctas,
            "shared_bytes": compiled.metadata.shared}


def run_on_gpu(offsets: dict[str, int]) -> dict:
    """Runs the kernel on the GPU: CTA 0's tile equals the source (each CTA having loaded half of it), and the two
    CTAs' buffers hold the same bytes."""
    a = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros_like(a)
    raw = torch.zeros(2, ROWS * COLS * 2, device="cuda", dtype=torch.uint8)
    desc = TensorDescriptor.from_tensor(a, [HALF, COLS], TILE_LAYOUT)
    launched = multicast_probe_kernel[(1,)](desc, out, raw, **constexprs(offsets), num_warps=4, num_ctas=2)
    torch.cuda.synchronize()
    return {"offsets_as_compiled": shared_offsets(launched) == offsets, "cta0_tile_equal": torch.equal(out, a),
            "ctas_buffers_equal": torch.equal(raw[0], raw[1])}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the findings as JSON here (on a GPU)")
    args = p.parse_args(argv)
    compiled, offsets = compile_probe()
    found = {"offsets": offsets, **report(compiled)}
    print(f"compiled for sm_90a: {found}")
    if not torch.cuda.is_available():
        print("no GPU: compiled only (run it on an H100 or H200 to see whether the multicast delivers the tile)")
        return
    found["run"] = run_on_gpu(offsets)
    print(f"ran: {found['run']}")
    if args.out is not None:
        write_record(args.out, "multicast-probe.json", "python -m tools.multicast", **found)


if __name__ == "__main__":
    main()
