#!/usr/bin/env bash
# The main job on this machine: the allreduce benchmark at 2 ranks -- our ring
# and pipelined ring against MPI_Allreduce, one table, one run.
# Creates .venv and installs everything on first use.
#
#   scripts/demo.sh                      # default sweep, 8 B .. 64 MB
#   scripts/demo.sh --max-bytes 1M       # extra args go to `hpcjobs bench allreduce`
#   HPCJOBS_DEMO_RANKS=4 scripts/demo.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
ensure_venv
setup_mpi_env
cd "$ROOT"
mkdir -p results
ranks=${HPCJOBS_DEMO_RANKS:-2}
say "allreduce benchmark: mpirun -n $ranks hpcjobs bench allreduce $*"
mpi_run "$ranks" hpcjobs bench allreduce --json results/demo-allreduce.json "$@"
