#!/usr/bin/env bash
# Started by mpirun on every rank from scripts/test.sh: rank 0 reports to the
# terminal, the others to $HPCJOBS_RANK_LOG-rank<r>.log (shown when they fail).
r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-0}}}
if [ "$r" = 0 ]; then
    exec python -m pytest "$@"
fi
exec python -m pytest "$@" >"${HPCJOBS_RANK_LOG:-/tmp/hpcjobs-pytest}-rank$r.log" 2>&1
