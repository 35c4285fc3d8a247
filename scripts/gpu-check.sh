#!/usr/bin/env bash
# The GPU checks and benchmarks, on this machine (run from anywhere; each part fits in 10 minutes on one H200):
#   bash scripts/gpu-check.sh tests        pytest -m "gpu and not loopback": kernels, API, compile, the benchmarks' and tools' GPU paths
#   bash scripts/gpu-check.sh loopback     pytest -m loopback: the fused EP protocol on virtual ranks of this GPU
#   bash scripts/gpu-check.sh ep-waits     what the EP waits' time bound costs: the loopback step (2 virtual ranks)
#                                          with the bound and compiled without it (MEGAMOE_EP_UNBOUNDED_WAITS=1),
#                                          three rounds alternating, each process's cost over the plain layer
#   bash scripts/gpu-check.sh wgrad-order  the bf16 weight gradients' blocks dealt by size against taken in turn
#                                          (MEGAMOE_WGRAD_TAKEN none against TAKEN, default dw13,dw2: those taken in
#                                          turn), each run as the layer's stage in its own process by python -m
#                                          tools.kernels, alternating, at both layers and the routings ROUTINGS
#                                          (default "random skewed"), ROUNDS rounds (default 1; ~4 minutes a round
#                                          with both routings on one H100); then a summary, printed and written with
#                                          every process's table to wgrad-order.json
#   bash scripts/gpu-check.sh layer [P..]  the layer benchmark on the README's problems P: 30b, 235b (16k tokens,
#                                          random and skewed routing), 1k, 65k (the 30B layer); default 30b 235b
#   bash scripts/gpu-check.sh fp8 [P..]    blockwise FP8 in parts P: tests, kernels (python -m tools.fp8), 30b, 235b
#                                          (the layer beside bf16, the FP8 baseline and SonicMoE): default those four;
#                                          trace (python -m tools.fp8_trace at both layers: the sorted-rows, up
#                                          and weight-gradient kernels as the layer runs them, the sorted rows also
#                                          in 256-column blocks: where a GEMM block's time goes)
#   bash scripts/gpu-check.sh model [E..]  a transformers Qwen3-MoE model's training step (python -m megamoe.bench.model
#                                          --matrix): {no checkpointing, full} x {each layer compiled, whole model} x
#                                          experts E (default megamoe,grouped_mm and sonicmoe where it imports, one
#                                          run; several E: one run each, e.g. `model megamoe,grouped_mm sonicmoe`)
#   bash scripts/gpu-check.sh train        python -m megamoe.train: megamoe against grouped_mm experts, 300 steps each
#   bash scripts/gpu-check.sh train-fp8    python -m megamoe.train: megamoe's FP8 experts against its bf16 ones (seeds 0
#                                          and 1: the run-to-run spread), 300 steps each
#   bash scripts/gpu-check.sh train-fp8-more  FP8 from seed 1 (FP8's own spread), then FP8 and bf16 with 4 micro-batches
#                                          per optimizer step (40 steps, timed: the weights' quantisation shared)
#   bash scripts/gpu-check.sh train-step   where a 6-layer step's time goes: 20 steps each of bf16, FP8 with its weight
#                                          copies made at first use (step) and right after the optimizer step (ahead),
#                                          each with --profile over steps 16-18 (train-NAME-profile.json); then the
#                                          layer benchmark's profile of the same experts (train-step-bench/), ~9 min
#   bash scripts/gpu-check.sh power        bf16 and FP8 layers back to back and after idle gaps (tools.power), 30B and
#                                          235B: the power cap's share of each (power-PRESET.json), at 30B also on the
#                                          routing of train-step's bf16 run where its log is here, ~4 min
#   bash scripts/gpu-check.sh ep           on 2+ GPUs: the fused EP tests on real ranks, then the EP benchmark
# Logs (and the benchmark JSON/PNG) go to $GPU_CHECK_OUT (default benchmarks/out/gpu-check); copy the JSON you
# mean to publish into benchmarks/results/ and run `python -m megamoe.bench.report`. Optional baselines install
# from wheels in .whl/ without the network (Liger-Kernel: `pip download liger-kernel==0.8.5 --no-deps -d .whl`);
# SonicMoE runs beside megamoe wherever `import sonicmoe` works (its CUDA stack installed on PYTHONPATH).
# Every GPU's SM clock, power and temperature are sampled 4 times a second into clocks.csv beside the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: gpu-check.sh tests|loopback|ep-waits|wgrad-order|layer [30b|235b|1k|65k ...]|fp8 [tests|kernels|30b|235b ...]|model [EXPERTS ...]|train|train-fp8|train-fp8-more|train-step|power|ep}
shift
case $stage in  # before anything is installed or started
tests|loopback|ep-waits|wgrad-order|layer|fp8|model|train|train-fp8|train-fp8-more|train-step|power|ep) ;;
*)
    echo "unknown stage $stage: tests, loopback, ep-waits, wgrad-order, layer, fp8, model, train, train-fp8," \
        "train-fp8-more, train-step, power or ep" >&2
    exit 2
    ;;
