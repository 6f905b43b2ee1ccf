"""LARS against its closed form (You et al. 2017)."""

import pytest
import torch

from hpcjobs.training.lars import LARS


def test_one_step_uses_the_layerwise_trust_ratio():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))      # ||w|| = 5
    b = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LARS([{"params": [w]}, {"params": [b], "weight_decay": 0.0, "lars_exclude": True}],
               lr=2.0, momentum=0.0, weight_decay=0.1, trust_coefficient=0.01, eps=0.0)
    w.grad = torch.tensor([0.0, 1.0])                     # ||g|| = 1
    b.grad = torch.tensor([0.5])
    opt.step()
    trust = 0.01 * 5 / (1 + 0.1 * 5)
    d = torch.tensor([0.0, 1.0]) + 0.1 * torch.tensor([3.0, 4.0])
    torch.testing.assert_close(w.detach(), torch.tensor([3.0, 4.0]) - 2.0 * trust * d)
    torch.testing.assert_close(b.detach(), torch.tensor([1.0 - 2.0 * 0.5]))


def test_momentum_accumulates_scaled_updates():
    w = torch.nn.Parameter(torch.tensor([1.0, 0.0]))
    opt = LARS([w], lr=1.0, momentum=0.5, trust_coefficient=0.1, eps=0.0)
    w.grad = torch.tensor([2.0, 0.0])
    opt.step()   # trust = 0.1 * 1 / 2 = 0.05; u = 0.1 -> w = 0.9
    assert w[0].item() == pytest.approx(0.9)
    w.grad = torch.tensor([1.0, 0.0])
    opt.step()   # trust = 0.1 * 0.9 / 1 = 0.09; u = 0.5*0.1 + 0.09 = 0.14 -> 0.76
    assert w[0].item() == pytest.approx(0.76)


def test_zero_weights_fall_back_to_plain_sgd():
    w = torch.nn.Parameter(torch.zeros(3))
    opt = LARS([w], lr=0.5, momentum=0.0)
    w.grad = torch.ones(3)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3,), -0.5))
    # a zero gradient with weight decay and no eps: the ratio's 0/0 is not taken, the decay steps plainly
    v = torch.nn.Parameter(torch.ones(2))
    opt = LARS([v], lr=0.5, momentum=0.0, weight_decay=0.1, eps=0.0)
    v.grad = torch.zeros(2)
    opt.step()
    assert torch.equal(v.detach(), torch.full((2,), 1 - 0.5 * 0.1))
    z = torch.nn.Parameter(torch.zeros(2))  # both zero: 0/0 in the ratio, not taken
    opt = LARS([z], lr=0.5, momentum=0.0, eps=0.0)
    z.grad = torch.zeros(2)
    opt.step()
    assert torch.equal(z.detach(), torch.zeros(2))


def test_bad_arguments():
    with pytest.raises(ValueError):
        LARS([torch.nn.Parameter(torch.zeros(1))], lr=-1.0)
