#!/usr/bin/env bash
# Build Horovod 0.28.1 (its last release) with PyTorch + MPI + Gloo into the
# project venv, and cache the wheel so a rerun installs in seconds.
#
# 0.28.1's sdist sets CMAKE_CXX_STANDARD 14 in CMakeLists.txt and
# horovod/torch/CMakeLists.txt, but torch >= 2.1 needs C++17: we patch both to
# 17. Building takes about 5 minutes on 2 cores. The cached wheel lives in
# .cache/horovod/, keyed by Python, torch and MPI, so a different MPI or torch
# rebuilds. Ends with `horovodrun --check-build`, which must list PyTorch, MPI
# and Gloo.
#
#   scripts/install_horovod.sh            # build (or reuse) and install
#   HOROVOD_FORCE_REBUILD=1 scripts/install_horovod.sh
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
source "$(dirname "$0")/lib.sh"
# a step that fails without a word of its own (pip download, tar, pip install) says where: test.sh shows
# the last [hpcjobs] line as the reason Horovod is unavailable
trap 'say "failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR
ensure_venv
setup_mpi_env

version=0.28.1
py=$VENV/bin/python
torch_version=$("$py" -c 'import torch; print(torch.__version__)')
mpi_version=$(mpirun --version 2>&1)  # read whole: head stopping early could SIGPIPE it under pipefail
mpi_first=${mpi_version%%$'\n'*}
mpi_id=$(printf '%s\n' "$mpi_first" | tr -c 'A-Za-z0-9.\n' '_')
key=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')-torch${torch_version}-$(echo "$mpi_id" | sha256sum | cut -c1-12)
cache=$ROOT/.cache/horovod/$key
mkdir -p "$cache"

installed() {
    "$py" - "$version" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
sys.exit(0 if md.version("horovod") == sys.argv[1] else 1)
PY
}

if [ "${HOROVOD_FORCE_REBUILD:-0}" = 1 ]; then rm -f "$cache"/*.whl; fi
wheel=$(ls "$cache"/horovod-$version-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    # torch's extension headers include Python.h: a system Python needs its -dev package
    python_h="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h"
    if { ! command -v cmake || ! command -v g++ || [ ! -f "$python_h" ]; } >/dev/null 2>&1 \
            && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing cmake, g++ and python3-dev (Debian packages) to build Horovod"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake g++ make \
            python3-dev >/dev/null
    fi
    for tool in cmake g++ mpicc; do
        command -v "$tool" >/dev/null 2>&1 || { say "building Horovod needs $tool on PATH (Debian: apt-get install cmake g++)"; exit 1; }
    done
    [ -f "$python_h" ] || { say "building Horovod needs $python_h (Debian: apt-get install python3-dev)"; exit 1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    say "downloading the Horovod $version sdist"
    "$py" -m pip download -q --no-deps --no-binary=:all: -d "$work" "horovod==$version"
    tar -xzf "$work"/horovod-$version.tar.gz -C "$work"
    src=$work/horovod-$version
    for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
        grep -q 'set(CMAKE_CXX_STANDARD 14)' "$src/$f" || { say "$f has no 'set(CMAKE_CXX_STANDARD 14)': unexpected sdist"; exit 1; }
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/$f"
    done
    # CMake >= 4 refuses the sdist's old cmake_minimum_required without this.
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    say "building Horovod $version against torch $torch_version and $mpi_first (about 5 minutes)"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
    MAKEFLAGS=-j"$(nproc)" \
        "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$cache" "$src" >"$work/build.log" 2>&1 || {
            say "Horovod build failed; last lines of the log:"; tail -n 40 "$work/build.log" >&2; exit 1; }
    wheel=$(ls "$cache"/horovod-$version-*.whl | head -n 1)
    say "built $(basename "$wheel"), cached in $cache"
fi
# The wheel installed is the one built for this Python, torch and MPI (its cache folder): a rebuild (its
# wheel has the old one's name: forced, it is installed anyway), or a new key (another torch or MPI),
# replaces what an older build put in the venv.
marker="$("$py" -c 'import sys; print(sys.prefix)')/.hpcjobs-horovod-wheel"
if [ "${HOROVOD_FORCE_REBUILD:-0}" = 1 ] || ! installed || [ "$(cat "$marker" 2>/dev/null)" != "$wheel" ]; then
    say "installing $(basename "$wheel")"
    "$py" -m pip install -q --no-deps --force-reinstall "$wheel"
    # Horovod's own run-time dependencies (not torch: that stays pinned), then the marker: a run stopped
    # before them must not pass for done
    "$py" -m pip install -q cloudpickle psutil pyyaml packaging cffi
    echo "$wheel" >"$marker"
fi
if ! check=$(horovodrun --check-build 2>&1); then  # its output says why (an ImportError): shown, not swallowed
    printf '%s\n' "$check" >&2
    say "horovodrun --check-build failed"
    exit 1
fi
echo "$check"
for want in PyTorch MPI Gloo; do
    echo "$check" | grep -qE "\[X\] $want" || { say "horovodrun --check-build does not list $want"; exit 1; }
done
say "Horovod $version ready"
