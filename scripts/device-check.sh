#!/usr/bin/env bash
# One call of the lent GPU machine (the `device` tool's `run`), from the repository root:
#   bash scripts/device-check.sh tests   GPU tests, then the loopback tests with real spin-waits
#   bash scripts/device-check.sh bench   EP machinery (loopback, comm_sms sweep, per-kernel tables),
#                                        then the 30B layer benchmark against the baselines
# Each step runs unbuffered under a time limit that aborts with a Python stack dump (a hang shows where
# the host stopped); logs and results are packed into $OUT/device-check-<stage>.tgz after every step
# (the tool returns only a few files, and what a step finished survives the tool's 10-minute limit).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: device-check.sh tests|bench}
out=${OUT:?set OUT to the folder whose files come back}
work=$(mktemp -d)
export PYTHONPATH=.
py=(python3 -u -X faulthandler)

step() {  # step NAME SECONDS COMMAND...: run it, keep its log, print its last lines
    local name=$1 limit=$2
    shift 2
    timeout -s ABRT "$limit" "$@" > "$work/$name.log" 2>&1
    echo "exit status $?" >> "$work/$name.log"
    echo "== $name"
    tail -4 "$work/$name.log"
    tar czf "$out/device-check-$stage.tgz" -C "$work" .
}

nvidia-smi --query-gpu=name,driver_version --format=csv > "$work/gpu.txt" 2>&1
case $stage in
tests)
    step gpu-tests 380 "${py[@]}" -m pytest -m gpu -q -p no:logging
    step loopback-tests 420 "${py[@]}" -m pytest -q -p no:logging tests/test_dispatch.py
    ;;
bench)
    step loopback-bench 200 "${py[@]}" -m megamoe.bench --ep --loopback 1 --comm-sms 8,16,32 --profile --no-plot \
        --out "$work/results"
    step layer-bench 360 "${py[@]}" -m megamoe.bench --preset qwen3-30b-a3b --routing random --no-plot \
        --out "$work/results"
    ;;
*)
    echo "unknown stage $stage: tests or bench" >&2
    exit 2
    ;;
esac
