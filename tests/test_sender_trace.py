"""The EP senders' trace tool (tools.sender_trace): its summary of a call's stamps, on stamps made
up here (the stamps themselves need GPUs)."""

import pytest
import torch

from megamoe.parallel import trace
from tools.sender_trace import PHASES, summarize

HEAD, PER_BLOCK, PER_TILE = trace.TRACE_HEAD.value, trace.TRACE_PER_BLOCK.value, trace.TRACE_PER_TILE.value
STRIDE = trace.TRACE_STRIDE.value


def made_up_stamps():
    """Two senders (the second with one block, the first with two) and four tile programs (three busy, one
    idle) of five launched, times in ns from 1e6."""
    stamps = torch.full((2 * STRIDE + PER_TILE * 5,), -1, dtype=torch.int64)
    t0 = 1_000_000
    sender0 = [t0, t0 + 2000, t0 + 40_000]
    blocks0 = [[t0 + 3000, t0 + 8000, t0 + 9000, t0 + 12_000], [t0 + 14_000, t0 + 20_000, t0 + 21_000, t0 + 25_000]]
    sender1 = [t0 + 500, t0 + 3000, t0 + 30_000]
    blocks1 = [[t0 + 4000, t0 + 6000, t0 + 7000, t0 + 11_000]]
    for prog, (head, blocks) in enumerate(((sender0, blocks0), (sender1, blocks1))):
        base = prog * STRIDE
        stamps[base:base + HEAD] = torch.tensor(head)
        for j, block in enumerate(blocks):
            at = base + HEAD + j * PER_BLOCK
            stamps[at:at + PER_BLOCK] = torch.tensor(block)
    tiles = [[t0 + 1000, t0 + 5000, t0 + 26_000], [t0 + 1500, t0 + 30_000, t0 + 50_000],
             [t0 + 2000, -1, t0 + 3000], [t0 + 2500, t0 + 2500, t0 + 10_000]]  # the 5th program did not run
    stamps[2 * STRIDE:2 * STRIDE + PER_TILE * 4] = torch.tensor(tiles).flatten()
    return stamps


def test_summary_of_made_up_stamps():
    f = summarize(made_up_stamps(), senders=2, stride=STRIDE, head=HEAD, per_block=PER_BLOCK, per_tile=PER_TILE)
    assert f["senders"] == 2 and f["blocks_traced"] == 3
    assert f["counts_in_us"] == {"median": 2.5, "max": 3.0}
    assert f["senders_done_us"] == {"min": 30.0, "median": 35.0, "max": 40.0}
    phases = f["block_phase_us"]
    assert list(phases) == list(PHASES)
    assert phases["rows and copies"]["mean"] == pytest.approx((5 + 6 + 2) / 3)
    assert phases["store metadata"]["median"] == pytest.approx(1.0)
    assert phases["barrier + release"]["total_sm_ms"] == pytest.approx((3 + 4 + 4) / 1e3)
    assert phases["overflow + next entries"] == {"median": 2.0, "mean": 2.0, "total_sm_ms": 0.002}  # sender 0 only
    assert f["block_us_by_round"] == [8.0, 11.0]  # round 0: 9 and 7 µs; round 1: sender 0's 11 µs
    assert f["released_us_by_round"] == [11.5, 25.0]  # round 0 released at 12 and 11 µs; round 1 at 25
    assert f["tiles_busy"] == 3 and f["tiles_idle"] == 1
    assert f["tiles_first_start_us"] == 1.0 and f["tiles_last_end_us"] == 50.0
    assert f["tile_wait_us"]["median"] == pytest.approx(4.0) and f["tile_wait_us"]["total_sm_ms"] == pytest.approx(0.0325)
    assert f["tile_work_us"]["median"] == pytest.approx(20.0) and f["tile_work_us"]["total_sm_ms"] == pytest.approx(0.0485)
    assert f["rows_in_us_by_eighth"] == [5.0, 30.0, 2.5] and f["wait_us_by_eighth"] == [4.0, 28.5, 0.0]


def test_refuses_what_it_cannot_trace(capsys):
    from tools.sender_trace import main

    with pytest.raises(SystemExit):
        main(["--comm-sms", "0"])
    assert "--comm-sms must be at least 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs GPUs"):
            main([])
