"""PowerSGD: exact on low-rank matrices, small tensors sent whole, warm start."""

import pytest
import torch

from hpcjobs.compression import PowerSGDCompressor


def _rank_r(n, m, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(r, m, generator=g)


@pytest.mark.parametrize("r", [1, 2, 4])
def test_exact_on_a_rank_r_matrix(r):
    m = _rank_r(64, 48, r)
    c = PowerSGDCompressor(r)
    payload, ctx = c.compress(m, name="w")
    p, q = payload
    assert p.shape == (64, r) and q.shape == (48, r)
    assert torch.allclose(p.t() @ p, torch.eye(r), atol=1e-5)  # orthonormal
    assert torch.allclose(c.decompress(payload, ctx), m, atol=1e-4 * m.abs().max().item())


def test_reduce_mean_of_one_rank_is_exact_on_rank_r_and_keeps_the_warm_start():
    m = _rank_r(30, 20, 2, seed=1)
    c = PowerSGDCompressor(2)
    calls = []
    mean, local = c.reduce_mean(m, calls.append, name="w")  # one rank: the mean is the identity
    assert len(calls) == 2 and calls[0].shape == (30, 2) and calls[1].shape == (20, 2)
    assert torch.allclose(mean, m, atol=1e-4) and torch.allclose(local, mean)
    assert set(c.state_dict()["q"]) == {"w"}
    other = PowerSGDCompressor(2)
    other.load_state_dict(c.state_dict())
    assert torch.equal(other.state_dict()["q"]["w"], c.state_dict()["q"]["w"])


def test_conv_weights_are_reshaped_and_1d_or_small_tensors_sent_whole():
    c = PowerSGDCompressor(2)
    w = torch.randn(16, 8, 5)  # 16 x 40 matrix
    assert c.compresses(w.shape)
    payload, ctx = c.compress(w, name="conv")
    assert payload[0].shape == (16, 2) and payload[1].shape == (40, 2)
    assert c.decompress(payload, ctx).shape == w.shape
    for t in (torch.randn(100), torch.randn(3, 3)):
        assert not c.compresses(t.shape)
        payload, ctx = c.compress(t)
        assert len(payload) == 1 and torch.equal(c.decompress(payload, ctx), t)


def test_before_start_iter_everything_goes_uncompressed():
    c = PowerSGDCompressor(1, start_iter=5)
    m = torch.randn(40, 40)
    calls = []
    mean, local = c.reduce_mean(m, calls.append, name="w", step=4)
    assert len(calls) == 1 and torch.equal(calls[0], m) and local is m
    c.reduce_mean(m, calls.append, name="w", step=5)
    assert len(calls) == 3


def test_warm_start_improves_the_approximation_step_after_step():
    """Power iteration continued across steps: on a fixed full-rank matrix
    the rank-1 error falls towards the best rank-1 error (SVD)."""
    torch.manual_seed(0)
    m = torch.randn(50, 40)
    best = torch.linalg.svdvals(m)[1:].square().sum().sqrt()
    c = PowerSGDCompressor(1)
    errors = []
    for step in range(30):
        mean, _ = c.reduce_mean(m, lambda t: None, name="w", step=step)
        errors.append((m - mean).norm().item())
    assert errors[-1] < errors[0] and errors[-1] <= 1.01 * best.item()


@pytest.mark.parametrize("kw", [{"rank": 0}, {"rank": 1.5}, {"start_iter": -1}, {"seed": -1}, {"seed": 1.5}])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        PowerSGDCompressor(**kw)


def test_a_half_precision_tensor_is_sent_as_factors_only_where_they_save_bytes():
    """The factors travel as fp32: at 32 x 32 and rank 8 they are 2 KiB,
    half an fp32 tensor's bytes and all of an fp16 one's, which was sent as
    factors all the same (no byte saved, accuracy lost)."""
    c = PowerSGDCompressor(rank=8)
    assert c.compresses(torch.Size((32, 32)), 4) and not c.compresses(torch.Size((32, 32)), 2)
    assert c.compresses(torch.Size((64, 64)), 2)
    half = torch.randn(32, 32).half()
    mean, _ = c.reduce_mean(half, lambda t: None, name="w", step=0)
    assert torch.equal(mean, half)  # sent whole: one rank's mean is itself


def test_a_non_finite_step_does_not_become_the_warm_start():
    """The stored Q is the last step's allreduced Q: an overflowed step (inf
    in the gradient) would make it NaN, and every later step with it. That
    step starts the next one from the seed's Q instead, as a first step does."""
    c, fresh = PowerSGDCompressor(2, seed=3), PowerSGDCompressor(2, seed=3)
    torch.manual_seed(4)
    m = torch.randn(12, 9)
    bad = m.clone()
    bad[0, 0] = float("inf")
    c.reduce_mean(bad, lambda buf: None, name="w", step=0)
    after, _ = c.reduce_mean(m, lambda buf: None, name="w", step=1)
    first, _ = fresh.reduce_mean(m, lambda buf: None, name="w", step=1)
    assert torch.isfinite(after).all() and torch.equal(after, first)


def test_a_step_of_zeros_does_not_become_the_warm_start():
    """A parameter unused in a step has a gradient of zeros (the optimizer
    fills them in), so the stored Q was zero; from then on P = M Q = 0,
    orthonormalised to the fixed basis e_1..e_r, and Q = M^T [e_1..e_r]: the
    first rows of M, zero for good for an embedding whose padding row is
    row 0. Every later step sent zeros (and error feedback kept the rest
    for ever). That step now starts the next one from the seed's Q."""
    c, fresh = PowerSGDCompressor(1, seed=3), PowerSGDCompressor(1, seed=3)
    m = _rank_r(50, 32, 1, seed=5)
    m[:4] = 0  # rows never used, as a padding index's
    c.reduce_mean(torch.zeros(50, 32), lambda buf: None, name="emb", step=0)
    assert "emb" not in c.state_dict()["q"]
    after, _ = c.reduce_mean(m, lambda buf: None, name="emb", step=1)
    first, _ = fresh.reduce_mean(m, lambda buf: None, name="emb", step=1)
    assert torch.equal(after, first) and torch.allclose(after, m, atol=1e-4 * m.abs().max().item())


def test_empty_and_non_contiguous_tensors_and_the_seed_in_the_agreement():
    """A (0, m) tensor is sent whole (nothing to factor); a transposed view
    reduces like its contiguous copy; and two seeds are two compressors to
    the cross-rank check, which compares reprs: ranks seeded apart start
    from different Q, and the average of M_i Q_i is not a factor of mean(M)."""
    from mpi4py import MPI

    from hpcjobs.compression import NoneCompressor, compressed_allreduce

    c = PowerSGDCompressor(1)
    assert not c.compresses(torch.Size((0, 5)))
    mean, _ = compressed_allreduce(torch.zeros(0, 5), c, name="e", comm=MPI.COMM_SELF)
    assert mean.shape == (0, 5)
    t = torch.randn(3, 4).t()
    for make in (NoneCompressor, lambda: PowerSGDCompressor(1)):
        got, _ = compressed_allreduce(t, make(), name="t", comm=MPI.COMM_SELF)
        want, _ = compressed_allreduce(t.contiguous(), make(), name="t", comm=MPI.COMM_SELF)
        assert torch.equal(got, want)
    assert repr(PowerSGDCompressor(2, seed=1)) != repr(PowerSGDCompressor(2, seed=2))
