"""Top-k and random-k: what they keep, shared indices, and unbiasedness."""

import math

import pytest
import torch

from hpcjobs.compression import RandomKCompressor, TopKCompressor


@pytest.mark.parametrize("ratio,n", [(0.01, 1000), (0.1, 37), (1.0, 5), (0.5, 1), (0.07, 100)])
def test_topk_keeps_exactly_the_k_largest_magnitudes(ratio, n):
    torch.manual_seed(0)
    t = torch.randn(n) * torch.linspace(0.1, 10, n)[torch.randperm(n)]  # distinct magnitudes
    c = TopKCompressor(ratio)
    (values, idx), ctx = c.compress(t.reshape(1, n))
    k = {(0.01, 1000): 10, (0.1, 37): 4, (1.0, 5): 5, (0.5, 1): 1, (0.07, 100): 7}[ratio, n]  # ceil(ratio n), exactly
    assert values.numel() == idx.numel() == k and idx.dtype == torch.int32
    want = set(torch.argsort(t.abs(), descending=True)[:k].tolist())
    assert set(idx.tolist()) == want
    back = c.decompress((values, idx), ctx)
    assert back.shape == (1, n)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[list(want)] = True
    assert torch.equal(back.reshape(-1)[kept], t[kept]) and not back.reshape(-1)[~kept].any()


def test_topk_payload_is_8_bytes_per_kept_fp32_element():
    (values, idx), _ = TopKCompressor(0.01).compress(torch.randn(100_000))
    assert values.nbytes + idx.nbytes == 8 * 1000  # 50x fewer than 400,000


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, "0.1", True])
def test_a_ratio_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="ratio"):
        TopKCompressor(bad)
    with pytest.raises(ValueError, match="ratio"):
        RandomKCompressor(bad)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_a_seed_numpy_cannot_take_is_refused_as_the_compressor_is_made(seed):
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        RandomKCompressor(0.5, seed=seed)


def test_randomk_indices_depend_on_seed_name_and_step_only():
    c = RandomKCompressor(0.1, seed=7)
    a = c.indices(1000, "w", 3)
    assert a.numel() == 100 and len(set(a.tolist())) == 100 and torch.equal(a, a.sort().values)
    assert torch.equal(a, RandomKCompressor(0.1, seed=7).indices(1000, "w", 3))  # another rank
    for other in (c.indices(1000, "w", 4), c.indices(1000, "b", 3), RandomKCompressor(0.1, seed=8).indices(1000, "w", 3)):
        assert not torch.equal(a, other)


def test_randomk_payload_is_the_values_only_and_summable():
    c = RandomKCompressor(0.25, seed=1)
    x, y = torch.randn(40), torch.randn(40)
    px, cx = c.compress(x, name="w", step=2)
    py, cy = c.compress(y, name="w", step=2)
    assert c.summable and px.numel() == 10 and torch.equal(cx[0], cy[0])
    assert torch.allclose(c.decompress(px + py, cx), c.decompress(px, cx) + c.decompress(py, cy))


def test_randomk_unbiased_mean_over_steps_converges_to_the_tensor():
    """Seeded statistical test. Each entry's estimate is x*n/k with
    probability k/n, else 0: variance (n/k - 1) x^2 = 4 x^2 here. Over T
    steps the mean's standard deviation is 2|x|/sqrt(T); allow 5 of them."""
    n, T = 50, 20000
    torch.manual_seed(0)
    x = torch.randn(n, dtype=torch.float64)
    c = RandomKCompressor(0.2, seed=11, unbiased=True)
    total = torch.zeros(n, dtype=torch.float64)
    for step in range(T):
        total += c.decompress(*c.compress(x, name="w", step=step))
    assert ((total / T - x).abs() <= 5 * 2 * x.abs() / math.sqrt(T)).all()


def test_randomk_default_keeps_values_unscaled_a_contraction():
    x = torch.randn(1000)
    c = RandomKCompressor(0.1)
    back = c.decompress(*c.compress(x, name="w"))
    kept = back != 0
    assert kept.sum() == 100 and torch.equal(back[kept], x[kept])
    assert (x - back).norm() < x.norm()


def test_ratios_that_keep_other_counts_are_other_compressors_to_the_check():
    """The cross-rank check compares reprs: 0.01 and 0.01000001 keep 10,000
    and 10,001 of a million, and printed to 6 digits they looked alike."""
    from hpcjobs.compression import RandomKCompressor, TopKCompressor

    for make in (RandomKCompressor, TopKCompressor):
        assert repr(make(0.01)) != repr(make(0.01000001))
        assert repr(make(0.01)) == repr(make(0.01))
