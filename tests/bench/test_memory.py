"""A benchmark whose largest message cannot fit in its hosts' memory is
refused on every rank before anything runs; it used to run until the
out-of-memory killer ended a rank (``bench allreduce -e 100G`` here took 17
of 24 GiB at 1 GiB, on one rank). And a sweep lets each size's copies go
before the next size's are made."""

import tracemalloc

import pytest
from mpi4py import MPI

from hpcjobs.bench.memory import SWEEP_COPIES, available_bytes, check_fits
from launch import hpcjobs
from launch import mpirun as _mpirun


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683492 kB\nMemFree:        16000000 kB\nMemAvailable:   22000000 kB\n")
    assert available_bytes(str(meminfo)) == 22000000 * 1024
    meminfo.write_text("MemTotal:       24683492 kB\n")  # a kernel before 3.14: cannot tell
    assert available_bytes(str(meminfo)) is None
    assert available_bytes(str(tmp_path / "absent")) is None
    assert available_bytes() > 0  # this machine's


def _ranks_here(comm):
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    n = local.Get_size()
    local.Free()
    return n


@pytest.mark.mpi(min_size=1)
def test_what_fits_passes_and_what_does_not_is_refused_on_every_rank():
    comm = MPI.COMM_WORLD
    here = _ranks_here(comm)
    check_fits(comm, 1 << 30, "--max-bytes 128M", available=here << 30)  # exactly full: fits
    with pytest.raises(ValueError) as e:
        check_fits(comm, (1 << 30) + 1, "--max-bytes 128M", available=here << 30)
    assert str(e.value).startswith("--max-bytes 128M does not fit in memory: ")
    assert f"{here} rank(s) here need about {here:.1f} GiB (1.0 GiB each), {here:.1f} GiB is available" in str(e.value)


@pytest.mark.mpi(min_size=2)
def test_one_host_short_of_memory_stops_every_rank_not_only_its_own():
    """Rank 0 alone is told its host is short (as one node of a job may be):
    every rank raises, and the message names which ranks fit."""
    comm = MPI.COMM_WORLD
    available = 0 if comm.Get_rank() == 0 else 1 << 40
    with pytest.raises(ValueError, match=r"does not fit in memory: rank 0: .*; ranks? 1.*: fits; lower it"):
        check_fits(comm, 1 << 20, "--elements 262,144", available=available)


def _peak_bytes(sizes):
    from hpcjobs.bench import sweep

    comm = MPI.COMM_SELF.Dup()
    tracemalloc.start()
    try:
        sweep.run(comm, sizes, sweep.implementations(["ring"]), iters=1, warmup=0)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        comm.Free()


def test_a_sweep_frees_each_sizes_copies_before_the_next_sizes():
    """Numpy's arrays are traced: a 4 MiB size then an 8 MiB one peak within
    a few MiB of the 8 MiB size alone. The last size's buffer, inputs and
    expected results (7 x 4 MiB) stayed alive while the next were made."""
    alone, after = _peak_bytes([8 << 20]), _peak_bytes([4 << 20, 8 << 20])
    assert SWEEP_COPIES * (8 << 20) <= alone
    assert after - alone < 2 * (4 << 20), (alone, after)


def test_a_sweep_larger_than_memory_is_refused_at_once_on_every_rank():
    out = _mpirun(2, "bench", "allreduce", "-b", "512G", "-e", "512G")
    assert out.returncode == 2, out.stderr
    assert "hpcjobs bench allreduce: error: --max-bytes 512G (a sweep holds about 8x its largest message" in out.stderr
    assert "does not fit in memory: ranks 0,1: 2 rank(s) here need about 8192.0 GiB (4096.0 GiB each)" in out.stderr


def test_bench_compression_refuses_counts_that_are_not_finite_or_do_not_fit():
    for count in ("inf", "1e400"):  # int(inf) raised OverflowError, which argparse let through as a traceback
        out = hpcjobs("bench", "compression", "--elements", count)
        assert out.returncode == 2 and f"counts must be finite and >= 1, got '{count}'" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    out = hpcjobs("bench", "compression", "--elements", "1e20")
    assert out.returncode == 2 and "--elements 100,000,000,000,000,000,000 does not fit in memory" in out.stderr


def test_soak_refuses_a_count_that_does_not_fit():
    out = hpcjobs("soak", "--max-count", str(10 ** 15))
    assert out.returncode == 2, out.stderr
    assert "--max-count 1,000,000,000,000,000 does not fit in memory: rank 0: 1 rank(s) here need about" in out.stderr
