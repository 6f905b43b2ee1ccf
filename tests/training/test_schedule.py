"""Learning-rate schedules against their closed forms (Goyal et al. 2017)."""

import math

import pytest
import torch

from hpcjobs.training.schedule import (ScheduleConfig, lr_at, momentum_correction, parameter_groups, scaled_lr,
                                       set_lr, warmup_steps)


def test_linear_scaling_rule_matches_goyal():
    # lr = 0.1 * kn / 256: 8k batch -> 3.2
    assert scaled_lr(0.1, 256, 8192) == pytest.approx(3.2)
    assert scaled_lr(0.1, 256, 256) == pytest.approx(0.1)


def test_gradual_warmup_goes_from_base_to_peak_linearly_per_iteration():
    cfg = ScheduleConfig(base_lr=0.1, base_batch=256, global_batch=256 * 32, warmup="gradual", warmup_epochs=5)
    spe = 100
    n = warmup_steps(spe, cfg)
    assert n == 500
    lrs = [lr_at(s, spe, cfg) for s in range(n + 3)]
    assert lrs[0] == pytest.approx(0.1)
    step = (3.2 - 0.1) / 500
    for s in range(n):
        assert lrs[s] == pytest.approx(0.1 + step * s)
    assert lrs[n] == pytest.approx(3.2) and lrs[n + 2] == pytest.approx(3.2)


def test_constant_warmup_holds_base_then_jumps():
    cfg = ScheduleConfig(base_lr=0.05, base_batch=32, global_batch=512, warmup="constant", warmup_epochs=2)
    assert [lr_at(s, 10, cfg) for s in (0, 10, 19)] == [0.05, 0.05, 0.05]
    assert lr_at(20, 10, cfg) == pytest.approx(0.8)


def test_no_warmup_starts_at_peak():
    cfg = ScheduleConfig(base_lr=0.05, base_batch=32, global_batch=512, warmup="none")
    assert lr_at(0, 10, cfg) == pytest.approx(0.8)
    assert warmup_steps(10, cfg) == 0


def test_fractional_warmup_epochs_round_to_iterations():
    cfg = ScheduleConfig(base_lr=1.0, base_batch=1, global_batch=4, warmup_epochs=0.5)
    assert warmup_steps(7, cfg) == 4  # round(3.5) -> 4 (banker's rounding gives 4)


def test_step_decay_at_milestones_after_warmup():
    cfg = ScheduleConfig(base_lr=0.1, base_batch=256, global_batch=1024, warmup="gradual", warmup_epochs=5,
                         decay="step", milestones=(30, 60, 80), gamma=0.1, epochs=90)
    spe = 10
    assert lr_at(299, spe, cfg) == pytest.approx(0.4)
    assert lr_at(300, spe, cfg) == pytest.approx(0.04)
    assert lr_at(600, spe, cfg) == pytest.approx(0.004)
    assert lr_at(899, spe, cfg) == pytest.approx(0.0004)


def test_a_milestone_counts_from_the_first_step_inside_a_warmup_too():
    # k = 1: the default 5-epoch warmup changes nothing, and the cut at epoch 2 had waited for epoch 5
    cfg = ScheduleConfig(base_lr=0.1, base_batch=32, global_batch=32, warmup_epochs=5, decay="step",
                         milestones=(2,), epochs=10)
    assert [lr_at(s, 10, cfg) for s in (19, 20, 49, 50)] == pytest.approx([0.1, 0.01, 0.01, 0.01])
    # k = 4, a milestone at 1 inside a 2-epoch warmup: the climbing rate, cut by gamma from there
    cfg = ScheduleConfig(base_lr=0.1, base_batch=32, global_batch=128, warmup_epochs=2, decay="step",
                         milestones=(1,), epochs=10)
    assert lr_at(5, 10, cfg) == pytest.approx(0.1 + 0.3 * 5 / 20)
    assert lr_at(10, 10, cfg) == pytest.approx((0.1 + 0.3 * 10 / 20) * 0.1)
    assert lr_at(20, 10, cfg) == pytest.approx(0.04)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_warmup_length_must_be_a_number_at_least_0(bad):
    with pytest.raises(ValueError, match="warmup_epochs must be a number >= 0"):
        ScheduleConfig(warmup_epochs=bad)


