"""The device transports' logic on CPU memory standing in for the GPU's.

``staged`` and ``cuda_ipc`` take a DeviceFlat; over a CPU tensor their
chunking, pipelining, sharding, fences and buffer alternation run as on a
GPU (streams and events are no-ops, IPC handles become an MPI shared
window). The CUDA runs of the same paths are in tests/gpu/test_cuda.py.
"""

import functools

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcjobs.collectives import auto, chunk_bounds, cuda_ipc, hierarchical, ring, recursive_doubling, staged
from hpcjobs.collectives.device import DeviceFlat
from hpcjobs.collectives.select import DEVICE_REGISTRY
from hpcjobs.comm import private
from conftest import check_allreduce, from_float64, RankInputs

DTYPES = ("float32", "float64", "bfloat16", "int64", "float16")
OPS = ("sum", "avg", "min", "max", "prod")


def _flat(values, dtype):
    t = from_float64(values, dtype)
    t = t if isinstance(t, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(t))
    return DeviceFlat(t, dtype)


def _inputs(size, count, dtype, op, seed=7):
    return RankInputs(size, count, dtype, op, seed)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_bytes", [8, 100, 1 << 20])
def test_staged_pipeline_of_chunks_equals_one_allreduce(op, dtype, chunk_bytes):
    comm = private(MPI.COMM_WORLD)
    size = comm.Get_size()
    results = []
    for count in (1, size + 1, 1001):
        inputs = _inputs(size, count, dtype, op)
        flat = _flat(inputs[comm.Get_rank()], dtype)
        staged.allreduce(flat, op, comm, ring.allreduce, chunk_bytes=chunk_bytes)
        results.append((flat.tensor, inputs))
    for out, inputs in results:
        check_allreduce(out, inputs, op, dtype, MPI.COMM_WORLD)


@pytest.mark.mpi(min_size=2)
def test_staged_slots_are_bounded_and_reused():
    sub = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
    comm = private(sub)
    flat = DeviceFlat(torch.ones(10_000, dtype=torch.float64), "float64")
    staged.allreduce(flat, "sum", comm, recursive_doubling.allreduce, chunk_bytes=4096)
    held = staged.pinned_bytes(comm)
    assert held == staged.SLOTS * 4096
    staged.allreduce(flat, "sum", comm, recursive_doubling.allreduce, chunk_bytes=1024)
    assert staged.pinned_bytes(comm) == held  # smaller chunks reuse the slots
    assert (flat.tensor == comm.Get_size() ** 2).all()
    pool = comm.Get_attr(staged._KEYVAL)
    sub.Free()
    assert pool.slots == []


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("one_shot_bytes", [0, 1 << 30], ids=["two-shot", "one-shot"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ipc_steps_on_shared_memory_stand_in(op, dtype, one_shot_bytes, monkeypatch):
    monkeypatch.setattr(cuda_ipc, "ONE_SHOT_BYTES", one_shot_bytes)
    comm = private(MPI.COMM_WORLD)
    size = comm.Get_size()
    results = []
    for count in (0, 1, size + 1, 10_007, 3):  # back to back: both staging buffers, and a grown one
        inputs = _inputs(size, count, dtype, op, seed=count)
        flat = _flat(inputs[comm.Get_rank()], dtype)
        cuda_ipc.allreduce(flat, op, comm)
        results.append((flat.tensor, inputs))
    for out, inputs in results:
        check_allreduce(out, inputs, op, dtype, MPI.COMM_WORLD)


@pytest.mark.mpi(min_size=2)
def test_cuda_ipc_pieces_larger_than_its_buffers(monkeypatch):
    monkeypatch.setattr(cuda_ipc, "CAPACITY", 1 << 20)
    comm = private(MPI.COMM_WORLD)
    size = comm.Get_size()
    inputs = _inputs(size, 300_001, "float64", "sum")
    flat = _flat(inputs[comm.Get_rank()], "float64")
    cuda_ipc.allreduce(flat, "sum", comm)
    assert cuda_ipc.device_bytes(comm) <= 2 << 20
    check_allreduce(flat.tensor, inputs, "sum", "float64", MPI.COMM_WORLD)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [1, 5, 10_003])
def test_cuda_ipc_reduce_scatter_then_allgather(count):
    comm = private(MPI.COMM_WORLD)
    size, rank = comm.Get_size(), comm.Get_rank()
    t = (torch.arange(count, dtype=torch.int64) + 3 * rank) % 11
    want = t.numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.MAX)
    cuda_ipc.reduce_scatter(DeviceFlat(t, "int64"), "max", comm)
    b = chunk_bounds(count, size)
    np.testing.assert_array_equal(t[b[rank]:b[rank + 1]].numpy(), want[b[rank]:b[rank + 1]])
    cuda_ipc.allgather(DeviceFlat(t, "int64"), comm)
    np.testing.assert_array_equal(t.numpy(), want)


