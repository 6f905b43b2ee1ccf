"""compressed_allreduce across ranks equals the same arithmetic done in one
process on every rank's tensor; wire bytes are what the payloads weigh."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcjobs.collectives import ring_allgatherv
from hpcjobs.collectives.agreement import MismatchError
from hpcjobs.compression import (BF16Compressor, ErrorFeedback, FP16Compressor, NoneCompressor,
                                 PowerSGDCompressor, QSGDCompressor, RandomKCompressor, SignCompressor,
                                 TopKCompressor, compressed_allreduce)

ALLGATHERED = {"topk": lambda: TopKCompressor(0.05), "qsgd": lambda: QSGDCompressor(8), "sign": SignCompressor}
SUMMABLE = {"none": NoneCompressor, "fp16": FP16Compressor, "bf16": BF16Compressor,
            "randomk": lambda: RandomKCompressor(0.1, seed=5)}


def _tensors(size, shape=(37, 11)):
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(10 + q)) for q in range(size)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("key", list(ALLGATHERED))
def test_allgathered_payloads_equal_one_process_bitwise(key):
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ts = _tensors(size)
    torch.manual_seed(rank)  # QSGD's rounding noise, rank by rank
    c = ALLGATHERED[key]()
    got, sent = compressed_allreduce(ts[rank], c, name="w", comm=comm)
    want = None
    for q, t in enumerate(ts):
        torch.manual_seed(q)
        d = c.decompress(*c.compress(t, name="w"))
        want = d.clone() if want is None else want.add_(d)
    want = want / size if size > 1 else want
    assert torch.equal(got, want)
    # bytes: the P x 2 table of part sizes, then (P-1) blobs of 8-byte-padded parts
    payload, _ = c.compress(ts[rank], name="w")
    blob = sum(-(-p.nbytes // 8) * 8 for p in payload)
    assert sent == (size - 1) * (2 * 8 + blob)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("key", list(SUMMABLE))
def test_summable_payloads_equal_one_process(key):
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ts = _tensors(size)
    c = SUMMABLE[key]()
    before = ts[rank].clone()
    got, sent = compressed_allreduce(ts[rank], c, name="w", comm=comm, algorithm="ring", step=3)
    assert torch.equal(ts[rank], before)  # the input is left alone
    payloads = [c.compress(t, name="w", step=3) for t in ts]
    mean_payload = sum(p.double() for p, _ in payloads) / size
    want = c.decompress(mean_payload.to(payloads[0][0].dtype), payloads[0][1])
    tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2, "randomk": 1e-6}[key]
    assert torch.allclose(got, want, rtol=tol, atol=tol)
    n, item = payloads[0][0].numel(), payloads[0][0].element_size()
    lo, hi = 2 * (size - 1) * (n // size) * item, 2 * (size - 1) * (-(-n // size)) * item
    assert lo <= sent <= hi  # the ring: 2(P-1) chunks of the payload, chunks of whole elements


@pytest.mark.mpi(min_size=1)
def test_powersgd_equals_one_process_power_iteration():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    ts = _tensors(size, shape=(40, 30))
    c = PowerSGDCompressor(2, seed=4)
    got, sent = compressed_allreduce(ts[rank], c, name="w", comm=comm, algorithm="ring")
    ref = PowerSGDCompressor(2, seed=4)
    q0 = ref._q_for("w", 30, 0)
    p = torch.linalg.qr(sum(t @ q0 for t in ts) / size).Q
    q = sum(t.t() @ p for t in ts) / size
    assert torch.allclose(got, p @ q.t(), atol=1e-5)
    assert (sent == 0) == (size == 1)
    assert sent <= 2 * (40 + 30) * 2 * 4  # two ring allreduces of the factors, never the matrix


@pytest.mark.mpi(min_size=2)
def test_error_feedback_loses_nothing_across_ranks():
    """Summed over ranks: P * mean + residuals = gradients + old residuals."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    for c in (TopKCompressor(0.1), SignCompressor(), PowerSGDCompressor(1), RandomKCompressor(0.2)):
        mem = ErrorFeedback()
        for step in range(3):
            g = _tensors(size, shape=(20, 16))[rank] * (step + 1)
            e_old = mem.residuals.get("w", torch.zeros_like(g))
            mean, _ = compressed_allreduce(g, c, mem, name="w", comm=comm, step=step)
            lhs = np.array(((g + e_old) - mem.residuals["w"]).double().numpy())
            comm.Allreduce(MPI.IN_PLACE, lhs, op=MPI.SUM)
            np.testing.assert_allclose(lhs, size * mean.double().numpy(), atol=1e-4, err_msg=repr(c))