esac
out=${GPU_CHECK_OUT:-benchmarks/out/gpu-check}
mkdir -p "$out"
PY=$(bash scripts/setup.sh)
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/megamoe-baselines .whl/*.whl \
        && export PYTHONPATH=/tmp/megamoe-baselines${PYTHONPATH:+:$PYTHONPATH}
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
py=("$PY" -u -X faulthandler)
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$gpus" -gt 0 ]; then
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 250 \
        > "$out/clocks.csv" 2>&1 &
    sampler=$!
    trap 'kill "$sampler" 2> /dev/null' EXIT
fi

step() {  # step NAME SECONDS COMMAND...: run it under a time limit (a hang dumps the host's stacks), log it
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s), started $(date -u +%FT%T)"
    timeout -s ABRT "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -n 25
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit status $rc at $(date -u +%FT%T)"
    return "$rc"
}

train_runs() {  # train_runs "NAME SECONDS ARGS..." ...: megamoe.train runs within one budget (TRAIN_BUDGET_S, default
    # 590 s), each skipped when less than its SECONDS are left; checkpoints left out (11 GB each at 2 layers); each
    # run's log.json copied to $out/train-NAME.json (and a --profile's profile.json to $out/train-NAME-profile.json)
    local deadline=$(($(date +%s) + ${TRAIN_BUDGET_S:-590})) rc=0 run name limit rest left
    local common=(--preset qwen3-30b-a3b --layers 2 --compile --no-checkpoint --quiet --eval-every 100
                  --out /tmp/megamoe-train)
    for run in "$@"; do
        read -r name limit rest <<< "$run"
        left=$((deadline - $(date +%s)))
        [ "$left" -lt "$limit" ] && { echo "== train-$name: skipped, $left s left of the stage's budget"; continue; }
        # shellcheck disable=SC2086  # $rest is the run's own argument list
        step "train-$name" "$limit" "${py[@]}" -m megamoe.train "${common[@]}" --name "$name" $rest || rc=$?
        cp /tmp/megamoe-train/"$name"/log.json "$out/train-$name.json" 2> /dev/null
        cp /tmp/megamoe-train/"$name"/profile.json "$out/train-$name-profile.json" 2> /dev/null
    done
    return "$rc"
}

case $stage in
tests)
    step gpu-tests 580 "${py[@]}" -m pytest -m "gpu and not loopback" -q -p no:cacheprovider --durations=15
    ;;
loopback)
    step loopback-tests 580 "${py[@]}" -m pytest -m loopback -q -p no:cacheprovider --durations=15
    ;;
ep-waits)
    # One process per run (the bound is compiled in or out at import); each measures the loopback step against the
    # plain one-device layer in the same process, so the runs compare by that ratio, not by raw times.
    for round in 1 2 3; do
        for unbounded in 0 1; do
            step "ep-waits-$round-$unbounded" 200 env MEGAMOE_EP_UNBOUNDED_WAITS=$unbounded "${py[@]}" -m megamoe.bench \
                --ep --loopback 2 --no-plot --out "$out/ep-waits/$round" || exit $?
        done
    done
    "$PY" - "$out/ep-waits" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
runs = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*/*.json"))]
for bounded in (True, False):
    costs = [r["machinery_cost_fwd_bwd"] for r in runs if r["bounded_waits"] is bounded]
    print(f"waits {'bounded' if bounded else 'unbounded'}: loopback fwd+bwd over the plain layer "
          + ", ".join(f"{100 * c:+.2f}%" for c in costs) + f" (median {100 * statistics.median(costs):+.2f}%)")
