"""``tools.multicast``: a Gluon kernel that multicasts a TMA load to a 2-CTA cluster through inline PTX."""

import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _row_sums(x_ptr, out_ptr, N: tl.constexpr):
    rows = tl.arange(0, N)
    tl.store(out_ptr + rows, tl.sum(tl.load(x_ptr + rows[:, None] * N + rows[None, :]), axis=1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="kernels run in the interpreter only without a GPU")
def test_an_interpreted_kernel_leaves_the_language_as_it_found_it():
    """A kernel run by the interpreter (with the tests' patching, ``tests.helpers``) leaves ``triton.language`` as it
    found it, its helpers' patches too: ``tl.sum`` is a helper whose globals name ``triton.language.core``, which the
    launch does not patch. Triton 3.6 left ``tl.core``'s builtins bound to the interpreter's builder, and the sm_90a
    compiles below failed on them when they ran after such a kernel in the same process."""
    import inspect

    spaces = (tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.core.tensor_descriptor_base)

    def resolved(space):  # what each name resolves to, without calling descriptors
        names = set(dir(space)) - {"__annotations__"}  # made empty on first look, by the interpreter's getmembers
        return {name: inspect.getattr_static(space, name) for name in names}

    before = [resolved(space) for space in spaces]
    x = torch.arange(16.0).reshape(4, 4)
    out = torch.empty(4)
    _row_sums[(1,)](x, out, N=4)
    assert torch.equal(out, x.sum(1))
    changed = [(space.__name__, name) for space, was in zip(spaces, before)
               for name, value in resolved(space).items() if was.get(name) is not value]
    assert not changed, changed


def test_the_probe_compiles_to_a_multicast_copy_for_sm90a():
    """Compiled for sm_90a (no GPU needed): the PTX holds the ``.multicast::cluster`` copy and the remote arrive, the
    SASS the multicast TMA load and the cluster barriers; the second compile allocates the buffers at the offsets
    that its asm names (``compile_probe`` raises otherwise), the three of them apart."""
    from tools.multicast import compile_probe, report

    compiled, offsets = compile_probe()
    found = report(compiled)
    assert found["ptx_multicast"] and found["sass_multicast"], found
    assert found["sass_cluster_barrier"] and found["ptx_remote_arrive"] and found["num_ctas"] == 2, found
    assert set(offsets) == {"tile", "full", "released"} and len(set(offsets.values())) == 3, offsets


@pytest.mark.gpu
def test_the_multicast_delivers_both_halves_to_both_ctas():
    """On Hopper: each CTA loads one half of the tile and multicasts it; both CTAs end with the whole tile (CTA 0's
    equal to the source, the two buffers' bytes equal), the kernel launched with the offsets its asm names."""
    from tools.multicast import compile_probe, run_on_gpu

    assert torch.cuda.get_device_capability() >= (9, 0)
    _, offsets = compile_probe()
    assert run_on_gpu(offsets) == {"offsets_as_compiled": True, "cta0_tile_equal": True, "ctas_buffers_equal": True}


@pytest.mark.parametrize("bn, stages", [(128, 4), (256, 3)])
def test_the_gemm_compiles_its_two_modes_apart(bn, stages):
    """``tools.multicast_gemm`` for sm_90a (no GPU needed): the multicast mode's SASS holds the multicast TMA load and
    its PTX the remote arrive at the CTA's scope (at the cluster's it cost ~0.3 us a K-step: docs/FACTS.md), the own
    mode's neither; both allocate the five buffers apart, at the offsets their asm names."""
    from tools.multicast import sass_of
    from tools.multicast_gemm import NAMES, compile_gemm

    for multicast in (False, True):
        compiled, offsets = compile_gemm(bn, stages, multicast)
        ptx = compiled.asm["ptx"]
        assert ("UTMALDG.2D.MULTICAST" in sass_of(compiled)) is multicast
        assert ("mbarrier.arrive.shared::cluster.b64" in ptx) is multicast
        assert "release.cluster.shared::cluster" not in ptx
        assert set(offsets) == set(NAMES) and len(set(offsets.values())) == len(NAMES), offsets
        assert compiled.metadata.num_ctas == 2


@pytest.mark.gpu
@pytest.mark.timeout(120, method="thread")  # a hung kernel (docs/FACTS.md) stops the run, not a 10-minute stall
@pytest.mark.parametrize("bn, stages", [(128, 4), (256, 3)])
@pytest.mark.parametrize("multicast", [False, True])
def test_the_gemm_computes_a_times_b_transposed(bn, stages, multicast):
    """On Hopper, both modes: C = A Bᵀ against float64 products of the bf16 operands, to bf16's rounding, for a grid
    of clusters over several row and column blocks and more K-steps than ring slots (each slot refilled)."""
    from tools.multicast_gemm import compile_gemm, gemm

    gen = torch.Generator(device="cuda").manual_seed(bn + multicast)
    a = torch.randn(1024, 640, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(3 * bn, 640, device="cuda", dtype=torch.bfloat16, generator=gen)
    _, offsets = compile_gemm(bn, stages, multicast)
    got = gemm(a, b, offsets, bn, stages, multicast).double()
    want = a.double() @ b.double().t()
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-2).all()
    with pytest.raises(ValueError, match="does not tile"):
        gemm(a[:640], b, offsets, bn, stages, multicast)  # 2.5 clusters of rows
