"""allreduce(algorithm=...): every algorithm by name, one registry."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.collectives import ALGORITHMS, MESSAGE_ALGORITHMS, allreduce
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