@pytest.mark.mpi(min_size=2)
def test_a_cuda_ipc_failure_leaves_the_host_stand_in_working():
    """A communicator remembers that CUDA IPC could not be opened (every
    later CUDA call falls back at once); that says nothing of the host
    stand-in, which the same communicator still runs."""
    comm = private(MPI.COMM_WORLD)
    t = torch.arange(6, dtype=torch.float64) * (comm.Get_rank() + 1)
    cuda_ipc.allreduce(DeviceFlat(t, "float64"), "sum", comm)  # the communicator's state exists now
    state = comm.Get_attr(cuda_ipc._KEYVAL)
    state.failed[True] = "rank 1 cannot open rank 0's CUDA IPC handle (as on a GPU that forbids it)"
    try:
        t = torch.arange(6, dtype=torch.float64) * (comm.Get_rank() + 1)
        cuda_ipc.allreduce(DeviceFlat(t, "float64"), "sum", comm)
        size = comm.Get_size()
        np.testing.assert_array_equal(t.numpy(), np.arange(6) * size * (size + 1) / 2)
    finally:
        del state.failed[True]


def test_cuda_ipc_refuses_what_it_cannot_reduce():
    comm = private(MPI.COMM_SELF)
    with pytest.raises(TypeError, match="uint32"):
        cuda_ipc.allreduce(DeviceFlat(torch.zeros(4, dtype=torch.uint32), "uint32"), "sum", comm)
    with pytest.raises(ValueError, match="CUDA tensors"):
        cuda_ipc.allreduce(np.zeros(4), "sum", comm)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("count", [1, 7, 40_001])
def test_hierarchical_on_device_two_levels(op, count):
    """Simulated nodes of two ranks: cuda_ipc inside, staged across."""
    comm = private(MPI.COMM_WORLD)
    size = comm.Get_size()
    if size % 2:
        pytest.skip("uniform nodes of two ranks")
    inputs = _inputs(size, count, "float64", op)
    flat = _flat(inputs[comm.Get_rank()], "float64")
    hierarchical.allreduce(flat, op, comm, inter="ring", intra="cuda_ipc", ranks_per_node=2)
    check_allreduce(flat.tensor, inputs, op, "float64", MPI.COMM_WORLD)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("segment_bytes", [0, 4096])
def test_hierarchical_on_device_stages_its_host_chunks_in_the_segments_asked_for(segment_bytes, monkeypatch):
    """segment_bytes reached the host buffer's two levels, not a device
    buffer's staged chunks: 0 did not turn pipelining off there."""
    comm = private(MPI.COMM_WORLD)
    real, seen = hierarchical.allreduce, []

    def spy(flat, *args, **kw):
        if not isinstance(flat, DeviceFlat):
            seen.append(kw.get("segment_bytes"))
        return real(flat, *args, **kw)

    monkeypatch.setattr(hierarchical, "allreduce", spy)
    inputs = _inputs(comm.Get_size(), 40_001, "float64", "sum")
    flat = _flat(inputs[comm.Get_rank()], "float64")
    real(flat, "sum", comm, inter="ring", intra="ring", ranks_per_node=1, segment_bytes=segment_bytes)
    check_allreduce(flat.tensor, inputs, "sum", "float64", MPI.COMM_WORLD)
    assert seen and set(seen) == {segment_bytes}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("nbytes", [64, 1 << 20])
