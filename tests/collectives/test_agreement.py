"""Mismatched arguments fail on every rank, with one message, before any data
moves; the communicator is still usable afterwards."""

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcjobs.collectives import (allreduce, hierarchical_allreduce, ring_allgatherv, ring_allreduce,
                                 ring_reduce_scatter, shm_allreduce, tree_allreduce)
from hpcjobs.collectives.agreement import MismatchError, checking, checks_enabled, set_checks
from hpcjobs.compression import TopKCompressor, compressed_allreduce


def _raises_everywhere(call, comm, *words):
    """call() raises MismatchError on every rank, the same message, naming ``words``."""
    comm.Barrier()  # time the check, not how far apart the ranks arrived
    t0 = time.perf_counter()
    with pytest.raises(MismatchError) as info:
        call()
    elapsed = time.perf_counter() - t0
    messages = comm.allgather(str(info.value))
    assert len(set(messages)) == 1, messages
    for w in words:
        assert w in messages[0], messages[0]
    assert max(comm.allgather(elapsed)) < 30.0  # at once, not at the watchdog's 300 s (5 ranks share 2 cores)
    # nothing was sent: the communicator still works
    x = np.ones(5)
    ring_allreduce(x, comm=comm)
    assert (x == comm.Get_size()).all()
    return messages[0]


@pytest.mark.mpi(min_size=2)
def test_a_count_mismatch_on_one_rank_raises_on_every_rank():
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    buf = np.ones(10 + (comm.Get_rank() == last))
    msg = _raises_everywhere(lambda: ring_allreduce(buf, comm=comm), comm, "count differs", f"rank {last}: 11")
    assert "ring_allreduce" in msg and "nothing was sent" in msg


@pytest.mark.mpi(min_size=2)
def test_a_dtype_mismatch_raises_on_every_rank():
    comm = MPI.COMM_WORLD
    buf = np.ones(8, dtype=np.float64 if comm.Get_rank() == 0 else np.float32)
    _raises_everywhere(lambda: allreduce(buf, algorithm="recursive_doubling", comm=comm), comm,
                       "dtype differs", "rank 0: float64", "float32")


@pytest.mark.mpi(min_size=2)
def test_an_op_or_algorithm_mismatch_raises_on_every_rank():
    comm = MPI.COMM_WORLD
    buf = np.ones(8)
    _raises_everywhere(lambda: tree_allreduce(buf, "max" if comm.Get_rank() == 1 else "sum", comm=comm), comm,
                       "op differs", "rank 1: max")
    alg = "ring" if comm.Get_rank() == 0 else "tree"
    _raises_everywhere(lambda: allreduce(buf, algorithm=alg, comm=comm), comm, "algorithm differs")


@pytest.mark.mpi(min_size=2)
def test_an_mpi_op_object_on_one_rank_is_an_error_on_every_rank():
    """MPI.SUM, mpi4py's habit, cannot be hashed: the check raised TypeError on that rank alone, and the others
    waited in it until the watchdog's 300 s."""
    comm = MPI.COMM_WORLD
    _raises_everywhere(lambda: allreduce(np.ones(4), op=MPI.SUM if comm.rank == 0 else "sum"), comm,
                       "rank 0: ValueError: unknown op <mpi4py.MPI.Op", "(a name)")


@pytest.mark.mpi(min_size=2)
def test_a_bad_buffer_on_one_rank_is_an_error_on_every_rank():
    comm = MPI.COMM_WORLD
    buf = np.ones(6)
    if comm.Get_rank() == 1:
        buf.flags.writeable = False
    _raises_everywhere(lambda: ring_allreduce(buf, comm=comm), comm, "rank 1: ValueError", "read-only")
    t = torch.ones(4, 4)
    arg = t.t()[1:] if comm.Get_rank() == 0 else t[1:]  # rank 0: not contiguous
    _raises_everywhere(lambda: ring_allreduce(arg, comm=comm), comm, "rank 0: ValueError", "contiguous")
    # torch refuses numpy() on a negative view (RuntimeError): raised on rank 1 alone, the others waited
    arg = t.reshape(-1)._neg_view() if comm.Get_rank() == 1 else t.reshape(-1)
    _raises_everywhere(lambda: ring_allreduce(arg, comm=comm), comm, "rank 1: ValueError", "resolve_neg")
    # inside torch.func.grad rank 0's tensor is functorch's, with no storage: data_ptr's RuntimeError was raised
    # on rank 0 alone (since numpy views are made from the memory, not t.numpy())
    from torch.func import grad

    def reduced(x):
        _raises_everywhere(lambda: ring_allreduce(x, comm=comm), comm, "ValueError", "does not give its memory")
        return x.sum()
    if comm.Get_rank() == 0:
        grad(reduced)(torch.ones(4))
    else:
        reduced(torch.ones(4))
    # a plain subclass of torch.Tensor has its memory as its values: reduced, as t.numpy() allowed it
    mine = type("Mine", (torch.Tensor,), {})
    sub = torch.ones(3).as_subclass(mine)
    ring_allreduce(sub, comm=comm)
    assert sub.as_subclass(torch.Tensor).tolist() == [comm.Get_size()] * 3
    # unaligned on rank 0 (mpi4py's KeyError in its first send, the others waiting in theirs)
    raw = np.frombuffer(bytearray(8 * 6 + 1), dtype=np.float64, offset=1, count=6)
    _raises_everywhere(lambda: ring_allreduce(raw if comm.Get_rank() == 0 else np.ones(6), comm=comm), comm,
                       "rank 0: ValueError", "not aligned")


