import os

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter; Triton reads this when a kernel is defined,
# so it must be set before megamoe is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests run each kernel's fixed default config (fast, one known config); test_kernels.py has one
# GPU test with autotuning on.
os.environ["MEGAMOE_AUTOTUNE"] = "0"

# tests.helpers imports megamoe: after the settings above
from tests.helpers import speed_up_the_interpreter

speed_up_the_interpreter()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poison_cuda():
    """NaN where the test's buffers will come from, so that a row nobody wrote shows up: the blocks the caching
    allocator kept from earlier tests (which may hold their correct values) go back to the device first, then half of
    the free memory is filled with NaN and left cached, so that the test's allocations over 1 MB (the allocator's
    large pool) are carved from it. Smaller ones come from fresh small-pool segments, not poisoned."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    try:
        blob = torch.empty(int(free * 0.5) // 4, dtype=torch.float32, device="cuda")
        blob.fill_(float("nan"))
        del blob
    except torch.OutOfMemoryError:
        pass
    torch.cuda.synchronize()
    yield


_EMPTY, _EMPTY_LIKE = torch.empty, torch.empty_like


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype in (torch.int32, torch.int64):
        t.fill_(-123456)
    return t


@pytest.fixture(autouse=True)
def poison_cpu_empty(monkeypatch):
    """CPU counterpart of ``poison_cuda``: every ``torch.empty``/``empty_like`` during a test starts as NaN
    (floats) or a large negative number (ints), so an element a kernel reads but nobody wrote shows in
    the result (or as an out-of-bounds index in the interpreter) instead of reading leftover zeros."""
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poisoned(_EMPTY(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poisoned(_EMPTY_LIKE(*a, **k)))
