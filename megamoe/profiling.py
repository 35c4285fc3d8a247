"""Where a training step's device time goes, kernel by kernel: ``python -m megamoe.train --profile A-B``; and
``python -m megamoe.profiling A.json B.json ...`` to read such profiles side by side (:func:`compare`).

:class:`StepProfiler` runs ``torch.profiler`` over the training steps A to B (counted from 1, as the log counts
them) and marks each step's three parts (:data:`PHASES`) as host ranges; :func:`summarise` reads the profiler's
trace back: every device kernel, memcpy and memset is put in the part whose host range launched it (through the
launch's correlation id), and summed by name. The result (``profile.json`` beside the run's ``log.json``): per part,
the host's and the device's milliseconds per step, the device's idle time before that part's kernels, and the device
time of the kernels that megamoe launched (inside its custom ops ``megamoe::*`` or, eager, its autograd Functions:
the experts' forward and backward); per kernel name, its part, milliseconds and launches per step, longest first.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import tempfile

import torch

PHASES = ("passes", "clip", "optimizer")  # a training step's parts, in order (megamoe.train's step_ms split)
_RANGE = "megamoe.train/"  # the host ranges' name prefix
_OPS = "megamoe::"  # megamoe's custom ops, as the profiler names them (torch.library): the compiled path
# the autograd Functions of the eager path (the profiler names a forward by its class, a backward by its node)
EAGER_FUNCTIONS = ("_FusedMoE", "FusedEP")
_EAGER = {*EAGER_FUNCTIONS, *(f"{name}Backward" for name in EAGER_FUNCTIONS)}
_DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCHES = ("cuda_runtime", "cuda_driver")


class StepProfiler:
    """``torch.profiler`` over training steps ``first`` to ``last`` (counted from 1), or nothing when ``steps`` is
    None. Call :meth:`begin` before each step (the loop's index, from 0) and :meth:`end` after it; wrap each part of
    the step in :meth:`phase`. After the last profiled step, :attr:`summary` holds :func:`summarise`'s result."""

    def __init__(self, steps: tuple[int, int] | None, cuda: bool):  # (``arguments.step_range``'s)
        self.first, self.last = steps or (0, -1)
        self.cuda = cuda
        self.summary: dict | None = None
        self._profiler = None

    def begin(self, step: int) -> None:
        if step + 1 == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()  # the profiled steps alone: none of the earlier steps' kernels
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()

    def end(self, step: int) -> None:
        if self._profiler is None or step + 1 != self.last:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self._profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            self._profiler.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        self._profiler = None
        self.summary = {"steps": [self.first, self.last], **summarise(trace, self.last - self.first + 1)}

    def phase(self, name: str):
        """A host range for the part ``name`` of :data:`PHASES` while profiling (else nothing)."""
        if self._profiler is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(_RANGE + name)


def summarise(trace: dict, steps: int) -> dict:
    """A ``torch.profiler`` chrome trace of ``steps`` training steps, per step: ``phases`` (each part's host
    milliseconds, its device events' busy milliseconds, the device's idle milliseconds before them, from the end of
    the previous event, and ``megamoe_ms``, the busy milliseconds of the events launched inside a megamoe custom op
    or autograd Function on the launching thread) and ``kernels`` (name, part, ms and launches per step; longest
    first). A device event launched outside the parts' ranges counts under ``"other"``."""
    events = trace["traceEvents"]
    ranges = collections.defaultdict(list)
    ops = collections.defaultdict(list)  # per host thread, megamoe's custom ops' ranges
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith(_RANGE):
            ranges[e["name"][len(_RANGE):]].append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") == "cpu_op" and (e.get("name", "").startswith(_OPS) or e.get("name") in _EAGER):
            ops[e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
    launches = {e["args"]["correlation"]: (e["ts"], e.get("tid")) for e in events
                if e.get("cat") in _LAUNCHES and "correlation" in e.get("args", {})}

    def launched(event) -> tuple[str, bool]:
        """(the part whose range launched ``event``, whether a megamoe op did)"""
        ts, tid = launches.get(event.get("args", {}).get("correlation"), (None, None))
        if ts is None:
            return "other", False
        in_op = any(a <= ts <= b for a, b in ops[tid])
        for name in PHASES:
            if any(a <= ts <= b for a, b in ranges[name]):
                return name, in_op
        return "other", in_op

    device = sorted((e for e in events if e.get("cat") in _DEVICE_EVENTS), key=lambda e: e["ts"])
    busy, idle, in_ops = collections.Counter(), collections.Counter(), collections.Counter()
    kernels = collections.defaultdict(lambda: [0.0, 0])
    finished = None  # the end of the device's work so far
    for e in device:
        name, in_op = launched(e)
        busy[name] += e["dur"]
        in_ops[name] += e["dur"] if in_op else 0
        if finished is not None and e["ts"] > finished:
            idle[name] += e["ts"] - finished
        finished = max(finished or 0.0, e["ts"] + e["dur"])
        kernel = kernels[(e["name"], name)]
        kernel[0] += e["dur"]
        kernel[1] += 1
    per_step = 1e3 * steps  # trace microseconds → milliseconds per step
    phases = {name: {"host_ms": sum(b - a for a, b in ranges[name]) / per_step, "device_ms": busy[name] / per_step,
                     "idle_ms": idle[name] / per_step, "megamoe_ms": in_ops[name] / per_step}
              for name in (*PHASES, "other")}
    table = [{"name": name, "part": where, "ms": total / per_step, "launches": count / steps}
             for (name, where), (total, count) in kernels.items()]
    table.sort(key=lambda k: -k["ms"])
    return {"phases": phases, "kernels": table}


def compare(profiles: list[dict], names: list[str], top: int = 25) -> str:
    """The profiles side by side, as text: each part's device and idle milliseconds per step, and the device
    milliseconds of megamoe's ops in it (profiles from before that was recorded: blank), then the ``top`` kernels by
    their largest time in any profile (ms per step in each, the part that launched them)."""
    width = max(16, *(len(n) + 2 for n in names))
    lines = ["part        " + "".join(f"{n:>{width}}" for n in names) + "   (device ms / idle ms per step)"]
    for part in (*PHASES, "other"):
        cells = "".join(f"{p['phases'][part]['device_ms']:>{width - 8}.2f} / {p['phases'][part]['idle_ms']:5.2f}"
                        for p in profiles)
        lines.append(f"{part:12}{cells}")
    for part in PHASES:
        cells = "".join(f"{p['phases'][part]['megamoe_ms']:>{width}.2f}" if "megamoe_ms" in p["phases"][part]
                        else " " * width for p in profiles)
        lines.append(f"{part:12}{cells}   (device ms of megamoe's ops)")
    times = collections.defaultdict(lambda: [0.0] * len(profiles))
    for i, p in enumerate(profiles):
        for k in p["kernels"]:
            times[(k["name"], k["part"])][i] += k["ms"]
    lines.append("kernel (part)" + " " * 56 + "".join(f"{n:>{width}}" for n in names))
    for (name, part), ms in sorted(times.items(), key=lambda item: -max(item[1]))[:top]:
        label = f"{name[:60]} ({part})"
        lines.append(f"{label:69}" + "".join(f"{t:>{width}.3f}" for t in ms))
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m megamoe.profiling",
                                description="profile.json files of megamoe.train --profile, side by side")
    p.add_argument("profiles", nargs="+", type=Path, help="profile.json files")
    p.add_argument("--top", type=int, default=25, help="kernels to list (default 25)")
    args = p.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.profiles]
    # a run folder's profile.json goes by the folder's name, a renamed copy by its own
    names = [path.parent.name if path.name == "profile.json" else path.stem for path in args.profiles]
    print(compare(runs, names, args.top))


if __name__ == "__main__":
    main()
