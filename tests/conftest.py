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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poison_cuda():
    """Fill the caching allocator's free memory with NaN so a row nobody wrote shows up."""
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    try:
        blob = torch.empty(int(free * 0.5) // 4, dtype=torch.float32, device="cuda")
        blob.fill_(float("nan"))
        del blob
    except torch.OutOfMemoryError:
        pass
    # Also poison blocks the allocator already caches.
    torch.cuda.synchronize()
    yield
