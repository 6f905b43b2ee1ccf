"""QSGD and 1-bit sign: unbiasedness, bit widths, exact scale."""

import math

import pytest
import torch

from hpcjobs.compression import QSGDCompressor, SignCompressor


def test_qsgd_is_unbiased():
    """Seeded statistical test. Each entry is norm/s times a level rounded
    at random between two neighbours: variance <= (norm/s)^2 / 4. Over T
    draws the mean's standard deviation is at most norm/(2 s sqrt(T));
    allow 5 of them."""
    n, s, T = 64, 4, 20000
    torch.manual_seed(0)
    x = torch.randn(n)
    c = QSGDCompressor(s)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(T):
        total += c.decompress(*c.compress(x)).double()
    bound = 5 * x.norm().item() / (2 * s * math.sqrt(T))
    assert ((total / T - x.double()).abs() <= bound).all()


def test_qsgd_levels_are_int8_or_int16_and_within_range():
    x = torch.randn(1000)
    (norm, q), _ = QSGDCompressor(127).compress(x)
    assert q.dtype == torch.int8 and norm.numel() == 1 and q.abs().max() <= 127
    (_, q16), _ = QSGDCompressor(1000).compress(x)
    assert q16.dtype == torch.int16 and q16.abs().max() <= 1000


def test_qsgd_zero_stays_zero_and_nan_is_not_hidden():
    c = QSGDCompressor()
    assert not c.decompress(*c.compress(torch.zeros(10))).any()
    assert torch.isnan(c.decompress(*c.compress(torch.tensor([1.0, float("nan")])))).all()


@pytest.mark.parametrize("scale", [1e20, 1e-24, 1e-30])
def test_qsgd_of_finite_gradients_far_from_one_is_their_quantisation_not_nan_or_zero(scale):
    """The norm squared the entries in float32: above ~1.8e19 it was inf (every
    entry decompressed to NaN), below ~1e-23 it was 0 (sent as zeros). A one-hot
    tensor is exact at any level count: its one entry is +-norm, the others 0;
    and the three-entry vector comes back as levels of its own norm."""
    c = QSGDCompressor(127)
    one_hot = torch.tensor([0.0, -scale, 0.0])
    assert c.decompress(*c.compress(one_hot)).tolist() == one_hot.tolist()
    x = torch.tensor([4.0, -3.0, 0.0]) * scale
    (norm, q), ctx = c.compress(x)
    assert norm.item() == pytest.approx(5 * scale, rel=1e-6)
    got = c.decompress((norm, q), ctx)
    assert torch.isfinite(got).all() and (got.sign() == x.sign()).all()
    assert ((got - x).abs() <= norm.item() / 127 * (1 + 1e-5)).all()  # one level of the norm at most


@pytest.mark.parametrize("bad", [0, 40000, 2.5])
def test_qsgd_bad_levels_are_refused(bad):
    with pytest.raises(ValueError, match="levels"):
        QSGDCompressor(bad)


def test_sign_sends_one_bit_per_element_plus_a_scale():
    n = 32 * 1024
    x = torch.randn(n)
    c = SignCompressor()
    (bits, scale), ctx = c.compress(x)
    assert bits.dtype == torch.uint8 and bits.numel() == n // 8 and scale.numel() == 1
    assert (bits.nbytes + scale.nbytes) * 32 <= x.nbytes + 32 * 4  # 32x fewer bits, plus the scale
    back = c.decompress((bits, scale), ctx)
    assert torch.allclose(scale, x.abs().mean())
    assert torch.equal(back, torch.where(x >= 0, scale, -scale))


def test_sign_odd_lengths_and_shapes_round_trip():
    x = torch.tensor([[-1.0, 2.0, 0.0], [3.0, -4.0, 5.0], [6.0, -0.5, 1.5]])
    c = SignCompressor()
    back = c.decompress(*c.compress(x))
    scale = x.abs().mean()
    assert back.shape == x.shape and torch.equal(back, torch.where(x >= 0, scale, -scale))


@pytest.mark.parametrize("levels", [127, 32767])
def test_qsgd_a_one_hot_tensor_is_exactly_plus_or_minus_levels_never_wrapped(levels):
    c = QSGDCompressor(levels)
    for sign in (1.0, -1.0):
        x = torch.zeros(7)
        x[3] = sign * 3.7
        (norm, q), ctx = c.compress(x)
        assert q[3].item() == sign * levels and not q[torch.arange(7) != 3].any()
        assert torch.allclose(c.decompress((norm, q), ctx), x)
