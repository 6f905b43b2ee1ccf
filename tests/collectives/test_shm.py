"""Shared-memory allreduce: halves, block sizes, window reuse and release."""

import textwrap

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.collectives import chunk_bounds, shm_allgather, shm_allreduce, shm_reduce_scatter
from hpcjobs.collectives.shm import _WIN_KEYVAL
from hpcjobs.comm import private


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("block_bytes", [64, 1000, 1 << 16])
@pytest.mark.parametrize("count", [1, 7, 10_007])
def test_small_blocks_take_many_steps_and_stay_exact(block_bytes, count, comm):
    rank = comm.Get_rank()
    buf = (np.arange(count, dtype=np.int64) * (rank + 1)) % 97
    want = buf.copy()
    comm.Allreduce(MPI.IN_PLACE, want)
    shm_allreduce(buf, "sum", comm, block_bytes=block_bytes)
    np.testing.assert_array_equal(buf, want)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("count", [0, 1, 5, 100_003])
def test_reduce_scatter_then_allgather_is_an_allreduce(count, comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    buf = (np.arange(count, dtype=np.int64) + 3 * rank) % 11
    want = buf.copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.MAX)
    shm_reduce_scatter(buf, "max", comm, block_bytes=4096)
    b = chunk_bounds(count, size)
    np.testing.assert_array_equal(buf[b[rank]:b[rank + 1]], want[b[rank]:b[rank + 1]])
    shm_allgather(buf, comm, block_bytes=4096)
    np.testing.assert_array_equal(buf, want)


@pytest.mark.mpi(min_size=2)
def test_window_is_reused_across_calls_and_block_sizes_and_freed_with_the_comm():
    sub = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
    buf = np.ones(1 << 18)
    shm_allreduce(buf, comm=sub, block_bytes=1 << 16)
    state = private(sub).Get_attr(_WIN_KEYVAL)
    shm_allreduce(buf, comm=sub, block_bytes=1 << 16)
    shm_allreduce(buf, comm=sub, block_bytes=1 << 12)  # smaller blocks fit the same window
    assert private(sub).Get_attr(_WIN_KEYVAL) is state
    shm_allreduce(buf, comm=sub, block_bytes=1 << 17)  # larger: grows once
    grown = private(sub).Get_attr(_WIN_KEYVAL)
    assert grown is not state and grown.capacity == 1 << 17 and state.stages == []
    np.testing.assert_array_equal(buf, np.full(1 << 18, float(sub.Get_size()) ** 4))
    sub.Free()
    assert grown.stages == [] and grown.win == MPI.WIN_NULL


@pytest.mark.parametrize("bad", [0, 63, 1.5, True])
def test_bad_block_size_is_refused(bad):
    with pytest.raises(ValueError, match="block_bytes"):
        shm_allreduce(np.zeros(4), block_bytes=bad)


def test_more_ranks_than_a_small_block_has_slots_for():
    """A stage holds a piece of every rank's shard, at least one element
    each: 9 ranks of float64 need 72 bytes. At block_bytes=64 the last rank's
    slot was empty: the others' pieces for it were dropped, its reduce raised
    and the rest waited at the next barrier. Now the stage grows to fit."""
    from launch import mpirun_script

    out = mpirun_script(9, textwrap.dedent("""
        import numpy as np
        from mpi4py import MPI
        from hpcjobs.collectives import shm_allreduce
        comm = MPI.COMM_WORLD
        buf = np.arange(50, dtype=np.float64) * (comm.rank + 1)
        want = buf.copy()
        comm.Allreduce(MPI.IN_PLACE, want)
        shm_allreduce(buf, "sum", comm, block_bytes=64)
        assert np.array_equal(buf, want)
        print("rank", comm.rank, "ok")
        """), timeout=120)  # the old stage hung here (9 ranks start slowly on 2 cores)
    assert out.returncode == 0 and out.stdout.count(" ok") == 9, out.stdout[-2000:] + out.stderr[-3000:]