def test_auto_measures_the_device_transports_and_keeps_one(nbytes):
    comm = private(MPI.COMM_WORLD)
    auto.remeasure()
    count = nbytes // 8
    want = np.full(count, comm.Get_size() * (comm.Get_size() + 1) // 2, dtype=np.int64)
    outs = []
    for _ in range(2 * (auto.UNTIMED_TURNS + auto.timed_rounds(nbytes)) + 1):
        t = torch.full((count,), comm.Get_rank() + 1, dtype=torch.int64)
        auto.allreduce_device(DeviceFlat(t, "int64"), "sum", comm, DEVICE_REGISTRY)
        outs.append(t)
    for t in outs:
        np.testing.assert_array_equal(t.numpy(), want)
    kept = auto.kept(nbytes, "int64", "sum", MPI.COMM_WORLD, device=True)
    assert kept in ("cuda_ipc", "staged")


def test_device_candidates_put_staged_first_for_small_and_alone_for_uint():
    assert auto.device_candidates(64, "float32", True) == ["staged", "cuda_ipc"]
    assert auto.device_candidates(1 << 20, "float32", True) == ["staged", "cuda_ipc"]
    assert auto.device_candidates(2 << 20, "float32", True) == ["cuda_ipc", "staged"]
    assert auto.device_candidates(2 << 20, "float32", False) == ["hierarchical", "staged"]
    assert auto.device_candidates(2 << 20, "uint32", True) == ["staged"]


@pytest.mark.mpi(min_size=2)
def test_staged_whole_runs_a_step_that_is_not_elementwise():
    comm = private(MPI.COMM_WORLD)
    size, rank = comm.Get_size(), comm.Get_rank()
    t = torch.arange(10, dtype=torch.float64) * (rank + 1)
    staged.whole(DeviceFlat(t, "float64"), "sum", comm, functools.partial(ring.reduce_scatter, segment_bytes=None))
    b = chunk_bounds(10, size)
    want = np.arange(10) * size * (size + 1) / 2
    np.testing.assert_array_equal(t[b[rank]:b[rank + 1]].numpy(), want[b[rank]:b[rank + 1]])


@pytest.mark.mpi(min_size=4)
def test_hierarchical_falls_back_together_when_ipc_fails_on_one_node_only(monkeypatch):
    """IPC refused on the second simulated node alone: every rank must take
    the staged path (a rank alone on cuda_ipc would wait for ever)."""
    comm = private(MPI.COMM_WORLD)
    size = comm.Get_size()
    if size % 2:
        pytest.skip("uniform nodes of two ranks")
    real = cuda_ipc.unavailable
    monkeypatch.setattr(cuda_ipc, "unavailable", lambda c, n, like: "refused here" if MPI.COMM_WORLD.Get_rank() in (2, 3)
                        else real(c, n, like))
    calls = []
    monkeypatch.setattr(cuda_ipc, "reduce_scatter", lambda *a: calls.append(a))  # must not be reached
    inputs = _inputs(size, 1001, "float64", "sum")
    flat = _flat(inputs[comm.Get_rank()], "float64")
    hierarchical.allreduce(flat, "sum", comm, inter="ring", intra="cuda_ipc", ranks_per_node=2)
    assert calls == []
    check_allreduce(flat.tensor, inputs, "sum", "float64", MPI.COMM_WORLD)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32"])
@pytest.mark.parametrize("size", [3, 127, 128, 255, 256, 300])
def test_the_device_average_of_integers_is_the_hosts(dtype, size):
    """divide on a device (here a CPU tensor) floors as finish_avg does on the
    host; with more ranks than the dtype counts to, torch cast the size to it
    (int8 128 became -128, uint8 256 a division by 0)."""
    from hpcjobs.collectives._buffers import finish_avg
    from hpcjobs.collectives.device import divide

    values = np.array([100, -100, 5, -5, 0, 127, -128] if dtype != "uint8" else [100, 200, 5, 0, 255], dtype=dtype)
    host = values.copy()
    finish_avg(host, dtype, size)
    t = torch.from_numpy(values.copy())
    divide(t, dtype, size)
    assert t.tolist() == host.tolist()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("call", ["cuda_ipc_allreduce", "allreduce(algorithm='cuda_ipc')"])
@pytest.mark.parametrize("buf", ["numpy", "cpu tensor"])
def test_cuda_ipc_refuses_a_host_buffer_on_every_rank_and_on_one(call, buf):
    """The documented ValueError, on one rank too (where the step never runs:
    the call returned the buffer untouched)."""
    from hpcjobs.collectives import allreduce, cuda_ipc_allreduce

    b = np.ones(4) if buf == "numpy" else torch.ones(4)
    with pytest.raises(ValueError, match="host memory"):
        if call == "cuda_ipc_allreduce":
            cuda_ipc_allreduce(b, "sum", MPI.COMM_WORLD)
        else:
            allreduce(b, "sum", "cuda_ipc", MPI.COMM_WORLD)
