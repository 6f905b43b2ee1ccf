"""Ring allreduce, reduce-scatter and allgather against closed forms and MPI_Allreduce.

Run under mpirun (``--with-mpi``/``--only-mpi``) at several sizes; at size 1
(plain pytest --with-mpi) the same tests check the single-rank path.
"""

import numpy as np
import pytest
from mpi4py import MPI

from conftest import ALL_BUFFERS as BUFFERS
from conftest import COUNT_LABELS, OPS, check_allreduce, count_for, make_buffer, mpi_reference, RankInputs, rank_input
from hpcjobs.collectives import chunk_bounds, ring_allgather, ring_allreduce, ring_reduce_scatter

MODES = ("plain", "pipelined")


def _mode_kwargs(mode: str, count: int, itemsize: int, size: int) -> dict:
    if mode == "plain":
        return {}
    # About three segments per chunk, the last one short, so the double
    # buffering, the ragged tail and the handoff between rounds all run.
    return {"pipeline": True, "segment_bytes": max(1, count * itemsize // (3 * size + 1))}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("count_label", COUNT_LABELS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("framework,dtype", BUFFERS, ids=[f"{f}-{d}" for f, d in BUFFERS])
def test_ring_allreduce_matches_closed_form_and_mpi(framework, dtype, op, count_label, mode, comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    count = count_for(count_label, size)
    inputs = RankInputs(size, count, dtype, op)
    buf = make_buffer(inputs[rank], dtype, framework)
    itemsize = buf.element_size() if framework == "torch" else buf.itemsize

    out = ring_allreduce(buf, op, comm, **_mode_kwargs(mode, count, itemsize, size))

    assert out is buf
    assert tuple(out.shape) == (count,)
    check_allreduce(out, inputs, op, dtype, comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_tens_of_millions_of_elements(mode):
    comm = MPI.COMM_WORLD
    count = 20_000_003
    buf = np.full(count, comm.Get_rank() + 1, dtype=np.float32)
    buf[::7] = -1.0
    ring_allreduce(buf, "sum", comm, pipeline=(mode == "pipelined"))
    P = comm.Get_size()
    assert buf[0] == -P and buf[1] == P * (P + 1) / 2
    assert np.count_nonzero(buf == -P) == len(range(0, count, 7))
    assert np.count_nonzero(buf == P * (P + 1) / 2) == count - len(range(0, count, 7))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("count_label", COUNT_LABELS)
@pytest.mark.parametrize("op", OPS)
def test_reduce_scatter_leaves_chunk_r_reduced_on_rank_r(op, count_label, comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    count = count_for(count_label, size)
    inputs = [rank_input(r, count, "int64", op) for r in range(size)]
    buf = inputs[rank].copy()

    ring_reduce_scatter(buf, op, comm)

    b = chunk_bounds(count, size)
    want = mpi_reference(inputs[rank], "int64", op, comm)
    np.testing.assert_array_equal(buf[b[rank]:b[rank + 1]], want[b[rank]:b[rank + 1]])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("count_label", COUNT_LABELS)
def test_allgather_fills_every_chunk_from_its_owner(count_label, comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    count = count_for(count_label, size)
    b = chunk_bounds(count, size)
    buf = np.full(count, -1, dtype=np.int32)
    buf[b[rank]:b[rank + 1]] = np.arange(b[rank], b[rank + 1]) * 10 + rank

    ring_allgather(buf, comm)

    owner = np.repeat(np.arange(size), np.diff(b))
    np.testing.assert_array_equal(buf, np.arange(count) * 10 + owner)


@pytest.mark.mpi(min_size=2)
def test_private_duplicate_keeps_user_messages_apart():
    # A user message in flight on COMM_WORLD with the tag the ring uses must
    # neither be consumed by the ring nor corrupt it.
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    note = np.array([1000 + rank], dtype=np.int64)
    req = comm.Isend(note, dest=(rank + 1) % size, tag=7)
    buf = np.arange(10, dtype=np.int64) + rank

    ring_allreduce(buf, "sum", comm)

    got = np.empty(1, dtype=np.int64)
    comm.Recv(got, source=(rank - 1) % size, tag=7)
    req.Wait()
    assert got[0] == 1000 + (rank - 1) % size
    np.testing.assert_array_equal(buf, np.arange(10) * size + size * (size - 1) // 2)


@pytest.mark.mpi(min_size=1)
def test_torch_tensor_requiring_grad_is_reduced_in_place():
    torch = pytest.importorskip("torch")
    comm = MPI.COMM_WORLD
    t = torch.full((3, 4), float(comm.Get_rank()), requires_grad=True)
    ptr = t.data_ptr()
    ring_allreduce(t, "sum", comm)
    assert t.data_ptr() == ptr
    assert torch.all(t == sum(range(comm.Get_size())))


@pytest.mark.mpi(min_size=1)
def test_fortran_ordered_and_multidimensional_arrays_are_reduced_elementwise():
    comm = MPI.COMM_WORLD
    a = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4) * (comm.Get_rank() + 1))
    ring_allreduce(a, "sum", comm)
    P = comm.Get_size()
    np.testing.assert_array_equal(a, np.arange(12).reshape(3, 4) * P * (P + 1) / 2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", [False, True])
def test_second_call_allocates_no_full_size_copy(mode):
    import tracemalloc

    comm = MPI.COMM_WORLD
    buf = np.ones(1 << 20, dtype=np.float64)  # 8 MB
    ring_allreduce(buf, "sum", comm, pipeline=mode)  # warms the scratch space
    tracemalloc.start()
    ring_allreduce(buf, "sum", comm, pipeline=mode)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < buf.nbytes // 100, f"pipeline={mode}: {peak} bytes allocated"
