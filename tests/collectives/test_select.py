"""allreduce(algorithm=...) dispatch and the auto choice."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.collectives import ALGORITHMS, allreduce
from hpcjobs.collectives.select import choose


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


@pytest.mark.parametrize("nbytes", [0, 8, 1 << 20, 64 << 20])
def test_auto_chooses_an_implemented_algorithm(nbytes):
    assert choose(nbytes, 2) in ALGORITHMS


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown algorithm 'butterfly'; choose one of auto, ring, ring_pipelined"):
        allreduce(np.zeros(3), algorithm="butterfly")


def test_unknown_op_is_refused_before_dispatch():
    with pytest.raises(ValueError, match="unknown op 'mean'"):
        allreduce(np.zeros(3), op="mean", algorithm="butterfly")
