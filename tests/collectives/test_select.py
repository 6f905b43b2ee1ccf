"""allreduce(algorithm=...): every algorithm by name, one registry."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.collectives import (ALGORITHMS, MESSAGE_ALGORITHMS, allreduce, hierarchical_allreduce,
                                 parameter_server_allreduce, rabenseifner_allreduce, recursive_doubling_allreduce,
                                 ring_allreduce, oneshot_allreduce, shm_allreduce, tree_allreduce)
from hpcjobs.collectives import select
from hpcjobs.collectives.messages import MESSAGE_PASSING


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["auto", *ALGORITHMS])
@pytest.mark.parametrize("count", [0, 5, 300_007])
def test_every_algorithm_gives_the_mpi_result(algorithm, count, comm):
    rank = comm.Get_rank()
    buf = (np.arange(count, dtype=np.int64) * (rank + 3)) % 1001
    want = buf.copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
    assert allreduce(buf, "sum", algorithm, comm) is buf
    np.testing.assert_array_equal(buf, want)


def test_the_registries_hold_the_names_the_command_line_offers():
    assert tuple(select.REGISTRY) == ALGORITHMS
    assert tuple(MESSAGE_PASSING) == MESSAGE_ALGORITHMS
    assert all(a.name == name for name, a in select.REGISTRY.items())


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown algorithm 'butterfly'; choose one of auto, ring, ring_pipelined"):
        allreduce(np.zeros(3), algorithm="butterfly")


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown op 'mean'"):
        allreduce(np.zeros(3), op="mean")


PUBLIC = {
    "ring": lambda buf, comm: ring_allreduce(buf, "sum", comm),
    "ring_pipelined": lambda buf, comm: ring_allreduce(buf, "sum", comm, pipeline=True),
    "recursive_doubling": lambda buf, comm: recursive_doubling_allreduce(buf, "sum", comm),
    "rabenseifner": lambda buf, comm: rabenseifner_allreduce(buf, "sum", comm),
    "tree": lambda buf, comm: tree_allreduce(buf, "sum", comm),
    "parameter_server": lambda buf, comm: parameter_server_allreduce(buf, "sum", comm),
    "hierarchical": lambda buf, comm: hierarchical_allreduce(buf, "sum", comm),
    "shm": lambda buf, comm: shm_allreduce(buf, "sum", comm),
    "oneshot": lambda buf, comm: oneshot_allreduce(buf, "sum", comm),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_by_name_is_the_same_call_as_the_public_function(algorithm):
    """Rank 0 calls allreduce(algorithm=...), the others the algorithm's own
    function: the agreement check must take them for the same call."""
    comm = MPI.COMM_WORLD
    buf = np.full(1000, comm.Get_rank() + 1.0)
    if comm.Get_rank() == 0:
        allreduce(buf, "sum", algorithm, comm)
    else:
        PUBLIC[algorithm](buf, comm)
    P = comm.Get_size()
    np.testing.assert_array_equal(buf, np.full(1000, P * (P + 1) / 2))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["auto", *ALGORITHMS])
def test_lookup_run_is_the_same_call_as_allreduce_by_name(algorithm):
    """What the benchmark rows call: every rank but the last through
    lookup(name).run, the last through allreduce(algorithm=name)."""
    comm = MPI.COMM_WORLD
    buf = np.full(300, comm.Get_rank() + 1.0)
    if comm.Get_rank() == comm.Get_size() - 1:
        allreduce(buf, "sum", algorithm, comm)
    else:
        assert select.lookup(algorithm).run(buf, "sum", comm) is buf
    P = comm.Get_size()
    np.testing.assert_array_equal(buf, np.full(300, P * (P + 1) / 2))


@pytest.mark.mpi(min_size=2)
def test_the_ring_and_the_pipelined_ring_are_told_apart():
    """They move data differently (whole chunks against segments): mixed, the
    ranks must refuse, not hang or mismatch their messages."""
    from hpcjobs.collectives.agreement import MismatchError

    comm = MPI.COMM_WORLD
    buf = np.ones(1000)
    with pytest.raises(MismatchError, match="options differs"):
        allreduce(buf, "sum", "ring_pipelined" if comm.Get_rank() == 0 else "ring", comm)
