"""Symmetric buffers and shm's zero-copy path: against the closed form and
MPI_Allreduce, the same bits as the staged path, and the fall-back to the
staged path on every rank whenever the ranks' buffers do not line up."""

import numpy as np
import pytest
from mpi4py import MPI

from conftest import BUFFERS, COUNT_LABELS, OPS, check_allreduce, count_for, RankInputs
from hpcjobs.collectives import (
    allreduce,
    chunk_bounds,
    shm,
    shm_allgather,
    shm_allreduce,
    shm_reduce_scatter,
    symmetric_empty,
    symmetric_free,
)
from hpcjobs.collectives.symmetric import is_symmetric, spans
from hpcjobs.comm import private


@pytest.fixture
def zero_copy_calls(monkeypatch):
    """How many shm calls on this rank took the zero-copy path (a list to read its len)."""
    calls = []
    real = shm._two_shot

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(shm, "_two_shot", spy)
    return calls


def _symmetric_holding(values, dtype, framework, comm):
    if framework == "torch" or dtype == "bfloat16":
        import torch

        buf = symmetric_empty(values.shape, getattr(torch, dtype), comm)
        buf.copy_(torch.from_numpy(np.ascontiguousarray(values)).to(getattr(torch, dtype)))
        return buf
    buf = symmetric_empty(values.shape, dtype, comm)
    buf[...] = values
    return buf


def _all_ranks(flag: bool, comm) -> tuple[bool, bool]:
    """(every rank's flag, any rank's flag)."""
    return bool(comm.allreduce(int(flag), op=MPI.MIN)), bool(comm.allreduce(int(flag), op=MPI.MAX))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("count_label", COUNT_LABELS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("framework,dtype", BUFFERS, ids=[f"{f}-{d}" for f, d in BUFFERS])
def test_zero_copy_matches_closed_form_and_mpi(framework, dtype, op, count_label, comm, zero_copy_calls):
    size, rank = comm.Get_size(), comm.Get_rank()
    count = count_for(count_label, size)
    inputs = RankInputs(size, count, dtype, op)
    buf = _symmetric_holding(inputs[rank], dtype, framework, comm)
    try:
        assert allreduce(buf, op, "shm", comm) is buf
        check_allreduce(buf, inputs, op, dtype, comm)
        # one rank or no elements: nothing runs at all
        assert len(zero_copy_calls) == (1 if size > 1 and count > 0 else 0)
    finally:
        symmetric_free(buf)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_zero_copy_gives_the_staged_paths_bits(op, comm, zero_copy_calls):
    # Float sums over 3+ ranks round by order; both paths add in the same one.
    rank = comm.Get_rank()
    values = np.random.default_rng([5, rank]).standard_normal(100_003).astype(np.float32)
    staged = values.copy()
    shm_allreduce(staged, op, comm, block_bytes=4096)
    assert zero_copy_calls == []
    buf = symmetric_empty(values.size, np.float32, comm)
    buf[...] = values
    shm_allreduce(buf, op, comm, block_bytes=4096)
    assert len(zero_copy_calls) == (comm.Get_size() > 1)
    np.testing.assert_array_equal(buf, staged)
    symmetric_free(buf)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("count", [0, 1, 5, 100_003])
def test_zero_copy_reduce_scatter_then_allgather(count, comm, zero_copy_calls):
    size, rank = comm.Get_size(), comm.Get_rank()
    buf = symmetric_empty(count, np.int64, comm)
    buf[...] = (np.arange(count) + 3 * rank) % 11
    before = buf.copy()
    want = buf.copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.MAX)
    shm_reduce_scatter(buf, "max", comm)
    b = chunk_bounds(count, size)
    np.testing.assert_array_equal(buf[b[rank]:b[rank + 1]], want[b[rank]:b[rank + 1]])
    outside = np.ones(count, bool)
    outside[b[rank]:b[rank + 1]] = False
    np.testing.assert_array_equal(buf[outside], before[outside])  # the rest left as it was
    shm_allgather(buf, comm)
    np.testing.assert_array_equal(buf, want)
    assert len(zero_copy_calls) == (2 if size > 1 and count > 0 else 0)
    symmetric_free(buf)


