#!/usr/bin/env bash
# Started by mpirun on every rank from scripts/test.sh: rank 0 reports to the
# terminal, the others to $HPCJOBS_RANK_LOG-rank<r>.log (shown when they fail).
# Each rank gets its own pytest temp root: a shared one is cleaned up by every
# rank at once.
r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-0}}}
prefix=${HPCJOBS_RANK_LOG:-/tmp/hpcjobs-pytest}
if [ "$r" = 0 ]; then
    exec python -m pytest --basetemp="$prefix-tmp-rank$r" "$@"
fi
exec python -m pytest --basetemp="$prefix-tmp-rank$r" "$@" >"$prefix-rank$r.log" 2>&1
