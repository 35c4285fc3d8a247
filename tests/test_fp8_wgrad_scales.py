import math

import pytest
import torch

from tools import fp8_wgrad_scales as ws


def test_per_expert_scales_equal_the_recipe_where_every_tile_has_the_same_column_amax():
    """Rows repeated tile by tile give each channel the same amax in every 128-row group as over all the rows: one
    scale per channel then quantises exactly as the recipe's 128x1 groups (the dequantised operands bit for bit), so
    the three scalings give the same dW; with the tiles different they do not. The float64 products of equal operands
    may still differ in their last bit (the CPU BLAS sums in an order that can depend on the operands' strides and
    alignment), so their errors are compared to float64's rounding, not bit for bit."""
    gen = torch.Generator().manual_seed(0)
    tile_a, tile_b = (torch.randn(128, 128, generator=gen).to(torch.bfloat16) for _ in range(2))
    a, b = tile_a.repeat(3, 1), tile_b.repeat(3, 1)
    assert torch.equal(ws.per_expert(a), ws.per_tile(a)) and torch.equal(ws.per_expert(b), ws.per_tile(b))
    errors = ws.wgrad_errors(a, b)
    assert errors["tile/tile"] > 0
    assert errors["tile/expert"] == pytest.approx(errors["tile/tile"], rel=1e-12, abs=0)
    assert errors["expert/expert"] == pytest.approx(errors["tile/tile"], rel=1e-12, abs=0)
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
