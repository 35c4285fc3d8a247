"""``tools.power``'s timing loop, on stand-ins for torch.cuda and time.sleep that log what happens in which order:
after a gap each call waits for the device, the host sleeps, a spin kernel is queued, and only the call sits between
its two events; back to back (gap 0) nothing syncs until the end. Each call starts with the gradients cleared."""

import argparse
import json

import pytest
import torch

from tools import power


class FakeCuda:
    """Logs synchronize, _sleep and event records; an event pair's elapsed time is the number of log entries
    between them (so a call that logs one entry takes 2 "ms": its start record, itself, its end record)."""

    def __init__(self):
        self.log = []
        cuda = self

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing
                self.at = None

            def record(self):
                self.at = len(cuda.log)
                cuda.log.append("record")

            def elapsed_time(self, end):
                return float(end.at - self.at)

        self.Event = Event

    def synchronize(self):
        self.log.append("sync")

    def _sleep(self, cycles):
        self.log.append(f"spin {cycles}")


@pytest.mark.parametrize("gap_ms", [0.0, 5.0])
def test_only_the_call_is_timed_and_the_gap_comes_before_it(gap_ms):
    cuda, slept = FakeCuda(), []
    leaf = torch.zeros(2, requires_grad=True)
    grads_seen = []

    def fn():
        grads_seen.append(leaf.grad)
        leaf.grad = torch.ones(2)  # what a backward leaves
        cuda.log.append("call")

    ms = power.timed_calls(fn, [leaf], gap_ms, 3, cuda=cuda, sleep=slept.append)
    assert ms == [2.0, 2.0, 2.0] and grads_seen == [None, None, None]
    one = ["record", "call", "record"]
    if gap_ms:
        gap = ["sync", f"spin {power.SPIN_CYCLES}"]
        assert cuda.log == (gap + one) * 3 + ["sync"] and slept == [0.005] * 3
    else:
        assert cuda.log == one * 3 + ["sync"] and slept == []


def test_bad_gaps_and_counts_are_refused():
    with pytest.raises(ValueError, match="at least 0 ms and at least one call"):
        power.timed_calls(lambda: None, [], -1.0, 3, cuda=FakeCuda())
    with pytest.raises(ValueError, match="at least one call"):
        power.timed_calls(lambda: None, [], 0.0, 0, cuda=FakeCuda())
    assert power.gaps_of("0, 2,10") == [0.0, 2.0, 10.0]
    for bad in ("", "1,-2", "a"):
        with pytest.raises(argparse.ArgumentTypeError, match="--gaps-ms takes"):
            power.gaps_of(bad)


def test_without_a_gpu_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs|CUDA GPU"):
        power.main([])


def test_routing_from_counts_gives_each_expert_its_rows_and_no_token_an_expert_twice():
    """Counts as a young router leaves them: one expert on every token, some on none, the rest uneven."""
    num_tokens, top_k, num_experts = 64, 4, 16
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(num_experts, dtype=torch.int64)
    counts[3] = num_tokens  # every token
    counts[[0, 7]] = 0
    rest = [e for e in range(num_experts) if e not in (0, 3, 7)]
    share = torch.multinomial(torch.linspace(1, 5, len(rest)), num_tokens * (top_k - 1), replacement=True,
                              generator=gen)
    counts[rest] = torch.bincount(share, minlength=len(rest))
    assert counts.sum() == num_tokens * top_k and counts.max() == num_tokens
    idx, weights = power.routing_from_counts(counts.tolist(), num_tokens, top_k, "cpu", gen)
    assert idx.shape == (num_tokens, top_k) and idx.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(torch.bincount(idx.flatten(), minlength=num_experts), counts)
    assert all(len(set(row)) == top_k for row in idx.tolist())
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(num_tokens))
    assert not torch.equal(idx[:, 0], torch.sort(idx[:, 0]).values), "the tokens are shuffled"
    for bad in (counts[:-1].tolist() + [counts[-1].item() + 1],  # one row too many
                [num_tokens + 1] + [0] * (num_experts - 1)):  # more rows than tokens on one expert
        with pytest.raises(ValueError, match="counts must be one per expert"):
            power.routing_from_counts(bad, num_tokens, top_k, "cpu", gen)


def test_counts_come_from_a_training_log_at_the_median_layer_by_default(tmp_path):
    log = tmp_path / "log.json"
    layers = [[4, 4, 4, 4], [16, 0, 0, 0], [8, 4, 2, 2]]  # loads 1, 4 and 2: the median is layer 2's
    log.write_text(json.dumps({"expert_counts": layers}))
    assert power.counts_of(str(log)) == (f"{log}:2", 2, [8, 4, 2, 2])
    assert power.counts_of(f"{log}:1") == (f"{log}:1", 1, [16, 0, 0, 0])
    with pytest.raises(argparse.ArgumentTypeError, match="has layers 0 to 2"):
        power.counts_of(f"{log}:3")
    log.write_text(json.dumps({"expert_load": [[1.0]]}))
    with pytest.raises(argparse.ArgumentTypeError, match="holds no expert_counts"):
        power.counts_of(str(log))
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read"):
        power.counts_of(str(tmp_path / "missing.json"))
