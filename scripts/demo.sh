#!/usr/bin/env bash
# The main job on this machine, at 2 ranks:
#   1. the allreduce benchmark -- auto (our best, chosen per size), shared
#      memory and the ring against MPI_Allreduce and torch.distributed/Gloo,
#      one table, one run, with a one-line verdict against each;
#   2. a short large-minibatch comparison (Goyal et al. 2017 in miniature):
#      MNIST-1D test error at global batch 32 .. 512 with the linear scaling
#      rule and no / constant / gradual warmup (about a minute here).
# Creates .venv and installs everything on first use.
#
#   scripts/demo.sh                      # default sweep, 8 B .. 64 MB
#   scripts/demo.sh --max-bytes 1M       # extra args go to `hpcjobs bench allreduce`
#   HPCJOBS_DEMO_RANKS=4 scripts/demo.sh
#   HPCJOBS_DEMO_TRAIN=0 scripts/demo.sh # the benchmark only
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
source "$(dirname "$0")/lib.sh"
ensure_venv
setup_mpi_env
cd "$ROOT"
mkdir -p results
ranks=${HPCJOBS_DEMO_RANKS:-2}
bench=(--impl ring,shm,auto --baselines mpi,gloo --json results/demo-allreduce.json "$@")
say "allreduce benchmark: mpirun -n $ranks hpcjobs bench allreduce ${bench[*]}"
mpi_run "$ranks" hpcjobs bench allreduce "${bench[@]}"
if [ "${HPCJOBS_DEMO_TRAIN:-1}" != 0 ]; then
    # Every global batch must divide by the ranks: base 32, or the next multiple.
    lo=$(( (32 + ranks - 1) / ranks * ranks ))
    grid=(--min-batch "$lo" --max-batch $(( lo * 16 )) --seeds 1 --out results/demo-large-batch)
    say "large-minibatch SGD: mpirun -n $ranks hpcjobs experiment large-batch ${grid[*]}"
    mpi_run "$ranks" hpcjobs experiment large-batch "${grid[@]}"
fi
