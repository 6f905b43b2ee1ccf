"""Every allreduce algorithm against closed forms and MPI_Allreduce, through
``allreduce(algorithm=...)``: all ops, dtypes, counts, both comms and buffer kinds.
(The ring's own modes and halves are in test_ring.py.)"""

import numpy as np
import pytest

from conftest import BUFFERS, COUNT_LABELS, OPS, check_allreduce, count_for, make_buffer, RankInputs
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
    inputs = RankInputs(size, count, dtype, op)
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


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("algorithm", FAMILY + ["ring", "ring_pipelined"])
def test_every_rank_ends_with_the_same_bits_where_order_picks_them(algorithm, dtype, comm):
    """min and max of +0 and -0, and sums of NaNs, keep one operand's bits:
    each is right, but every rank must keep the same one. Recursive doubling's
    partners computed a⊕b and b⊕a, and kept opposite zeros."""
    import torch

    rank = comm.Get_rank()
    zeros = np.array([0.0, -0.0, 1.0, 0.0], dtype=np.float64)  # rank r holds +0 or -0 by parity, with others
    for op, values in (("min", np.where(np.arange(4) % 2 == rank % 2, zeros, -zeros)),
                       ("max", np.where(np.arange(4) % 2 == rank % 2, -zeros, zeros)),
                       ("sum", np.array([np.nan if rank % 2 else -np.nan, 1.0, np.nan, 2.0]))):
        if dtype == "bfloat16":
            buf = torch.tensor(values, dtype=torch.bfloat16)
            bits = lambda b: b.view(torch.int16).numpy().tobytes()  # noqa: E731
        else:
            buf = values.astype(dtype)
            bits = lambda b: b.tobytes()  # noqa: E731
        allreduce(buf, op, algorithm, comm)
        everyone = comm.allgather(bits(buf))
        assert all(b == everyone[0] for b in everyone), (op, everyone)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "ring_pipelined", *FAMILY])
def test_numpys_raise_setting_does_not_leave_the_other_ranks_waiting(algorithm):
    """Under np.seterr(all="raise") (a NaN hunt) the rank whose sum
    overflowed raised FloatingPointError alone and the others waited in the
    collective until the watchdog ended the job. The reductions ignore
    numpy's floating-point errors, as MPI's do: inf and NaN on every rank."""
    from mpi4py import MPI

    from hpcjobs.collectives.counting import counted_allreduce

    comm = MPI.COMM_WORLD
    x = np.array([3e38, np.inf if comm.rank == 0 else -np.inf, 1.0], np.float32)
    with np.errstate(all="raise"):
        allreduce(x, algorithm=algorithm)
        assert np.isinf(x[0]) and np.isnan(x[1]) and x[2] == comm.size
        y = np.full(5, 3e38, np.float32)
        counted_allreduce(y, "avg", algorithm="ring")  # (compression's and the optimizer's path)
        assert np.isinf(y).all()