PYEOF
    ;;
wgrad-order)
    # One process per order (MEGAMOE_WGRAD_TAKEN is read at import), each order timed as the layer's stage; the
    # processes alternate so that a drift of the clocks meets both alike.
    for round in $(seq "${ROUNDS:-1}"); do
        for preset in qwen3-30b-a3b qwen3-235b-a22b; do
            for routing in ${ROUTINGS:-random skewed}; do
                for taken in none "${TAKEN:-dw13,dw2}"; do
                    mkdir -p "$out/wgrad-order/$round"
                    step "wgrad-order-$round-$preset-$routing-$taken" 150 env MEGAMOE_WGRAD_TAKEN=$taken "${py[@]}" \
                        -m tools.kernels --preset "$preset" --routing "$routing" \
                        --json "$out/wgrad-order/$round/$preset-$routing-$taken.json" > /dev/null || exit $?
                done
            done
        done
    done
    "$PY" - "$out/wgrad-order" <<'PYEOF'
import collections, json, statistics, sys
from pathlib import Path
runs = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*/*.json"))]
ms = collections.defaultdict(list)  # (preset, routing, stage, taken) -> ms of each round
for run in runs:
    taken = run["environment"].get("MEGAMOE_WGRAD_TAKEN") != "none"
    for row in run["stages"]:
        if row["stage"] in ("bwd dw13", "bwd dw13, combine", "bwd dw2"):
            ms[run["preset"], run["routing"], row["stage"], taken].append(row["ms"])
    for mode, total in run["total_ms"].items():
        ms[run["preset"], run["routing"], f"total ({mode})", taken].append(total)
summary = []
print("layer, routing, stage: ms with MEGAMOE_WGRAD_TAKEN=none -> TAKEN (medians of the rounds)")
for (preset, routing, stage, taken), dealt in sorted(ms.items()):
    if not taken and (preset, routing, stage, True) in ms:
        a, b = statistics.median(dealt), statistics.median(ms[preset, routing, stage, True])
        summary.append({"preset": preset, "routing": routing, "stage": stage, "by_size_ms": dealt,
                        "taken_ms": ms[preset, routing, stage, True], "by_size_median": a, "taken_median": b})
        print(f"{preset} {routing:6s} {stage:22s} {a:7.3f} -> {b:7.3f} ({100 * (b / a - 1):+.1f}%)")
path = Path(sys.argv[1]).with_suffix(".json")
path.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
print(f"wrote {path}")
PYEOF
    ;;
layer)
    liger= sonic=
    "$PY" -c "import liger_kernel" 2> /dev/null && liger=liger,  # on the 30B layer only: its autotuning outlasts the 235B
    "$PY" -c "import sonicmoe" 2> /dev/null && sonic=sonicmoe,  # at its default GEMM config (--sonicmoe-autotune)
    rc=0
    problems=("$@")
    [ "$#" -eq 0 ] && problems=(30b 235b)
    for problem in "${problems[@]}"; do
        case $problem in
        30b) args=(--preset qwen3-30b-a3b --routing random,skewed
                   --impls "grouped_mm,grouped_mm_compiled,${liger}${sonic}megamoe,megamoe_cudagraph") ;;
        235b) args=(--preset qwen3-235b-a22b --routing random,skewed
                    --impls "grouped_mm,grouped_mm_compiled,${sonic}megamoe,megamoe_cudagraph") ;;
        1k) args=(--preset qwen3-30b-a3b --tokens 1024 --impls grouped_mm,grouped_mm_compiled,megamoe,megamoe_cudagraph) ;;
        65k) args=(--preset qwen3-30b-a3b --tokens 65536 --impls grouped_mm,grouped_mm_compiled,megamoe,megamoe_cudagraph) ;;
        *) echo "unknown problem $problem: 30b, 235b, 1k or 65k" >&2; exit 2 ;;
        esac
        step "layer-$problem" 590 "${py[@]}" -m megamoe.bench "${args[@]}" --out "$out/results" || rc=$?
    done
    exit "$rc"
    ;;
fp8)
    # Blockwise FP8, in parts P (default all four, in order): tests (its GPU tests), kernels (each kernel against the
    # dense FP8 matmul, each kernel's schedule variants and both weight gradients: what decides gluon_fp8_sm90's
    # knobs and autograd.FP8_WGRAD), 30b and 235b (the layer beside bf16, the FP8 baseline and SonicMoE where it
    # imports); and, not in the default, trace (where the FP8 GEMMs' blocks spend their time, per warpgroup: tools.fp8_trace).
    sonic=
    "$PY" -c "import sonicmoe" 2> /dev/null && sonic=sonicmoe,
    parts=("$@")
    [ "$#" -eq 0 ] && parts=(tests kernels 30b 235b)
    rc=0
    for part in "${parts[@]}"; do
        case $part in
        tests) step fp8-tests 580 "${py[@]}" -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8.py \
                   tests/test_gluon_fp8.py tests/test_reference_fp8.py || rc=$? ;;
        kernels) step fp8-kernels 300 "${py[@]}" -m tools.fp8 --preset qwen3-30b-a3b --out "$out/results" || rc=$? ;;
        trace) for preset in qwen3-30b-a3b qwen3-235b-a22b; do
                   step "fp8-trace-$preset" 280 "${py[@]}" -m tools.fp8_trace --preset "$preset" --wide \
                       --gemms down,dh,dx,up,dw13,dw2 --out "$out/results" || rc=$?
               done ;;
        30b|235b) preset=$([ "$part" = 30b ] && echo qwen3-30b-a3b || echo qwen3-235b-a22b)
            step "fp8-layer-$part" 590 "${py[@]}" -m megamoe.bench --preset "$preset" --routing random,skewed \
                --impls "grouped_mm_fp8_compiled,${sonic}megamoe,megamoe_saved,megamoe_fp8,megamoe_fp8_saved" \
                --out "$out/results" || rc=$? ;;
        *) echo "unknown fp8 part $part: tests, kernels, trace, 30b or 235b" >&2; exit 2 ;;
        esac
    done
    exit "$rc"
    ;;
model)
    sonic=
    "$PY" -c "import sonicmoe" 2> /dev/null && sonic=,sonicmoe  # at QuACK's default GEMM config
    runs=("$@")
    [ "$#" -eq 0 ] && runs=("megamoe,grouped_mm$sonic")
    rc=0
    for experts in "${runs[@]}"; do  # each run writes its JSON after every cell: a run cut short keeps its cells
        step "model-30b-${experts//,/-}" 590 "${py[@]}" -m megamoe.bench.model --preset qwen3-30b-a3b --layers 2 \
            --tokens 16384 --matrix --experts "$experts" --out "$out/results" || rc=$?
    done
    exit "$rc"
    ;;
train)
    # The training runs of the README (python -m megamoe.train): 300 steps of one 16 384-token sequence with megamoe
    # and with grouped_mm (seed 0, each with its MoE share), grouped_mm from seed 1 (the baseline's run-to-run spread),
    # then four 4 096-token sequences per step, timed only, while time is left.
    train_runs "megamoe-s0 170 --experts megamoe --moe-share-steps 5" \
        "grouped_mm-s0 120 --experts grouped_mm --moe-share-steps 5" \
        "grouped_mm-s1 90 --experts grouped_mm --seed 1" \
        "megamoe-4x4096 110 --experts megamoe --seq-len 4096 --seqs-per-step 4 --steps 40 --eval-every 40" \
        "grouped_mm-4x4096 70 --experts grouped_mm --seq-len 4096 --seqs-per-step 4 --steps 40 --eval-every 40"
    ;;
train-fp8)
    # FP8 training against bf16: 300 steps of one 16 384-token sequence with megamoe's experts in FP8 and in bf16 from
    # seed 0 (each with its MoE share, for the tokens/s that the layer benchmark predicts), and in bf16 from seed 1
    # (the spread that FP8's eval loss is judged against).
    train_runs "megamoe-fp8-s0 190 --experts megamoe --precision fp8 --moe-share-steps 5" \
        "megamoe-s0 190 --experts megamoe --moe-share-steps 5" \
        "megamoe-s1 170 --experts megamoe --seed 1"
    ;;
train-fp8-more)
    train_runs "megamoe-fp8-s1 170 --experts megamoe --precision fp8 --seed 1" \
        "megamoe-fp8-mb4 150 --experts megamoe --precision fp8 --micro-batches 4 --steps 40 --eval-every 40" \
        "megamoe-mb4 150 --experts megamoe --micro-batches 4 --steps 40 --eval-every 40"
    ;;
train-step)
    # 6 layers at the 30B dims (the yardstick's model), 20 steps each, the medians over steps 11-20; the profile over
    # 16-18 runs slower than the steps around it and counts in them
    short=(--layers 6 --steps 20 --eval-every 20 --eval-seqs 1 --profile 16-18)
    train_runs "l6-bf16 150 ${short[*]}" "l6-fp8-step 150 ${short[*]} --precision fp8" \
        "l6-fp8-ahead 150 ${short[*]} --precision fp8 --fp8-weight-cache ahead"
    rc=$?
    "$PY" -m megamoe.profiling "$out"/train-l6-*-profile.json --top 40 | tee "$out/train-step-profiles.txt"
    # the same experts in the layer benchmark, kernel by kernel: what the benchmark times around the kernels that
    # training's profiles hold (its megamoe::/_FusedMoE rows against the training's "megamoe's ops")
    step train-step-bench 150 "${py[@]}" -m megamoe.bench --preset qwen3-30b-a3b --routing random \
        --impls megamoe,megamoe_fp8 --profile --no-plot --out "$out/train-step-bench" || rc=$?
    exit "$rc"
    ;;
power)
    # at 30B also on the routing of train-step's bf16 run where it is here (its log's last step, the median layer)
    counts=()
    [ -f "$out/train-l6-bf16.json" ] && grep -q '"expert_counts": \[' "$out/train-l6-bf16.json" \
        && counts=(--counts "$out/train-l6-bf16.json")
    step power-qwen3-30b-a3b 240 "${py[@]}" -m tools.power --preset qwen3-30b-a3b "${counts[@]}" \
        --json "$out/power-qwen3-30b-a3b.json" || exit $?
    step power-qwen3-235b-a22b 240 "${py[@]}" -m tools.power --preset qwen3-235b-a22b \
        --json "$out/power-qwen3-235b-a22b.json"
    ;;
ep)
    [ "$gpus" -ge 2 ] || { echo "stage ep needs 2+ GPUs; this machine has $gpus" >&2; exit 2; }
    step ep-tests 420 "${py[@]}" -m pytest -q -p no:cacheprovider tests/test_parallel.py -m gpu || exit $?
    step ep-bench 590 "${py[@]}" -m torch.distributed.run --nproc-per-node "$gpus" -m megamoe.bench --ep \
        --preset qwen3-30b-a3b,qwen3-235b-a22b --tokens 16384 --routing random,skewed --comm-sms 32 --out "$out/results"
    ;;
esac
