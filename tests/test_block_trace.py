"""``tools.block_trace``: the Gluon kernels' block trace read per partition (``block_phases``) and a weight gradient's
by its blocks' expert rows (``blocks_by_rows``; CPU, stamps written by hand), and ``tools.wgrad_schedule``'s
``program_blocks`` / ``layer_blocks``, the blocks' order it reads them in."""

import math

import pytest
import torch

from megamoe.kernels import gluon_sm90 as g
from tests.helpers import check_block_trace
from tools.block_trace import (
    WARPGROUPS,
    block_phases,
    blocks_by_rows,
    by_rows_table,
    row_class,
)
from tools.wgrad_schedule import (
    dealt_before_launch,
    gemms,
    layer_blocks,
    program_blocks,
)


def empty_trace(programs: int) -> torch.Tensor:
    """A block trace of ``programs`` programs with no stamp taken (-1 everywhere), shaped [program][partition][block]
    [cycles, global ns][point] (``block_trace.stamps``)."""
    return torch.full((programs, g.TRACE_PARTS.value, g.TRACE_BLOCKS.value, 2, g.TRACE_POINTS.value), -1,
                      dtype=torch.int64)


def test_block_phases_reads_a_known_trace():
    """``tools.block_trace.block_phases`` on stamps written by hand: one program, two blocks, the cycle counter at 2
    per ns; warpgroup 1 a block starting 1 us after warpgroup 0's. Then the same blocks one per program (a launch of
    fewer blocks than SMs): the same phases, but none that needs a program's next block."""
    t = empty_trace(1)
    for wg, shift in ((0, 0), (1, 1000)):  # ns
        for b, start in enumerate((0, 10_000)):
            ns = [start + shift + d for d in (0, 600, 9_000, 9_200)]  # wait 0.6 us, main 8.4, end 0.2 after it
            t[0, wg, b, 1] = torch.tensor(ns)
            t[0, wg, b, 0] = 2 * torch.tensor(ns)
    for b, start in enumerate((0, 10_000)):  # the loader's first copy 500 ns before warpgroup 0's block start
        t[0, 2, b, 1, :3] = torch.tensor([start - 700, start - 500, start + 2_000])
        t[0, 2, b, 0, :3] = 2 * t[0, 2, b, 1, :3]
    ph = block_phases(t.flatten(), 1)
    assert ph["wg0"]["wait"] == pytest.approx(0.6) and ph["wg0"]["main"] == pytest.approx(8.4)
    assert ph["wg0"]["block"] == pytest.approx(10.0) and ph["wg0"]["rest"] == pytest.approx(1.0)
    assert ph["wg0"]["lead"] == pytest.approx(0.5) and ph["wg1"]["lead"] == pytest.approx(1.5)
    assert ph["wg0"]["latency"] == pytest.approx(1.1) and ph["wg1"]["drift"] == pytest.approx(1.0)
    assert ph["wg0"]["share"] == pytest.approx(8.4 / 10.0)  # the one block with a next one
    mma = block_phases(t.flatten(), 1, {"mma": 0})  # a bf16 kernel's one MMA partition: warpgroup 0's phases
    assert list(mma) == ["mma"] and mma["mma"] == pytest.approx(ph["wg0"], nan_ok=True)
    apart = empty_trace(2)
    apart[0, :, 0], apart[1, :, 0] = t[0, :, 0], t[0, :, 1]
    one = block_phases(apart.flatten(), 2)
    for k in ("wait", "main", "lead", "latency", "drift"):
        assert one["wg0"][k] == pytest.approx(ph["wg0"][k], nan_ok=True)  # warpgroup 0 has no drift
        assert one["wg1"][k] == pytest.approx(ph["wg1"][k])
    assert all(math.isnan(one["wg0"][k]) for k in ("rest", "block", "share"))
    for trace, programs in ((t, 1), (apart, 2)):  # the GPU tests' check of a trace passes both, times made positive
        later = trace.clone()
        later[trace != -1] += 100_000
        check_block_trace(later.flatten(), programs, 2, WARPGROUPS)


def test_program_blocks_deals_as_the_kernels_do():
    """Experts of 5, 1 and 3 rows, two blocks each, over two programs: in expert order each program takes every other
    block; by size (5, 3, 1) the second full round runs from the other end (``gluon_sm90.dealt_block``)."""
    assert program_blocks([5, 1, 3], 2, False, 2) == [[5, 1, 3], [5, 1, 3]]
    assert program_blocks([5, 1, 3], 2, True, 2) == [[5, 3, 1], [5, 3, 1]]
    assert program_blocks([5, 1, 3, 2], 1, True, 3) == [[5, 1], [3], [2]]  # a partial last round as it comes
    assert program_blocks([5, 1], 1, True, 8) == [[5], [1]]  # fewer blocks than programs: one program each
    # the layer's bf16 dW2 at D = I = 256: two 128 x 256 blocks per expert, K-steps of 32 rows, the layer's order
    order = [[5, 3, 1], [5, 3, 1]] if g.WGRAD_BY_SIZE else [[5, 1, 3], [5, 1, 3]]
    assert layer_blocks("bf16 dW2", [5, 1, 3], 256, 256, 2) == (order, 32)


