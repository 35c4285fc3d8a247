"""Read bandwidth of the GPU's L2 (and, past its size, of HBM): the rate at which the GEMM kernels could
pull operand tiles into the SMs (docs/FACTS.md).

``python -m tools.l2 [--json PATH]`` on a GPU (with ``--json``, the plot goes next to it as PNG). A persistent kernel (``--per-sm`` programs per SM)
reads 16 KB blocks of a bf16 buffer round-robin, many times over, and adds them up; the footprint sweeps
from a few MB (L2-resident) to 1 GB (HBM). Two load paths, as the GEMMs use them: TMA into shared
memory (the sorted-row and weight operands) and pointer loads into registers (the up kernel's gathered
x rows). Every program writes its sum, so nothing read is dead code; ``read_sum`` checks it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.provenance import gpu_record, utc_now

ROWS, COLS = 128, 64  # one block: 16 KB of bf16, a GEMM operand tile's size


@triton.jit
def _read_blocks_kernel(src, src_desc, sums_ptr, num_blocks, reads, TMA: tl.constexpr, BR: tl.constexpr,
                        BC: tl.constexpr):
    """Program p reads blocks p, p + P, p + 2P, ... (mod ``num_blocks``) until ``reads`` block reads are
    shared out, and writes the fp32 sum of everything it read to ``sums[p]``."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, BR)[:, None] * BC + tl.arange(0, BC)[None, :]
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    for i in range(pid, reads, programs):
        b = i % num_blocks
        if TMA:
            block = src_desc.load([b * BR, 0])
        else:
            block = tl.load(src + b.to(tl.int64) * (BR * BC) + offs)
        acc += block.to(tl.float32)
    tl.store(sums_ptr + pid, tl.sum(acc))


def read_sum(buf: torch.Tensor, reads: int, programs: int, tma: bool, num_warps: int = 4,
             num_stages: int = 4) -> torch.Tensor:
    """Per-program sums of ``reads`` block reads of ``buf`` ((blocks * ROWS, COLS), bf16 or fp32)."""
    assert buf.shape[1] == COLS and buf.shape[0] % ROWS == 0
    sums = torch.empty(programs, device=buf.device, dtype=torch.float32)
    desc = TensorDescriptor.from_tensor(buf, [ROWS, COLS])
    _read_blocks_kernel[(programs,)](buf, desc, sums, buf.shape[0] // ROWS, reads, TMA=tma, BR=ROWS, BC=COLS,
                                     num_warps=num_warps, num_stages=num_stages)
    return sums


def plot(info: dict, path: Path) -> None:
    """TB/s against footprint, one line per (load path, programs per SM), titled by GPU, versions and date."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key in sorted({(r["path"], r["programs_per_sm"]) for r in info["rows"]}):
        pts = [(r["footprint_mb"], r["tb_per_s"]) for r in info["rows"] if (r["path"], r["programs_per_sm"]) == key]
        ax.plot(*zip(*pts), marker="o", label=f"{key[0]}, {key[1]} per SM")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("footprint (MB)")
    ax.set_ylabel("read TB/s")
    ax.set_title(f"read bandwidth by footprint — {info['gpu']}\ntorch {info['torch']}, triton {info['triton']}, "
                 f"{info['date'][:10]}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(prog="python -m tools.l2", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--per-sm", default="1,2,4", help="programs per SM to try (comma-separated)")
    p.add_argument("--json", help="write the table as JSON to this path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the L2 benchmark needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block_bytes = ROWS * COLS * 2
    rows = []
    for mb in (4, 8, 16, 24, 32, 48, 64, 1024):
        blocks = mb * 2**20 // block_bytes
        buf = torch.randn(blocks * ROWS, COLS, device="cuda", dtype=torch.bfloat16)
        reads = max(blocks, 4 * 2**30 // block_bytes)  # 4 GB read per launch, at least the whole buffer
        for per_sm in (int(v) for v in args.per_sm.split(",")):
            for tma in (True, False):
                started = utc_now()
                ms = do_bench(functools.partial(read_sum, buf, reads, sms * per_sm, tma), warmup=10, rep=100,
                              return_mode="median")
                row = {"footprint_mb": mb, "programs_per_sm": per_sm, "path": "tma" if tma else "pointer",
                       "ms": ms, "tb_per_s": reads * block_bytes / ms / 1e9, "timed_utc": [started, utc_now()]}
                rows.append(row)
                print(f"{mb:5d} MB  {per_sm} per SM  {row['path']:7s}  {ms:7.3f} ms  {row['tb_per_s']:5.2f} TB/s",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            **gpu_record("python -m tools.l2 " + " ".join(sys.argv[1:] if argv is None else argv)),
            "block_bytes": block_bytes, "rows": rows}, indent=1) + "\n")
        plot(json.loads(Path(args.json).read_text()), Path(args.json).with_suffix(".png"))


if __name__ == "__main__":
    main()
