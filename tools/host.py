"""Host time of one forward+backward step: what the Python around the kernels costs (validation,
plan, autograd, launch preparation, allocations), which bounds small batches on the GPU (docs/FACTS.md,
docs/PERFORMANCE.md). Two modes:

    TRITON_INTERPRET=1 python -m tools.host [--tokens 1024] [--reps 5]   # any machine, no GPU
    python -m tools.host --gpu [--tokens 1024] [--cprofile 30] [--stages]  # a CUDA GPU

With the interpreter every kernel launch is stubbed out, so the figures are the part of the host time
that megamoe's code controls (Triton's launcher is not included). With ``--gpu`` the 30B layer's
kernels really launch: the host time per step is the wall time of enqueueing steps while the GPU
keeps up (so at small batches it is the step's wall time), Triton's launcher included. The eager path
(``megamoe.moe``, an autograd.Function) and the custom ops that ``torch.compile`` sees are timed
alternately in one process. ``--cprofile N`` also lists the N functions with the most own time over
the eager path's steps (cProfile's overhead inflates them; compare them with each other). ``--stages``
also lists the host time of each stage of ``tools.kernels`` alone (the Python that enqueues its
kernels, no sync), beside that of a one-argument Triton kernel and of a ``torch.add``: which launches
cost the host most.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import triton

from megamoe.arguments import HelpFormatter, positive_int


def step_time_us(fn, problem, steps: int) -> float:
    from megamoe.bench.common import training_step

    _, step = training_step(fn, problem)
    sync = torch.cuda.synchronize if problem[0].is_cuda else (lambda: None)
    for _ in range(steps // 10):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return 1e6 * (time.perf_counter() - start) / steps


def cprofile_table(fn, problem, steps: int, top: int) -> str:
    """cProfile's listing of the ``top`` functions by own time over ``steps`` steps of ``fn``."""
    import cProfile
    import io
    import pstats

    from megamoe.bench.common import training_step

    _, step = training_step(fn, problem)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


@triton.jit
def _noop_kernel(ptr):
    pass


def enqueue_us(fn, calls: int = 200) -> float:
    """Host time of one call of ``fn`` in µs: the wall time of ``calls`` calls without a sync, over the
    count (fewer calls than the launch queue holds, so the host never waits for the GPU)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def stage_table(problem) -> str:
    """Host µs per call of every per-kernel stage (``tools.kernels.stages``) and of two references."""
    from tools.kernels import stages

    x = problem[0]
    one = torch.zeros(1, device=x.device)
    rows = [("triton kernel, one pointer", lambda: _noop_kernel[(1,)](one)), ("torch.add", lambda: one + one)]
    rows += [(name, fn) for name, (fn, _, _) in stages(problem, problem[3].shape[0]).items()]
    return "".join(f"  {name:30s} {enqueue_us(fn):7.1f} us\n" for name, fn in rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.host", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per step (T), the 30B layer")
    p.add_argument("--steps", type=positive_int, default=200, help="timed steps per repetition")
    p.add_argument("--reps", type=positive_int, default=5, help="alternating repetitions of both paths")
    p.add_argument("--gpu", action="store_true", help="launch the kernels on the CUDA GPU instead of stubbing them")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also list the N functions with the most own time (cProfile) over the eager path's steps")
    p.add_argument("--stages", action="store_true", help="with --gpu: also the host time of each stage's launch")
    args = p.parse_args(argv)
    if args.gpu == (os.environ.get("TRITON_INTERPRET") == "1"):
        raise SystemExit("either --gpu (a CUDA GPU, kernels launch) or TRITON_INTERPRET=1 (launches stubbed out)")
    import triton.runtime.interpreter

    import megamoe
    from megamoe import autograd
    from megamoe.bench.common import make_problem
    from megamoe.kernels.plan import plan_op

    if args.gpu:  # the 30B layer, bf16; its first step autotunes
        problem = make_problem(args.tokens, 2048, 768, 128, 8, "random", torch.bfloat16, "cuda", 0)
    else:  # the 30B layer's expert count and top-k (the host work depends on them, not on D and I)
        problem = make_problem(args.tokens, 256, 128, 128, 8, "random", torch.float32, "cpu", 0)

    def custom_ops(x, idx, w, w13, w2):
        return autograd._experts_fwd(x, idx, w, w13, w2, *plan_op(idx, w13.shape[0]))

    paths = {"eager (megamoe.moe)": megamoe.moe, "custom ops (torch.compile's)": custom_ops}
    times = {name: [] for name in paths}
    interpreted = triton.runtime.interpreter.InterpretedFunction
    run = interpreted.run
    if not args.gpu:
        interpreted.run = lambda self, *a, **k: None  # no kernel runs
    try:
        for _ in range(args.reps):
            for name, fn in paths.items():
                times[name].append(step_time_us(fn, problem, args.steps))
        table = cprofile_table(megamoe.moe, problem, args.steps, args.cprofile) if args.cprofile else ""
        if args.stages and args.gpu:
            table += "host time per call of each stage (enqueue only):\n" + stage_table(problem)
    finally:
        interpreted.run = run
    mode = f"kernels on {torch.cuda.get_device_name()}" if args.gpu else "kernels stubbed"
    print(f"host time per forward+backward step, {mode}, T={args.tokens}, E=128, K=8:")
    for name, ts in times.items():
        print(f"  {name:30s} median {statistics.median(ts):6.0f} us  ({', '.join(f'{t:.0f}' for t in ts)})")
    print(table, end="")


if __name__ == "__main__":
    main()
