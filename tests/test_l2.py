import pytest
import torch

from tools import l2


@pytest.mark.parametrize("tma", [True, False])
def test_read_probe_reads_every_block_it_counts(tma):
    """The probe's bandwidth figure is its read count times 16 KB: the sums show that every one of
    those reads happened, with blocks revisited round-robin (reads > blocks) and split over programs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    blocks, reads, programs = 5, 13, 3
    # Small integers: exact in bf16 and in any fp32 summation order.
    buf = torch.randint(-4, 5, (blocks * l2.ROWS, l2.COLS), device=device).to(torch.bfloat16)
    sums = l2.read_sum(buf, reads, programs, tma)
    per_block = buf.float().view(blocks, -1).sum(dim=1)
    want = torch.stack([sum(per_block[i % blocks] for i in range(p, reads, programs)) for p in range(programs)])
    torch.testing.assert_close(sums, want, rtol=0, atol=0)
