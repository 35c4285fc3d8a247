import math

import pytest
import torch

from tools import fp8_wgrad_scales as ws


def test_per_expert_scales_equal_the_recipe_where_every_tile_has_the_same_column_amax():
    """Rows repeated tile by tile give each channel the same amax in every 128-row group as over all the rows: one
    scale per channel (over these rows, or a layer of just these rows) then quantises exactly as the recipe's 128x1
    groups (the dequantised operands bit for bit), so the four scalings give the same dW; with the tiles different
    they do not. The float64 products of equal operands may still differ in their last bit (the CPU BLAS sums in an
    order that can depend on the operands' strides and alignment), so their errors are compared to float64's
    rounding, not bit for bit."""
    gen = torch.Generator().manual_seed(0)
    tile_a, tile_b = (torch.randn(128, 128, generator=gen).to(torch.bfloat16) for _ in range(2))
    a, b = tile_a.repeat(3, 1), tile_b.repeat(3, 1)
    assert torch.equal(ws.per_expert(a), ws.per_tile(a)) and torch.equal(ws.per_expert(b), ws.per_tile(b))
    errors = ws.wgrad_errors(a, b, b.float().abs().amax(dim=0))  # the layer: these rows
    assert errors["tile/tile"] > 0
    for name in ("tile/expert", "expert/expert", "tile/layer"):
        assert errors[name] == pytest.approx(errors["tile/tile"], rel=1e-12, abs=0)
    b[128:256] *= 16.0  # one tile's columns 16x larger: the other tiles lose precision under one scale per channel
    assert not torch.equal(ws.per_expert(b), ws.per_tile(b))


def test_the_table_has_every_scaling_of_every_distribution(capsys):
    ws.main(["--rows", "256", "--cols", "128"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["normal", "outlier", "student-t(2)"]
    for r in rows:
        values = [float(v) for v in r[-len(ws.SCALINGS):]]
        assert all(math.isfinite(v) and 0 < v < 0.2 for v in values)


def test_block_scales_equal_the_recipe_where_every_channel_of_a_block_has_the_same_amax():
    """Signs times one magnitude per 128-row tile give every channel of a tile the same amax: one scale per 128 rows
    x 128 channels then quantises exactly as the 128x1 groups, bit for bit (rows past the last tile's end included);
    with the magnitudes drawn per element, it does not."""
    gen = torch.Generator().manual_seed(1)
    rows, cols = 300, 256
    signs = torch.randint(0, 2, (rows, cols), generator=gen).float() * 2 - 1
    magnitude = torch.rand(-(-rows // 128), generator=gen).repeat_interleave(128)[:rows, None] + 0.5
    a = (signs * magnitude).to(torch.bfloat16)
    assert torch.equal(ws.per_block(a), ws.per_tile(a))
    a = (signs * torch.rand(rows, cols, generator=gen)).to(torch.bfloat16)
    assert not torch.equal(ws.per_block(a), ws.per_tile(a))


def test_layer_scales_equal_per_expert_ones_where_the_layer_adds_no_larger_value():
    """The layer's amax of a channel equal to the expert's own gives one scale per channel and expert, bit for bit;
    a layer row larger in one channel changes that channel's values and no other's."""
    gen = torch.Generator().manual_seed(2)
    b = torch.randn(300, 128, generator=gen).to(torch.bfloat16)
    amax = b.float().abs().amax(dim=0)
    assert torch.equal(ws.per_layer(b, amax), ws.per_expert(b))
    larger = amax.clone()
    larger[5] *= 40.0
    diff = (ws.per_layer(b, larger) != ws.per_expert(b)).any(dim=1)
    assert diff[5] and not diff[torch.arange(128) != 5].any()