def test_layer_blocks_refuses_blocks_taken_in_turn(monkeypatch):
    """With the bf16 blocks taken in turn (``gluon_sm90.WGRAD_TAKEN``) no program's blocks are known before the launch:
    ``layer_blocks`` says so rather than reading a trace by a deal that did not happen; the FP8 kernel's stays."""
    monkeypatch.setattr(g, "WGRAD_TAKEN", frozenset({"dw13"}))
    assert not dealt_before_launch("bf16 dW13") and dealt_before_launch("bf16 dW2") and dealt_before_launch("FP8 dW13")
    with pytest.raises(ValueError, match="taken in turn"):
        layer_blocks("bf16 dW13", [5, 1, 3], 256, 256, 2)
    assert layer_blocks("FP8 dW2", [5, 1, 3], 256, 256, 2)[1] == 128


def test_row_classes_against_the_mean():
    assert [row_class(r, 1000.0, 32) for r in (0, 64, 65, 499, 500, 2000, 2001)] == [
        "tiny", "tiny", "small", "small", "mean", "mean", "big"]


def test_blocks_by_rows_reads_a_known_trace():
    """Two programs, the cycle counter at 2 per ns: program 0 a block of 200 rows (7 K-steps of 32; "big" against the
    mean of 93) then one of 40 (2 K-steps, "tiny"), program 1 one of 40. Each phase per class, the classes' parts of
    the programs' time, and the tail: the last program's end after the median's."""
    t = empty_trace(2)
    for prog, block, ns in ((0, 0, (0, 500, 7_500, 8_000)), (0, 1, (9_000, 9_500, 10_500, 12_500)),
                            (1, 0, (0, 1_000, 2_000, 5_000))):
        t[prog, 0, block, 1] = torch.tensor(ns)
        t[prog, 0, block, 0] = 2 * torch.tensor(ns) + 123  # a counter of its own per SM: only its differences count
    found = blocks_by_rows(t.flatten(), 2, 0, [[200, 40], [40]], 32)
    big, tiny = found["classes"]["big"], found["classes"]["tiny"]
    assert big == pytest.approx({"blocks": 1, "rows": 200, "wait": 0.5, "main": 7.0, "per step": 1.0, "rest": 1.5,
                                 "share": 9.0 / 17.5})
    assert tiny == pytest.approx({"blocks": 2, "rows": 40, "wait": 0.75, "main": 1.0, "per step": 0.5, "rest": 2.5,
                                  "share": 8.5 / 17.5})
    assert found["classes"]["small"]["blocks"] == 0 and math.isnan(found["classes"]["small"]["main"])
    assert found["mean_rows"] == pytest.approx(280 / 3)
    assert found["tail_us"] == pytest.approx(12.5 - (12.5 + 5.0) / 2) and found["traced"]
    assert found["span_us"] == pytest.approx(12.5)
    assert not blocks_by_rows(t.flatten(), 2, 0, [[200, 40], [40] * (g.TRACE_BLOCKS.value + 1)], 32)["traced"]
    empty = t.clone()  # program 1's block of an expert without rows: no K-step, so no first stage (point 1)
    empty[1, 0, 0, :, 1] = -1
    none = blocks_by_rows(empty.flatten(), 2, 0, [[200, 40], [0]], 32)
    assert none["classes"]["tiny"] == pytest.approx({"blocks": 2, "rows": 20, "wait": 0.5, "main": 1.0,
                                                     "per step": 0.5, "rest": 2.5, "share": 8.5 / 17.5})
    table = by_rows_table("dw2", found).splitlines()
    assert table[0].startswith("dw2: blocks by their experts' rows (mean 93;")
    assert table[0].endswith("span 12.5 us, tail 3.8 us")
    assert table[2].split() == ["tiny", "2", "40", "0.75", "1.00", "0.50", "2.50", f"{8.5 / 17.5:.2f}"]
    assert table[3].split()[:2] == ["small", "0"] and table[3].split()[2] == "nan"


@pytest.mark.gpu
@pytest.mark.parametrize("tool", ["kernels_trace", "fp8_trace"])
def test_trace_tools_read_the_weight_gradients_by_rows_under_a_skewed_routing(tool, tmp_path):
    """``python -m tools.kernels_trace`` / ``tools.fp8_trace`` on the 30B layer's dims at 2 048 tokens, skewed: each
    weight gradient's record holds its blocks by their experts' rows, every block once, the classes' parts summing to
    the whole; the file named after the routing."""
    import importlib
    import json

    if tool == "kernels_trace":
        args, key, name_key = ["--kernels", "dw13_alone,dw2"], "kernels", "kernel"
        out = tmp_path / "kernels-block-trace-qwen3-30b-a3b-t2048-skewed.json"
    else:
        args, key, name_key = ["--gemms", "dw13,dw2"], "results", "gemm"
        out = tmp_path / "fp8-block-trace-qwen3-30b-a3b-t2048-dw13-dw2-skewed.json"
    importlib.import_module(f"tools.{tool}").main(["--preset", "qwen3-30b-a3b", "--tokens", "2048", "--routing",
                                                   "skewed", *args, "--out", str(tmp_path)])
    record = json.loads(out.read_text())
    assert record["routing"] == "skewed" and len(record[key]) == 2
    per_expert = gemms(2048, 768)  # the 30B layer's D and I: blocks per expert of each weight gradient
    for entry in record[key]:
        found = entry["by_rows"]
        gemm = ("bf16 " if tool == "kernels_trace" else "FP8 ") + ("dW2" if entry[name_key] == "dw2" else "dW13")
        assert found["traced"] and sum(c["blocks"] for c in found["classes"].values()) == 128 * per_expert[gemm][0]
        assert sum(c["share"] for c in found["classes"].values()) == pytest.approx(1.0)
        assert 0 <= found["tail_us"] <= found["span_us"]
