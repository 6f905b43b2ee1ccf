"""Error feedback: g + e_old = decompress(payload) + e_new, for every compressor."""

import pytest
import torch

from hpcjobs.compression import (BF16Compressor, ErrorFeedback, FP16Compressor, PowerSGDCompressor,
                                 QSGDCompressor, RandomKCompressor, SignCompressor, TopKCompressor,
                                 compressed_allreduce)
from mpi4py import MPI

COMPRESSORS = [FP16Compressor, BF16Compressor, lambda: TopKCompressor(0.1), lambda: RandomKCompressor(0.1),
               lambda: QSGDCompressor(4), SignCompressor, lambda: PowerSGDCompressor(1)]


@pytest.mark.parametrize("make", COMPRESSORS, ids=["fp16", "bf16", "topk", "randomk", "qsgd", "sign", "powersgd"])
def test_the_invariant_holds_step_after_step(make):
    c, mem = make(), ErrorFeedback()
    torch.manual_seed(0)
    for step in range(4):
        g = torch.randn(20, 12, dtype=torch.float64)
        e_old = mem.residuals.get("w", torch.zeros_like(g))
        x = mem.compensate("w", g)
        payload, ctx = c.compress(x, name="w", step=step)
        sent = c.decompress(payload, ctx)
        mem.update("w", x, sent)
        assert torch.allclose(g + e_old, sent + mem.residuals["w"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("make", COMPRESSORS, ids=["fp16", "bf16", "topk", "randomk", "qsgd", "sign", "powersgd"])
def test_compressed_allreduce_on_one_rank_keeps_the_invariant(make):
    c, mem = make(), ErrorFeedback()
    torch.manual_seed(1)
    for step in range(3):
        g = torch.randn(16, 10)
        e_old = mem.residuals.get("w", torch.zeros_like(g))
        mean, sent = compressed_allreduce(g, c, mem, name="w", comm=MPI.COMM_SELF, step=step)
        assert sent == 0
        assert torch.allclose(g + e_old, mean + mem.residuals["w"], atol=1e-5)


def test_state_dict_round_trip_and_a_changed_tensor_is_refused():
    mem = ErrorFeedback()
    mem.update("w", torch.ones(3), torch.zeros(3))
    other = ErrorFeedback()
    other.load_state_dict(mem.state_dict())
    assert torch.equal(other.residuals["w"], torch.ones(3))
    with pytest.raises(ValueError, match="one name, one tensor"):
        other.compensate("w", torch.ones(4))


def test_memory_needs_a_name():
    with pytest.raises(ValueError, match="name="):
        compressed_allreduce(torch.ones(3), TopKCompressor(0.5), ErrorFeedback(), comm=MPI.COMM_SELF)


@pytest.mark.parametrize("make", COMPRESSORS, ids=["fp16", "bf16", "topk", "randomk", "qsgd", "sign", "powersgd"])
def test_an_overflowed_step_keeps_the_residual_and_the_next_steps_stay_finite(make):
    """A step whose gradient holds an inf (fp16 loss scaling overflows by
    design; the caller skips that step) must not keep inf - inf = NaN as the
    residual: every later gradient would become NaN. Where the average is
    not finite the residual stays as it was; where the inf went unsent
    (random-k) the step counts and the inf is dropped. The finite steps
    after it keep the invariant."""
    c, mem = make(), ErrorFeedback()
    torch.manual_seed(2)
    g = torch.randn(16, 10)
    compressed_allreduce(g, c, mem, name="w", comm=MPI.COMM_SELF, step=0)
    kept = mem.residuals["w"].clone()
    bad = g.clone()
    bad[0, 0] = float("inf")
    mean, _ = compressed_allreduce(bad, c, mem, name="w", comm=MPI.COMM_SELF, step=1)
    if torch.isfinite(mean).all():
        want = bad + kept - mean
        assert torch.equal(mem.residuals["w"], torch.where(torch.isfinite(want), want, torch.zeros(())))
    else:
        assert torch.equal(mem.residuals["w"], kept)
    for step in range(2, 5):
        g = torch.randn(16, 10)
        e_old = mem.residuals["w"].clone()
        mean, _ = compressed_allreduce(g, c, mem, name="w", comm=MPI.COMM_SELF, step=step)
        assert torch.isfinite(mean).all() and torch.isfinite(mem.residuals["w"]).all()
        assert torch.allclose(g + e_old, mean + mem.residuals["w"], atol=1e-5)


def test_rescale_moves_the_residuals_to_a_new_loss_scale():
    """Residuals of gradients scaled by a loss scale S are in units of S:
    when the scaler halves S, they are halved with it."""
    mem = ErrorFeedback()
    mem.update("w", torch.full((3,), 8.0), torch.full((3,), 2.0))
    mem.update("b", torch.ones(2), torch.zeros(2))
    mem.rescale(0.5)
    assert torch.equal(mem.residuals["w"], torch.full((3,), 3.0))
    assert torch.equal(mem.residuals["b"], torch.full((2,), 0.5))


def test_an_unsent_overflow_is_dropped_and_the_step_counts():
    """Random-k leaves an inf it did not sample out of the payload: the
    average is finite and the step is applied, so the residual must be what
    this step left (the inf zeroed), not the old one, which would be sent
    again. Before, a rank kept its old residual whenever its own tensor had
    an inf."""
    c, mem = RandomKCompressor(0.1, seed=1), ErrorFeedback()
    g = torch.arange(40, dtype=torch.float32).reshape(4, 10) / 10
    compressed_allreduce(g, c, mem, name="w", comm=MPI.COMM_SELF, step=0)
    kept = mem.residuals["w"].clone()
    payload, ctx = c.compress(g + kept, name="w", step=1)
    unsent = (c.decompress(payload, ctx) == 0).nonzero()[0].tolist()  # a place step 1 does not sample
    bad = g.clone()
    bad[tuple(unsent)] = float("inf")
    mean, _ = compressed_allreduce(bad, c, mem, name="w", comm=MPI.COMM_SELF, step=1)
    assert torch.isfinite(mean).all()
    e = mem.residuals["w"]
    assert e[tuple(unsent)] == 0 and torch.isfinite(e).all() and not torch.equal(e, kept)
    want = g + kept - mean
    want[tuple(unsent)] = 0
    assert torch.equal(e, want)


@pytest.mark.mpi(min_size=2)
def test_an_overflow_on_one_rank_keeps_every_ranks_residual():
    """Rank 1's inf reaches the average (top-k sends it), so the step is
    skipped everywhere: every rank keeps its residual, not only rank 1
    (rank 0 used to consume its own, and lose what it had sent)."""
    comm = MPI.COMM_WORLD
    c, mem = TopKCompressor(0.2), ErrorFeedback()
    torch.manual_seed(comm.Get_rank())
    g = torch.randn(5, 8)
    compressed_allreduce(g, c, mem, name="w", comm=comm, step=0)
    kept = mem.residuals["w"].clone()
    step1 = torch.randn(5, 8)
    if comm.Get_rank() == 1:
        step1[2, 3] = float("inf")
    mean, _ = compressed_allreduce(step1, c, mem, name="w", comm=comm, step=1)
    assert not torch.isfinite(mean).all()
    assert torch.equal(mem.residuals["w"], kept)


@pytest.mark.mpi(min_size=2)
def test_gathered_float16_payloads_are_summed_without_overflow():
    """Top-k, QSGD and sign are gathered and each rank's payload decoded
    and summed: in float16 two ranks' 40000 already overflow (65504), while
    their average is 40000. The sum runs in float32, the mean comes back
    in float16."""
    comm = MPI.COMM_WORLD
    g = torch.full((4, 4), 40000.0, dtype=torch.float16)
    mean, _ = compressed_allreduce(g, TopKCompressor(0.5), None, comm=comm)
    assert mean.dtype == torch.float16 and torch.isfinite(mean).all()
    assert set(mean.unique().tolist()) <= {0.0, 40000.0} and (mean == 40000.0).sum() == 8
