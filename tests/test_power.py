"""``tools.power``'s timing loop, on stand-ins for torch.cuda and time.sleep that log what happens in which order:
after a gap each call waits for the device, the host sleeps, a spin kernel is queued, and only the call sits between
its two events; back to back (gap 0) nothing syncs until the end. Each call starts with the gradients cleared."""

import argparse

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
