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
    residual: every later gradient would become NaN. The residual stays as
    it was, and the finite steps after it keep the invariant."""
    c, mem = make(), ErrorFeedback()
    torch.manual_seed(2)
    g = torch.randn(16, 10)
    compressed_allreduce(g, c, mem, name="w", comm=MPI.COMM_SELF, step=0)
    kept = mem.residuals["w"].clone()
    bad = g.clone()
    bad[0, 0] = float("inf")
    compressed_allreduce(bad, c, mem, name="w", comm=MPI.COMM_SELF, step=1)
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