@pytest.mark.mpi(min_size=1)
def test_qsgd_with_error_feedback_where_it_is_no_contraction_is_warned_about(capfd):
    """Above levels² entries QSGD's variance exceeds the tensor's norm and
    error feedback's residual can grow without bound: said once, on rank 0,
    with the levels that would do; below it nothing is said."""
    comm = MPI.COMM_WORLD
    memory, c = ErrorFeedback(), QSGDCompressor(127)
    compressed_allreduce(torch.randn(100, 100), c, memory, name="small", comm=comm)  # 10,000 < 16,129
    assert "no contraction" not in capfd.readouterr().err
    for step in range(2):
        compressed_allreduce(torch.randn(200, 200), c, memory, name="big", step=step, comm=comm)
    err = capfd.readouterr().err
    assert err.count("no contraction") == (comm.rank == 0), err
    if comm.rank == 0:
        assert "qsgd:127 with error feedback on a tensor of 40,000 entries" in err and "give qsgd:201" in err
    compressed_allreduce(torch.randn(200, 200), QSGDCompressor(201), ErrorFeedback(), name="b", comm=comm)
    assert "no contraction" not in capfd.readouterr().err


@pytest.mark.mpi(min_size=1)
def test_a_negative_step_is_refused_on_every_rank():
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        compressed_allreduce(torch.ones(8), RandomKCompressor(0.5), name="x", step=-1, comm=MPI.COMM_WORLD)


@pytest.mark.mpi(min_size=1)
def test_no_compressor_sends_whole_and_unbiased_random_k_is_refused_with_error_feedback():
    """make_compressor("none") gives None, which compressed_allreduce took
    for a compressor (AttributeError: 'NoneType' object has no attribute
    'compress'); it is the whole tensor now. Unbiased random-k scales what
    it keeps by n/k, no contraction: with error feedback the residual of a
    fixed gradient grew to over 700,000 times its norm in 30 steps, silently."""
    comm = MPI.COMM_WORLD
    t = torch.arange(12.0).reshape(3, 4) * (comm.rank + 1)
    mean, sent = compressed_allreduce(t, None, comm=comm)
    assert torch.equal(mean, torch.arange(12.0).reshape(3, 4) * (comm.size + 1) / 2)
    assert mean.dtype == torch.float32 and (sent == 0) == (comm.size == 1)
    with pytest.raises((TypeError, MismatchError), match="compressor must be an hpcjobs.compression.Compressor or "
                                                         "None, got str"):
        compressed_allreduce(t, "fp16", comm=comm)
    unbiased, memory = RandomKCompressor(0.01, seed=1, unbiased=True), ErrorFeedback()
    with pytest.raises(ValueError, match=r"unbiased=True\) is no contraction: error feedback's residual grows"):
        compressed_allreduce(torch.ones(1000), unbiased, memory, name="g", comm=comm)
    g = torch.ones(1000)  # what it would do: measured with the compressor alone
    residual = torch.zeros(1000)
    for step in range(30):
        x = g + residual
        payload, ctx = unbiased.compress(x, name="g", step=step)
        residual = x - unbiased.decompress(payload, ctx)
    assert residual.norm() > 7e5 * g.norm()
    biased, _ = compressed_allreduce(torch.ones(1000), RandomKCompressor(0.01, seed=1), memory, name="g", comm=comm)
    assert biased.sum() == 10 and memory.residuals["g"].sum() == 990  # the kept 10 sent, the rest kept


@pytest.mark.mpi(min_size=1)
def test_ring_allgatherv_with_sizes_that_differ_by_rank():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    parts = [np.arange(rank, dtype=np.float32) + rank, np.full(2 * rank + 1, rank, dtype=np.int16)]
    rows = ring_allgatherv(parts, comm)
    assert len(rows) == size
    for q, (a, b) in enumerate(rows):
        assert a.dtype == np.float32 and np.array_equal(a, np.arange(q, dtype=np.float32) + q)
        assert b.dtype == np.int16 and np.array_equal(b, np.full(2 * q + 1, q, dtype=np.int16))


def test_shared_memory_algorithms_are_refused():
    with pytest.raises(ValueError, match="shared memory"):
        compressed_allreduce(torch.ones(4), FP16Compressor(), comm=MPI.COMM_SELF, algorithm="shm")
    with pytest.raises(ValueError, match="unknown algorithm"):
        compressed_allreduce(torch.ones(4), FP16Compressor(), comm=MPI.COMM_SELF, algorithm="fast")
