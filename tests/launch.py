"""Launching hpcjobs as a user does: real mpirun, a clean environment.
Imported by the command-line tests (tests/ is on sys.path via its conftest)."""

import os
import shutil
import subprocess
import sys

import pytest


def clean_env():
    # A clean launch: no MPI variables inherited from a pytest that may itself
    # run as an MPI singleton.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _mpirun_prefix(n):
    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if exe is None:
        pytest.fail("no mpirun next to the interpreter or on PATH (scripts/test.sh installs one)")
    over = ["--oversubscribe"] if "Open MPI" in subprocess.run([exe, "--version"], capture_output=True,
                                                               text=True, env=clean_env()).stdout else []
    return [exe, *over, "-n", str(n), sys.executable]


def mpirun(n, *args, timeout=120, env=None):
    return subprocess.run([*_mpirun_prefix(n), "-m", "hpcjobs", *args],
                          capture_output=True, text=True, timeout=timeout, env=clean_env() | (env or {}))


def mpirun_script(n, script, timeout=120, env=None):
    """Run a Python ``script`` (source text) on ``n`` ranks."""
    return subprocess.run([*_mpirun_prefix(n), "-c", script],
                          capture_output=True, text=True, timeout=timeout, env=clean_env() | (env or {}))


def hpcjobs(*args):
    return subprocess.run([sys.executable, "-m", "hpcjobs", *args], capture_output=True, text=True,
                          timeout=60, env=clean_env())
