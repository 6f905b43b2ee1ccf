"""The command line as a user runs it: real mpirun, real exit codes."""

import json
import os
import shutil
import subprocess
import sys

import pytest


def _env():
    # A clean launch: no MPI variables inherited from a pytest that may itself
    # run as an MPI singleton.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _mpirun(n, *args, timeout=120, env=None):
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("no mpirun next to the interpreter or on PATH (scripts/test.sh installs one)")
    over = ["--oversubscribe"] if "Open MPI" in subprocess.run([mpirun, "--version"], capture_output=True,
                                                               text=True, env=_env()).stdout else []
    return subprocess.run([mpirun, *over, "-n", str(n), sys.executable, "-m", "hpcjobs", *args],
                          capture_output=True, text=True, timeout=timeout, env=_env() | (env or {}))


def _hpcjobs(*args):
    return subprocess.run([sys.executable, "-m", "hpcjobs", *args], capture_output=True, text=True,
                          timeout=60, env=_env())


def test_help_lists_the_commands():
    out = _hpcjobs("--help")
    assert out.returncode == 0
    assert "bench" in out.stdout and "info" in out.stdout
    out = _hpcjobs("bench", "allreduce", "--help")
    assert out.returncode == 0 and "--segment-bytes" in out.stdout


def test_a_group_without_a_command_prints_its_help_and_exits_2():
    out = _hpcjobs("bench")
    assert out.returncode == 2 and "allreduce" in out.stderr


@pytest.mark.parametrize("args,words", [
    (["--min-bytes", "0"], "size must be positive"),
    (["--min-bytes", "1K", "--max-bytes", "8"], "--min-bytes 1024 is larger than --max-bytes 8"),
    (["--impl", "ring,butterfly"], "unknown implementation 'butterfly'"),
    (["--segment-bytes", "64Q"], "not a size"),
    (["--iters", "-3"], "must be positive"),
    (["--dtype", "complex64"], "invalid choice"),
])
def test_bad_bench_arguments_exit_2_on_every_rank_naming_the_problem(args, words):
    out = _mpirun(2, "bench", "allreduce", *args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr
    assert "size(B)" not in out.stdout  # nothing was measured


def test_bench_under_mpirun_prints_the_table_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    out = _mpirun(3, "bench", "allreduce", "-b", "8", "-e", "4K", "-f", "8", "--iters", "3",
                  "--json", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(l for l in lines if "size(B)" in l)
    assert header.split() == ["#", "size(B)", "count", "type", "redop", "impl", "time(us)",
                              "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
    rows = [l.split() for l in lines if l and not l.startswith("#")]
    assert [(r[0], r[4]) for r in rows] == [(s, i) for s in ("8", "64", "512", "4096")
                                            for i in ("ring", "ring_pipelined", "mpi")]
    assert all(r[-1] == "0" for r in rows)
    assert "# Out of bounds values : 0 OK" in out.stdout
    data = json.loads(path.read_text())
    assert data["environment"]["ranks"] == 3 and len(data["records"]) == 12


def test_expected_world_size_mismatch_aborts_the_job():
    out = _mpirun(2, "info", env={"HPCJOBS_EXPECT_WORLD_SIZE": "5"}, timeout=60)
    assert out.returncode != 0
    assert "MPI world size is 2 but HPCJOBS_EXPECT_WORLD_SIZE=5" in out.stderr


def test_info_names_every_rank():
    out = _mpirun(3, "info", "--all-ranks")
    assert out.returncode == 0, out.stderr
    assert "ranks: 3" in out.stdout
    assert [l.split()[:4] for l in out.stdout.splitlines() if l.startswith("rank ")] == [
        ["rank", str(r), "of", "3"] for r in range(3)]