def test_cosine_anneals_from_peak_to_final_over_the_rest():
    cfg = ScheduleConfig(base_lr=0.1, base_batch=10, global_batch=20, warmup="gradual", warmup_epochs=1,
                         decay="cosine", epochs=11, final_lr=0.01)
    spe = 10
    assert lr_at(10, spe, cfg) == pytest.approx(0.2)
    assert lr_at(60, spe, cfg) == pytest.approx(0.01 + 0.5 * 0.19 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, spe, cfg) == pytest.approx(0.01)
    assert lr_at(500, spe, cfg) == pytest.approx(0.01)


def test_k_equal_one_makes_every_warmup_the_same():
    for warmup in ("none", "constant", "gradual"):
        cfg = ScheduleConfig(base_lr=0.3, base_batch=64, global_batch=64, warmup=warmup)
        assert {lr_at(s, 5, cfg) for s in range(40)} == {0.3}


def test_below_the_base_batch_warmup_holds_the_peak_and_never_climbs_down():
    """k < 1 (a global batch smaller than base_batch): the linear rule puts the
    peak below base_lr, and a warmup from base_lr would start above the peak
    and fall to it, the opposite of a warmup. Every warmup holds the peak."""
    for warmup in ("none", "constant", "gradual"):
        cfg = ScheduleConfig(base_lr=0.1, base_batch=256, global_batch=64, warmup=warmup, warmup_epochs=1)
        assert [lr_at(s, 4, cfg) for s in range(6)] == pytest.approx([0.025] * 6)


@pytest.mark.parametrize("bad", [dict(warmup="linear"), dict(decay="exp"), dict(base_lr=0), dict(base_batch=0),
                                 dict(global_batch=-1), dict(warmup_epochs=-1), dict(gamma=0), dict(epochs=0)])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        ScheduleConfig(**bad)


def test_bad_step_is_refused():
    cfg = ScheduleConfig()
    with pytest.raises(ValueError):
        lr_at(-1, 10, cfg)
    with pytest.raises(ValueError):
        lr_at(0, 0, cfg)


def test_momentum_correction_factor():
    assert momentum_correction(0.4, 0.1) == pytest.approx(4.0)
    assert momentum_correction(0.0, 0.1) == 1.0


def _sgd_run(lrs, correction):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.SGD([w], lr=lrs[0], momentum=0.9)
    grads = [torch.randn(5) for _ in lrs]
    for lr, g in zip(lrs, grads):
        set_lr(opt, lr, momentum_correction=correction)
        w.grad = g.clone()
        opt.step()
    return w.detach(), grads


LRS = [0.1, 0.2, 0.4, 0.4, 0.05]


def _closed_form(grads, step):
    """w_0 = the same seeded start; each step is ``w, buf = step(w, buf, lr, g)``."""
    torch.manual_seed(0)
    w, buf = torch.randn(5), None
    for lr, g in zip(LRS, grads):
        w, buf = step(w, buf, lr, g)
    return w


def test_set_lr_with_correction_is_torch_sgd_eq9():
    got, grads = _sgd_run(LRS, True)
    # u <- m*u + g; w <- w - lr*u (the rate outside the buffer)
    want = _closed_form(grads, lambda w, u, lr, g: (w - lr * (u := g if u is None else 0.9 * u + g), u))
    torch.testing.assert_close(got, want)


def test_set_lr_without_correction_is_uncorrected_eq10():
    got, grads = _sgd_run(LRS, False)
    # v <- m*v + lr*g; w <- w - v: v keeps the old rate, no correction
    want = _closed_form(grads, lambda w, v, lr, g: (w - (v := lr * g if v is None else 0.9 * v + lr * g), v))
    torch.testing.assert_close(got, want)


