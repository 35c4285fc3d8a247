"""``tools.wgrad_schedule``: the model of the weight-gradient kernels' blocks dealt to their programs (CPU)."""

import pytest

from tools.wgrad_schedule import PROGRAMS, expert_rows, main, makespan, makespan_dynamic


def test_dealing_by_size_evens_out_the_skewed_routing():
    """The layer benchmark's skewed routing at the 30B layer, FP8 dW2's 48 blocks of 128 x 256 per expert: in expert
    order the big experts' long blocks pile onto a few programs (the launch ~1.5x the balanced time); dealt by size
    (most rows first, full rounds from alternate ends) within a few percent of it. One expert far longer than the rest
    is beyond either static order (each program runs its share of the blocks, whatever they cost), not a dynamic
    scheduler's."""
    rows = expert_rows("skewed", 16384, 128, 8)
    assert makespan(rows, 48, 128, 1.0, False) > 1.4
    assert makespan(rows, 48, 128, 1.0, True) < 1.05
    one_long = [128] * 127 + [2048]
    assert makespan(one_long, 96, 128, 0.0, True) == pytest.approx(makespan(one_long, 96, 128, 0.0, False))
    assert makespan_dynamic(one_long, 96, 128, 0.0) < 1.01  # a dynamic scheduler would take it


@pytest.mark.parametrize("experts", [1, 17, 132, 300])
def test_dealing_takes_every_block_once(experts):
    """Blocks of one cost, in full rounds dealt from alternate ends and a partial last round: each program runs its
    share, ceil(blocks / programs) at most."""
    blocks = 3 * experts
    programs = min(PROGRAMS, blocks)
    for by_size in (False, True):
        share = -(-blocks // programs) * programs / blocks
        assert makespan([128] * experts, 3, 128, 0.0, by_size) == pytest.approx(share)


def test_prints_each_routing_and_gemm(capsys):
    main(["--preset", "qwen3-30b-a3b", "--routing", "random,skewed"])
    lines = capsys.readouterr().out.splitlines()[2:]
    assert len(lines) == 2 * 4 and all(len(line.split()) == 7 for line in lines)