@pytest.mark.mpi(min_size=2)
def test_mixed_buffers_take_the_staged_path_on_every_rank(comm, zero_copy_calls):
    size, rank = comm.Get_size(), comm.Get_rank()
    alloc = symmetric_empty(1000, np.int64, comm)
    # rank 0 passes a symmetric buffer, the others private arrays
    buf = alloc if rank == 0 else np.empty(1000, np.int64)
    buf[...] = np.arange(1000) + rank
    shm_allreduce(buf, "sum", comm)
    np.testing.assert_array_equal(buf, np.arange(1000) * size + size * (size - 1) // 2)
    # every rank symmetric, but at different offsets (legal in MPI: each rank its own buffer)
    alloc[...] = rank
    view = alloc[rank:rank + 500]
    shm_allreduce(view, "max", comm)
    np.testing.assert_array_equal(view, np.full(500, size - 1))
    assert _all_ranks(len(zero_copy_calls) == 0, comm) == (True, True)
    # the same offset everywhere: zero-copy, and the rest of the allocation untouched
    alloc[...] = rank
    view = alloc[100:600]
    shm_allreduce(view, "sum", comm)
    np.testing.assert_array_equal(view, np.full(500, size * (size - 1) // 2))
    assert (alloc[:100] == rank).all() and (alloc[600:] == rank).all()
    assert len(zero_copy_calls) == (size > 1)
    symmetric_free(alloc)


@pytest.mark.mpi(min_size=2)
def test_an_allocation_on_world_serves_a_sub_communicator_and_not_the_reverse(split_comm, zero_copy_calls):
    world = MPI.COMM_WORLD
    big = symmetric_empty(64, np.float64)  # on COMM_WORLD
    big[...] = world.Get_rank()
    members = [r for r in range(world.Get_size()) if r % 2 == world.Get_rank() % 2]
    shm_allreduce(big, "sum", split_comm)  # ranks translated into the sub-communicator
    np.testing.assert_array_equal(big, np.full(64, float(sum(members))))
    assert len(zero_copy_calls) == (len(members) > 1)
    symmetric_free(big)
    small = symmetric_empty(64, np.float64, split_comm)  # each half its own
    assert spans(private(split_comm)) and not spans(private(world))
    small[...] = 1.0
    shm_allreduce(small, "sum", world)  # no allocation spans world: staged, no exchange
    np.testing.assert_array_equal(small, np.full(64, float(world.Get_size())))
    assert len(zero_copy_calls) == (len(members) > 1)
    symmetric_free(small)


@pytest.mark.mpi(min_size=2)
def test_auto_on_symmetric_buffers_is_exact(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = symmetric_empty(1 << 20, np.int32, comm)
    right = []
    for _ in range(40):  # through auto's measuring calls and past them
        buf[...] = rank + 1
        allreduce(buf, "sum", "auto", comm)
        right.append(bool((buf == size * (size + 1) // 2).all()))
    symmetric_free(buf)
    assert all(right), right


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_are_refused_on_every_rank(comm):
    rank = comm.Get_rank()
    if comm.Get_size() == 1:
        pytest.skip("a rank alone on its half of the split has nobody to disagree with")
    with pytest.raises(ValueError, match="different shapes or dtypes"):
        symmetric_empty(10 + (rank == 0), np.float32, comm)
    with pytest.raises(ValueError, match="different shapes or dtypes"):
        symmetric_empty(10, np.float32 if rank else np.int32, comm)
    with pytest.raises(ValueError, match="different shapes or dtypes"):  # the same bytes, another shape
        symmetric_empty((2, 3) if rank else (3, 2), np.float32, comm)
    # a refusal on one rank reaches every rank (alone, it left the others waiting in the next step)
    with pytest.raises(ValueError, match="negative dimension" if rank == 0 else "another rank's shape or dtype"):
        symmetric_empty(-1 if rank == 0 else 4, np.float32, comm)


@pytest.mark.mpi(min_size=1)
def test_free_and_the_communicators_free_release_the_allocation():
    sub = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
    a = symmetric_empty((4, 8), np.float32, sub)
    b = symmetric_empty(16, np.int64, sub)
    assert a.shape == (4, 8) and a.flags.c_contiguous and is_symmetric(a) and is_symmetric(a[1])
    assert not is_symmetric(np.zeros(4))
    symmetric_free(a)
    assert not is_symmetric(a) and is_symmetric(b)
    with pytest.raises(ValueError, match="not in a live symmetric allocation"):
        symmetric_free(np.zeros(4))
    sub.Free()  # takes b with it
    assert not spans(private(MPI.COMM_WORLD))
    with pytest.raises(ValueError, match="not in a live symmetric allocation"):
        symmetric_free(np.zeros(4))


def test_bad_dtype_and_shape_are_refused():
    with pytest.raises(TypeError, match="unsupported dtype"):
        symmetric_empty(4, np.complex64)
    with pytest.raises(TypeError, match="unsupported dtype"):
        symmetric_empty(4, "no-such-type")
    with pytest.raises(ValueError, match="negative"):
        symmetric_empty((2, -1), np.float32)


def test_torch_dtypes_give_tensors_over_the_window():
    import torch

    t = symmetric_empty((2, 3), torch.bfloat16)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.shape == (2, 3)
    assert is_symmetric(t)
    symmetric_free(t)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("count", [7, 100_003])
def test_hierarchical_intra_node_stage_runs_zero_copy(count, zero_copy_calls):
    from hpcjobs.collectives import hierarchical_allreduce
    from hpcjobs.topology import detect

    world = MPI.COMM_WORLD
    topo = detect(ranks_per_node=2)
    buf = symmetric_empty(count, np.float64)
    buf[...] = np.arange(count) + world.Get_rank()
    want = buf.copy()
    world.Allreduce(MPI.IN_PLACE, want)
    hierarchical_allreduce(buf, "sum", topology=topo, intra="shm")
    np.testing.assert_array_equal(buf, want)
    if world.Get_size() % 2 == 0:  # equal nodes: reduce-scatter and allgather inside each, both zero-copy
        assert len(zero_copy_calls) == 2
    symmetric_free(buf)
