"""Every allreduce algorithm against closed forms and MPI_Allreduce, through
``allreduce(algorithm=...)``: all ops, dtypes, counts, both comms and buffer kinds.
(The ring's own modes and halves are in test_ring.py.)"""

import numpy as np
import pytest

from conftest import BUFFERS, COUNT_LABELS, OPS, check_allreduce, count_for, make_buffer, rank_input
from hpcjobs.collectives import (
    ALGORITHMS,
    allreduce,
    hierarchical_allreduce,
    parameter_server_allreduce,
    rabenseifner_allreduce,
    recursive_doubling_allreduce,
    shm_allreduce,
    tree_allreduce,
)

FAMILY = [a for a in ALGORITHMS if a not in ("ring", "ring_pipelined")] + ["auto"]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("count_label", COUNT_LABELS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("framework,dtype", BUFFERS, ids=[f"{f}-{d}" for f, d in BUFFERS])
@pytest.mark.parametrize("algorithm", FAMILY)
def test_algorithm_matches_closed_form_and_mpi(algorithm, framework, dtype, op, count_label, comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    count = count_for(count_label, size)
    inputs = [rank_input(r, count, dtype, op) for r in range(size)]
    buf = make_buffer(inputs[rank], dtype, framework)

    out = allreduce(buf, op, algorithm, comm)

    assert out is buf
    check_allreduce(out, inputs, op, dtype, comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fn", [recursive_doubling_allreduce, rabenseifner_allreduce, tree_allreduce,
                                parameter_server_allreduce, hierarchical_allreduce, shm_allreduce],
                         ids=lambda f: f.__name__)
def test_public_functions_reduce_in_place_and_return_the_buffer(fn, comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    buf = np.arange(1000, dtype=np.int64) + rank
    assert fn(buf, "sum", comm) is buf
    np.testing.assert_array_equal(buf, np.arange(1000) * size + size * (size - 1) // 2)
