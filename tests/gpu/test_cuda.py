"""Every collective on CUDA tensors, on a real GPU (marked ``cuda``: skipped
without one). scripts/gpu_check.sh runs these at 2, 3 and 4 ranks sharing
one GPU. References: the closed form and MPI_Allreduce on host copies."""

import numpy as np
import pytest
from mpi4py import MPI

from conftest import check_allreduce, from_float64, rank_input
from hpcjobs.collectives import (ALGORITHMS, DEVICE_ALGORITHMS, allreduce, auto, chunk_bounds, cuda_ipc_allreduce,
                                 cuda_ipc, hierarchical_allreduce, ring_allgather, ring_reduce_scatter, staged)
from hpcjobs.collectives.agreement import MismatchError
from hpcjobs.comm import private

pytestmark = pytest.mark.cuda

OPS = ("sum", "avg", "min", "max", "prod")
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    import torch

    torch.cuda.set_device(0)  # every rank on the one GPU here (all ranks share it)
    yield


def _cuda(values, dtype):
    import torch

    t = from_float64(values, dtype)
    t = t if isinstance(t, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(t))
    return t.to("cuda")


def _host(t):
    import torch

    torch.cuda.synchronize()
    return t.cpu()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["auto", *ALGORITHMS, *DEVICE_ALGORITHMS, "cuda_ipc/two-shot"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_algorithm_on_cuda_tensors(algorithm, op, dtype, monkeypatch):
    if algorithm == "cuda_ipc/two-shot":
        monkeypatch.setattr(cuda_ipc, "ONE_SHOT_BYTES", 0)
        algorithm = "cuda_ipc"
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    outs = []
    for count in (0, 1, size + 1, 300_007):
        inputs = [rank_input(r, count, dtype, op, seed=count) for r in range(size)]
        t = _cuda(inputs[comm.Get_rank()], dtype)
        assert allreduce(t, op, algorithm, comm) is t
        outs.append((t, inputs))
    for t, inputs in outs:
        check_allreduce(_host(t), inputs, op, dtype, comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("nbytes", [4, 4096, 1 << 20, 64 << 20])
@pytest.mark.parametrize("fence", ["events", "host"])
def test_cuda_ipc_many_calls_back_to_back_and_a_late_rank(nbytes, fence, monkeypatch):
    monkeypatch.setenv("HPCJOBS_CUDA_IPC_SYNC", fence)
    import time

    import torch

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    count = nbytes // 4
    outs = []
    for i in range(8):
        if rank == i % size:
            time.sleep(0.01)
        t = torch.full((count,), float(rank + i), device="cuda")
        cuda_ipc_allreduce(t, "sum", comm)
        outs.append((t, sum(r + i for r in range(size))))
    torch.cuda.synchronize()
    for t, want in outs:
        assert bool((t == want).all())


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_hierarchical_cuda_ipc_across_simulated_nodes(op):
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if size % 2:
        pytest.skip("uniform nodes of two ranks")
    for count in (1, 7, 1_000_003):
        inputs = [rank_input(r, count, "float32", op, seed=count) for r in range(size)]
        t = _cuda(inputs[comm.Get_rank()], "float32")
        hierarchical_allreduce(t, op, comm, intra="cuda_ipc", ranks_per_node=2)
        check_allreduce(_host(t), inputs, op, "float32", comm)


@pytest.mark.mpi(min_size=2)
def test_reduce_scatter_and_allgather_stage_cuda_tensors_whole():
    import torch

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    t = torch.arange(1001, dtype=torch.float64, device="cuda") * (rank + 1)
    ring_reduce_scatter(t, "sum", comm)
    b = chunk_bounds(1001, size)
    want = np.arange(1001) * size * (size + 1) / 2
    np.testing.assert_array_equal(_host(t)[b[rank]:b[rank + 1]].numpy(), want[b[rank]:b[rank + 1]])
    ring_allgather(t, comm)
    np.testing.assert_array_equal(_host(t).numpy(), want)


@pytest.mark.mpi(min_size=2)
def test_a_rank_on_the_host_and_one_on_the_gpu_fail_together():
    import torch

    comm = MPI.COMM_WORLD
    t = torch.ones(10, device="cuda" if comm.Get_rank() == 0 else "cpu")
    with pytest.raises(MismatchError, match="device differs"):
        allreduce(t, "sum", "ring", comm)


@pytest.mark.mpi(min_size=2)
def test_bad_device_buffers_fail_on_every_rank():
    import torch

    comm = MPI.COMM_WORLD
    t = torch.ones(20, device="cuda")
    bad = t[::2] if comm.Get_rank() == 1 else t[:10]
    with pytest.raises(MismatchError, match="contiguous"):
        allreduce(bad, "sum", "cuda_ipc", comm)
    with pytest.raises(TypeError, match="uint32"):
        cuda_ipc_allreduce(torch.ones(8, dtype=torch.uint32, device="cuda"), "sum", comm)
    u = torch.full((1000,), comm.Get_rank() + 1, dtype=torch.uint32, device="cuda")
    allreduce(u, "sum", "auto", comm)  # staged: the host reduces uint32
    assert bool((_host(u) == comm.Get_size() * (comm.Get_size() + 1) // 2).all())


@pytest.mark.mpi(min_size=2)
def test_auto_on_cuda_settles_on_a_device_transport():
    import torch

    comm = MPI.COMM_WORLD
    auto.remeasure()
    for nbytes in (64, 1 << 22):
        t = torch.ones(nbytes // 4, device="cuda")
        while not auto.settled(t, "sum", comm):
            t.fill_(1)
            allreduce(t, "sum", "auto", comm)
        t.fill_(1)
        allreduce(t, "sum", "auto", comm)
        assert bool((_host(t) == comm.Get_size()).all())
        assert auto.kept(nbytes, "float32", "sum", comm, device=True) in ("cuda_ipc", "staged")
    assert staged.pinned_bytes(private(comm)) > 0