@pytest.mark.mpi(min_size=2)
def test_an_unknown_algorithm_on_one_rank_is_an_error_on_every_rank():
    """Before, the rank with the typo raised at once and the others waited
    in the check until the watchdog's 300 s."""
    comm = MPI.COMM_WORLD
    alg = "ring-pipelined" if comm.Get_rank() == 1 else "ring_pipelined"
    buf = np.ones(8)
    _raises_everywhere(lambda: allreduce(buf, algorithm=alg, comm=comm), comm, "rank 1: ValueError",
                       "unknown algorithm 'ring-pipelined'", "allreduce(algorithm='ring-pipelined')")


@pytest.mark.mpi(min_size=2)
def test_a_communicator_where_the_algorithm_goes_is_an_error_on_every_rank():
    """allreduce(buf, "sum", comm) -- the order ring_allreduce takes --
    raised TypeError: unhashable type 'Intracomm' on the rank that did it,
    and the others waited in the check; MPI.SUM with the checks off raised
    'unhashable type' where the refusal names the ops."""
    comm = MPI.COMM_WORLD
    buf = np.ones(8)
    third = comm if comm.Get_rank() == 1 else "ring"
    _raises_everywhere(lambda: allreduce(buf, "sum", third), MPI.COMM_WORLD, "rank 1: TypeError",
                       "algorithm must be a name, got Intracomm (a communicator goes in comm=)")
    with checking(False), pytest.raises(ValueError, match="unknown op .*MPI"):
        ring_allreduce(np.ones(8), MPI.SUM, comm=MPI.COMM_SELF)


@pytest.mark.parametrize("call, words", [
    (lambda buf, bad, comm: ring_allreduce(buf, comm=comm, pipeline=True, segment_bytes=-8 if bad else 4096),
     "segment_bytes must be a positive integer, got -8"),
    (lambda buf, bad, comm: ring_reduce_scatter(buf, comm=comm, pipeline=True, segment_bytes="4k" if bad else 4096),
     "ValueError: invalid literal"),
    (lambda buf, bad, comm: shm_allreduce(buf, comm=comm, block_bytes=8 if bad else 4096),
     "block_bytes must be an integer >= 64, got 8"),
    (lambda buf, bad, comm: ring_allreduce(buf, comm=comm, pipeline=True,
                                           segment_bytes=float("inf") if bad else 4096),
     "OverflowError: cannot convert float infinity to integer"),
    (lambda buf, bad, comm: hierarchical_allreduce(buf, comm=comm, ranks_per_node=1, intra="nccl" if bad else "ring"),
     "unknown intra='nccl'"),
    (lambda buf, bad, comm: hierarchical_allreduce(buf, comm=comm, ranks_per_node=1, segment_bytes=1.5 if bad else 0),
     "segment_bytes must be an integer >= 0"),
], ids=["ring-segment", "reduce-scatter-segment", "shm-block", "ring-infinite-segment", "hierarchical-intra",
        "hierarchical-segment"])
@pytest.mark.mpi(min_size=2)
def test_a_bad_option_on_one_rank_is_an_error_on_every_rank(call, words):
    """Before, the rank with the bad option raised in its own check of it
    and the others waited in the call's check until the watchdog."""
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    buf = np.ones(64)
    _raises_everywhere(lambda: call(buf, comm.Get_rank() == last, comm), comm, f"rank {last}:", words)