def test_parameter_groups_turn_off_decay_for_bn_and_bias():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    groups = parameter_groups(model, 1e-4, no_decay_bn_bias=True)
    assert [len(g["params"]) for g in groups] == [2, 4]
    assert groups[0]["weight_decay"] == 1e-4 and groups[1]["weight_decay"] == 0.0 and groups[1]["lars_exclude"]
    assert all(p.ndim == 2 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])
    (one,) = parameter_groups(model, 1e-4)
    assert len(one["params"]) == 6


def test_an_async_push_and_a_hogwild_update_get_syncs_rate_per_sample():
    """With one --base-batch for both, the parameter server's rate for a
    push of b samples (ps_common.Ctx.lr on the schedule paramserver._setup
    takes) and a Hogwild! update's are sync's rate for its step of W x b
    samples over W, update for update, through the warmup and the cosine
    decay: the same rate per sample (the linear scaling rule;
    docs/algorithms.md). Until 2026-12-01 a push was the base batch, k = 1,
    and started at the full rate: 1.6 times sync's per sample over a 2-epoch
    warmup."""
    from hpcjobs.training.config import TrainConfig
    from hpcjobs.training.ps_common import Ctx

    W, b, spe, epochs = 4, 32, 50, 12
    common = dict(model="cnn1d", dataset="mnist1d", batch_per_rank=b, lr=0.02, base_batch=b, warmup="gradual",
                  warmup_epochs=2, decay="cosine", epochs=epochs)
    sync, push, hog = TrainConfig(**common), TrainConfig(**common, mode="async"), TrainConfig(**common, mode="hogwild")
    s = sync.mode_schedule(W)
    server = Ctx(push, None, 1, W, None, None, None, [], spe, push.mode_schedule(W + 1))
    h = hog.mode_schedule(W)
    climbed = 0
    for v in range(0, epochs * spe * W, W):  # v pushes = v / W synchronous steps
        per_sample = lr_at(v // W, spe, s) / (W * b)
        assert server.lr(v) / b == pytest.approx(per_sample, rel=1e-12), v
        assert lr_at(v, spe * W, h) / b == pytest.approx(per_sample, rel=1e-12), v
        climbed += v < 2 * spe * W and per_sample < 0.08 / (W * b)
    assert climbed == 2 * spe and server.lr(0) == pytest.approx(0.02 / W)


def test_warmup_from_sets_where_the_warmup_starts():
    """``warmup_from`` is the first rate of a gradual or constant warmup;
    at or above the peak the warmup holds the peak, as k <= 1 does."""
    cfg = ScheduleConfig(base_lr=0.1, base_batch=32, global_batch=32, warmup="gradual", warmup_epochs=1,
                         decay="none", warmup_from=0.025)
    assert [lr_at(t, 4, cfg) for t in range(6)] == pytest.approx([0.025, 0.04375, 0.0625, 0.08125, 0.1, 0.1])
    const = ScheduleConfig(**{**cfg.__dict__, "warmup": "constant"})
    assert [lr_at(t, 4, const) for t in range(6)] == pytest.approx([0.025] * 4 + [0.1] * 2)
    above = ScheduleConfig(**{**cfg.__dict__, "warmup_from": 0.5})
    assert [lr_at(t, 4, above) for t in range(6)] == pytest.approx([0.1] * 6)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="warmup_from"):
            ScheduleConfig(warmup_from=bad)


@pytest.mark.parametrize("mode", ["async", "hogwild"])
def test_without_a_base_batch_an_update_neither_warms_up_nor_changes_rate(mode):
    """Without --base-batch each mode's --lr is its own rate per update and
    sync's k is 1: async and Hogwild! hold --lr from the first update, as
    sync holds it from the first step."""
    from hpcjobs.training.config import TrainConfig

    cfg = TrainConfig(model="cnn1d", dataset="mnist1d", batch_per_rank=32, lr=0.02, warmup="gradual",
                      warmup_epochs=2, decay="none", epochs=4, mode=mode)
    s = cfg.mode_schedule(5)
    assert [lr_at(t, 40, s) for t in (0, 1, 79, 80, 159)] == pytest.approx([0.02] * 5)
