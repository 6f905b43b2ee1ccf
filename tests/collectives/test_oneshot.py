"""The one-shot shared-memory allreduce: every op and dtype, back-to-back
calls of different sizes, a late rank, pieces beyond a slot, and where
auto and the agreement check may use it."""

import textwrap
import time

import numpy as np
import pytest
from launch import mpirun_script
from mpi4py import MPI

from conftest import BUFFERS, OPS, check_allreduce, make_buffer, RankInputs
from hpcjobs.collectives import allreduce, auto, oneshot, oneshot_allreduce
from hpcjobs.collectives.agreement import MismatchError, checking
from hpcjobs.comm import private


def _counts(size: int, itemsize: int) -> list[int]:
    largest = oneshot.MAX_BYTES // itemsize  # the largest one slot takes
    return [0, 1, size + 1, largest, largest + 3]  # and one that goes in two pieces


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("checks", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("framework,dtype", BUFFERS)
@pytest.mark.parametrize("op", OPS)
def test_every_op_dtype_and_count(framework, dtype, op, comm, checks):
    """Checked, a message of one slot rides in the check's exchange (the
    carry); unchecked, it goes through the frame's fast path."""
    size = comm.Get_size()
    itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
    results = []
    with checking(checks):
        for count in _counts(size, itemsize):
            inputs = RankInputs(size, count, dtype, op, seed=count)
            buf = make_buffer(inputs[comm.Get_rank()], dtype, framework)
            assert oneshot_allreduce(buf, op, comm) is buf
            results.append((buf, inputs))
    for buf, inputs in results:
        check_allreduce(buf, inputs, op, dtype, comm)


@pytest.mark.mpi(min_size=2)
def test_many_calls_back_to_back_with_different_sizes_and_a_late_rank():
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    results = []
    for i in range(60):
        count = (1, 7, 1000, 16, 4096, 3)[i % 6]
        if i % 10 == rank:  # one rank late between calls: the others must wait, not read stale slots
            time.sleep(0.005)
        x = np.full(count, float(rank + i))
        oneshot_allreduce(x, "sum", comm)
        results.append((x, sum(r + i for r in range(size))))
    for x, want in results:
        np.testing.assert_array_equal(x, want)


@pytest.mark.mpi(min_size=2)
def test_the_segment_is_made_once_and_freed_with_the_comm():
    sub = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
    oneshot_allreduce(np.ones(10), comm=sub)
    segments = private(sub).Get_attr(oneshot._KEYVAL)
    oneshot_allreduce(np.ones(5000), comm=sub)
    assert private(sub).Get_attr(oneshot._KEYVAL) is segments
    sub.Free()
    assert segments.win == MPI.WIN_NULL and segments.slots == []


@pytest.mark.mpi(min_size=2)
def test_auto_measures_oneshot_where_ranks_outnumber_cores_too():
    """With --oversubscribe its waiters yield their core (5, 8 and 16 ranks on
    2 cores measured it the fastest of ours), so auto times it like the rest."""
    comm = MPI.COMM_WORLD
    auto.remeasure()
    x = np.ones(16)
    while not auto.settled(x, "sum", comm):
        x[:] = 1
        allreduce(x, "sum", "auto", comm)
    np.testing.assert_array_equal(x, comm.Get_size())
    assert "oneshot" in auto._decision(x.nbytes, "float64", "sum", comm).names
    assert auto.kept(x.nbytes, "float64", "sum", comm) is not None


@pytest.mark.mpi(min_size=2)
def test_agreement_check_over_oneshot_catches_a_mismatch():
    from hpcjobs.collectives import agreement

    sub = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())  # a fresh comm: the exchange is chosen per comm
    with checking(True):
        x = np.ones(8 if sub.Get_rank() == 0 else 9)
        with pytest.raises(MismatchError, match="count differs"):
            oneshot_allreduce(x, "sum", sub)
        y = np.ones(8)
        oneshot_allreduce(y, "sum", sub)  # and the next call is fine
    np.testing.assert_array_equal(y, sub.Get_size())
    assert agreement.exchange_of(private(sub)) == "segment"  # one node, oversubscribed or not
    sub.Free()


def test_a_rank_that_never_arrives_in_oneshot_is_the_usual_timeout():
    out = mpirun_script(3, textwrap.dedent("""
        import time
        import numpy as np
        from mpi4py import MPI
        from hpcjobs.collectives import oneshot_allreduce
        x = np.ones(10)
        MPI.COMM_WORLD.Barrier()  # past the imports on every rank: 3 ranks on 2 cores start seconds apart
        oneshot_allreduce(x)
        if MPI.COMM_WORLD.rank == 2:
            time.sleep(600)
        oneshot_allreduce(x)
    """), timeout=120, env={"HPCJOBS_TIMEOUT": "3"})
    assert out.returncode != 0
    assert "oneshot_allreduce (call #2) did not complete within 3 s" in out.stderr
    assert "ranks not in oneshot_allreduce: 2;" in out.stderr