@pytest.mark.mpi(min_size=2)
def test_arrays_in_c_and_fortran_order_on_different_ranks_are_refused():
    """Elements are reduced in memory order: a Fortran-order array against
    a C-order one would sum element (i, j) with another. Alike on every
    rank, Fortran order reduces element by element."""
    comm = MPI.COMM_WORLD
    values = np.arange(12.0).reshape(3, 4) * (comm.Get_rank() + 1)
    mine = np.asfortranarray(values) if comm.Get_rank() == 1 else values.copy()
    _raises_everywhere(lambda: ring_allreduce(mine, comm=comm), comm, "device differs", "cpu, Fortran order")
    alike = np.asfortranarray(values)
    ring_allreduce(alike, comm=comm)
    P = comm.Get_size()
    assert np.array_equal(alike, np.arange(12.0).reshape(3, 4) * P * (P + 1) / 2)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix's own
def test_a_numpy_subclass_is_reduced_as_the_array_it_holds():
    m = np.matrix(np.arange(6.0).reshape(2, 3))
    ring_allreduce(m, op="max", comm=MPI.COMM_SELF)
    assert isinstance(m, np.matrix) and np.array_equal(np.asarray(m), np.arange(6.0).reshape(2, 3))
    from hpcjobs.collectives._buffers import as_flat

    assert as_flat(m).data.shape == (6,)  # np.matrix.reshape(-1) stays (1, 6): the steps' slices took rows


@pytest.mark.mpi(min_size=2)
def test_compressed_allreduce_and_allgatherv_check_their_arguments():
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    ratio = 0.5 if rank == 0 else 0.25
    _raises_everywhere(lambda: compressed_allreduce(torch.ones(8), TopKCompressor(ratio), comm=comm), comm,
                       "compressor differs", "TopKCompressor(ratio=0.5)")
    _raises_everywhere(lambda: compressed_allreduce(torch.ones(8), TopKCompressor(0.5), comm=comm, step=rank),
                       comm, "step differs")
    parts = [np.ones(rank + 1, dtype=np.float32 if rank else np.float64)]
    _raises_everywhere(lambda: ring_allgatherv(parts, comm), comm, "dtypes differs")


@pytest.mark.mpi(min_size=1)
def test_checks_can_be_turned_off_and_back():
    assert checks_enabled()
    with checking(False):
        assert not checks_enabled()
        x = np.ones(3)
        ring_allreduce(x, comm=MPI.COMM_WORLD)
        assert (x == MPI.COMM_WORLD.Get_size()).all()
    assert checks_enabled()
    set_checks(False)
    set_checks(True)
    assert checks_enabled()


def test_with_checks_off_a_bad_buffer_is_this_ranks_own_error():
    with checking(False), pytest.raises(TypeError, match="unsupported dtype"):
        ring_allreduce(np.ones(3, dtype=np.complex64), comm=MPI.COMM_SELF)


@pytest.mark.mpi(min_size=2)
def test_a_part_numpy_cannot_read_on_one_rank_raises_on_every_rank():
    """ring_allgatherv read its parts' dtypes before its check: a part numpy
    cannot read (a bfloat16 tensor, a ragged list) raised on that rank alone
    while the others waited in the ring until the watchdog (a review,
    2026-12-01)."""
    comm = MPI.COMM_WORLD
    mine = comm.Get_rank() == comm.Get_size() - 1
    for bad in (torch.ones(3, dtype=torch.bfloat16), [[1.0], [1.0, 2.0]]):
        parts = [bad if mine else np.ones(3, np.float32)]
        _raises_everywhere(lambda: ring_allgatherv(parts, comm), comm, "parts numpy can read")


@pytest.mark.mpi(min_size=2)
def test_compressed_allreduce_refuses_one_ranks_step_or_residuals_on_every_rank():
    """A step of infinity (int() raises OverflowError, which the check did
    not catch), a residual kept for another tensor (a stale rank's state),
    or a memory that is no ErrorFeedback, on one rank: each raised there
    alone, after the check, while the others waited (a review, 2026-12-01)."""
    from hpcjobs.compression import ErrorFeedback

    comm = MPI.COMM_WORLD
    mine = comm.Get_rank() == comm.Get_size() - 1
    c = TopKCompressor(0.5)
    step = float("inf") if mine else 0
    _raises_everywhere(lambda: compressed_allreduce(torch.ones(8), c, comm=comm, step=step), comm,
                       "step must be an integer")
    stale = ErrorFeedback()
    if mine:
        stale.residuals["w"] = torch.zeros(3)
    _raises_everywhere(lambda: compressed_allreduce(torch.ones(8), c, stale, name="w", comm=comm), comm,
                       "residual is torch.float32(3,)")
    memory = {} if mine else ErrorFeedback()
    _raises_everywhere(lambda: compressed_allreduce(torch.ones(8), c, memory, name="w", comm=comm), comm,
                       "memory must be an hpcjobs.compression.ErrorFeedback")
