"""``megamoe.profiling.summarise``: each device event counted in the part of the step whose host range launched it
(through the launch's correlation id), per step, with the device's idle time before it and, apart, the time of those
that megamoe's custom ops launched."""

import json

from megamoe.profiling import PHASES, summarise


def annotation(part, begin, end):
    return {"cat": "user_annotation", "name": f"megamoe.train/{part}", "ts": begin, "dur": end - begin}


def launch(correlation, ts, tid=1):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
            "args": {"correlation": correlation}}


def op(name, begin, end, tid=1):
    return {"cat": "cpu_op", "name": name, "ts": begin, "dur": end - begin, "tid": tid}


def kernel(name, correlation, ts, dur, cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def test_device_time_goes_to_the_part_that_launched_it():
    """Two steps (trace times in microseconds): a GEMM launched twice a step in the passes, the second time by a
    megamoe op (the custom op, then the eager path's autograd Function), a scaling kernel in the clipping (launched by
    another thread while a megamoe op ran on the first: not the op's), an AdamW kernel and a memset in the optimizer
    step, and one kernel launched outside every range."""
    events = []
    for step, t0 in enumerate((0, 1000)):
        events += [annotation("passes", t0, t0 + 100), annotation("clip", t0 + 100, t0 + 130),
                   annotation("optimizer", t0 + 130, t0 + 200)]
        forward = "megamoe::experts_fwd" if step == 0 else "_FusedMoE"  # compiled, then eager
        events += [op(forward, t0 + 45, t0 + 55), op("aten::mm", t0 + 5, t0 + 15),
                   op("megamoe::experts_bwd", t0 + 105, t0 + 115)]
        c = 10 * step
        events += [launch(c + 1, t0 + 10), kernel("gemm", c + 1, t0 + 20, 50),
                   launch(c + 2, t0 + 50), kernel("gemm", c + 2, t0 + 75, 20),  # 5 us idle after the first
                   launch(c + 3, t0 + 110, tid=2), kernel("scale", c + 3, t0 + 120, 10),  # 25 us idle
                   launch(c + 4, t0 + 150), kernel("adamw", c + 4, t0 + 160, 30),  # 30 us idle
                   launch(c + 5, t0 + 160), kernel("Memset", c + 5, t0 + 190, 4, cat="gpu_memset")]
    events += [launch(99, 1500), kernel("eval", 99, 1600, 8)]  # after both steps' ranges: "other"
    out = summarise({"traceEvents": events}, steps=2)

    ms = 1e-3 / 2  # microseconds over two steps, in milliseconds per step
    # idle before the passes' kernels: 5 us in each step, and the 826 between step 1's memset and step 2's GEMM
    assert out["phases"]["passes"] == {"host_ms": 200 * ms, "device_ms": 140 * ms, "idle_ms": 836 * ms,
                                       "megamoe_ms": 40 * ms}
    assert out["phases"]["clip"] == {"host_ms": 60 * ms, "device_ms": 20 * ms, "idle_ms": 50 * ms, "megamoe_ms": 0}
    assert out["phases"]["optimizer"] == {"host_ms": 140 * ms, "device_ms": 68 * ms, "idle_ms": 60 * ms,
                                          "megamoe_ms": 0}
    assert out["phases"]["other"] == {"host_ms": 0, "device_ms": 8 * ms, "idle_ms": 406 * ms, "megamoe_ms": 0}
    assert list(out["phases"]) == [*PHASES, "other"]
    table = [(k["name"], k["part"], k["ms"], k["launches"]) for k in out["kernels"]]
    assert table == [("gemm", "passes", 140 * ms, 2), ("adamw", "optimizer", 60 * ms, 1), ("scale", "clip", 20 * ms, 1),
                     ("Memset", "optimizer", 8 * ms, 1), ("eval", "other", 8 * ms, 0.5)]


def test_compare_puts_the_profiles_side_by_side(tmp_path, capsys):
    """Each part's device and idle time per profile, then the kernels by their largest time, each profile's time
    in its column (0 where a profile lacks the kernel); the command line reads the files."""
    from megamoe import profiling

    def profile(gemm_ms, quant_ms):
        kernels = [{"name": "gemm", "part": "passes", "ms": gemm_ms, "launches": 2}]
        if quant_ms:
            kernels.append({"name": "quantize_weight", "part": "passes", "ms": quant_ms, "launches": 1})
        phases = {part: {"host_ms": 1.0, "device_ms": 0.0, "idle_ms": 0.0, "megamoe_ms": 0.0}
                  for part in (*PHASES, "other")}
        phases["passes"]["device_ms"] = gemm_ms + quant_ms
        phases["passes"]["megamoe_ms"] = quant_ms
        return {"phases": phases, "kernels": kernels}

    bf16, fp8 = profile(9.0, 0.0), profile(7.0, 1.5)
    lines = profiling.compare([bf16, fp8], ["bf16", "fp8"]).splitlines()
    assert lines[1].split() == ["passes", "9.00", "/", "0.00", "8.50", "/", "0.00"]
    assert lines[5].split()[:3] == ["passes", "0.00", "1.50"] and "megamoe's ops" in lines[5]
    assert lines[9].split() == ["gemm", "(passes)", "9.000", "7.000"]
    assert lines[10].split() == ["quantize_weight", "(passes)", "0.000", "1.500"]
    for part in PHASES:  # a profile recorded before megamoe_ms: its cells left blank
        del bf16["phases"][part]["megamoe_ms"]
    assert profiling.compare([bf16, fp8], ["bf16", "fp8"]).splitlines()[5].split()[:2] == ["passes", "1.50"]
    for name, run in (("bf16", bf16), ("fp8", fp8)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "profile.json").write_text(json.dumps(run))
    profiling.main([str(tmp_path / "bf16" / "profile.json"), str(tmp_path / "fp8" / "profile.json"), "--top", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[1:3] == ["bf16", "fp8"] and len(out) == 10 and out[-1].split()[0] == "gemm"


def test_the_eager_names_are_the_autograd_functions():
    """The profile tells megamoe's eager kernels by its autograd Functions' names: the classes'."""
    from megamoe import profiling
    from megamoe.autograd import _FusedMoE
    from megamoe.parallel.fused import FusedEP

    assert profiling.EAGER_FUNCTIONS == (_FusedMoE.__name__, FusedEP.__name__)
