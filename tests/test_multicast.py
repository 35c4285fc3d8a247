"""``tools.multicast``: a Gluon kernel that multicasts a TMA load to a 2-CTA cluster through inline PTX."""

import pytest
import torch


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
