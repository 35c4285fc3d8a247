"""Host time of one forward+backward step with every kernel launch stubbed out: what megamoe's Python
costs around its kernels (validation, plan, autograd, launch preparation, allocations), which bounds
small batches on the GPU (docs/NOTES.md §7, §13). Any machine, no GPU:

    TRITON_INTERPRET=1 python -m megamoe.bench.host [--tokens 1024] [--reps 5]

The eager path (``megamoe.moe``, an autograd.Function) and the custom ops that ``torch.compile`` sees
are timed alternately in one process. Triton's own launcher on a GPU is not included (the interpreter
replaces it), so the figures are the part of the host time that megamoe's code controls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def step_time_us(fn, problem, steps: int) -> float:
    from megamoe.bench.layer import training_step

    _, step = training_step(fn, problem)
    for _ in range(steps // 10):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return 1e6 * (time.perf_counter() - start) / steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m megamoe.bench.host", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200, help="timed steps per repetition")
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions of both paths")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1: the launches are stubbed out through the interpreter")
    import triton.runtime.interpreter

    import megamoe
    from megamoe import autograd
    from megamoe.bench.layer import make_problem

    # The 30B layer's expert count and top-k (the host work depends on them, not on D and I).
    problem = make_problem(args.tokens, 256, 128, 128, 8, "random", torch.float32, "cpu", 0)

    def custom_ops(x, idx, w, w13, w2):
        return autograd._experts_fwd(x, idx, w, w13, w2, *autograd._plan_op(idx, w13.shape[0]))

    paths = {"eager (megamoe.moe)": megamoe.moe, "custom ops (torch.compile's)": custom_ops}
    times = {name: [] for name in paths}
    interpreted = triton.runtime.interpreter.InterpretedFunction
    run = interpreted.run
    interpreted.run = lambda self, *a, **k: None  # no kernel runs
    try:
        for _ in range(args.reps):
            for name, fn in paths.items():
                times[name].append(step_time_us(fn, problem, args.steps))
    finally:
        interpreted.run = run
    print(f"host time per forward+backward step, kernels stubbed, T={args.tokens}, E=128, K=8:")
    for name, ts in times.items():
        print(f"  {name:30s} median {statistics.median(ts):6.0f} us  ({', '.join(f'{t:.0f}' for t in ts)})")


if __name__ == "__main__":
    main()
