"""Learning-rate schedules for large-minibatch SGD, as pure functions.

The recipe is Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training
ImageNet in 1 Hour" (arXiv:1706.02677)::

    cfg = ScheduleConfig(base_lr=0.1, base_batch=256, global_batch=8192,
                         warmup="gradual", warmup_epochs=5, decay="step",
                         milestones=(30, 60, 80), epochs=90)
    for step in range(cfg.epochs * steps_per_epoch):
        lr = lr_at(step, steps_per_epoch, cfg)

:func:`lr_at` works in four steps:

1. **Linear scaling** -- the peak rate is ``base_lr * global_batch /
   base_batch`` ("when the minibatch size is multiplied by k, multiply the
   learning rate by k"; Goyal: lr = 0.1 * kn / 256).
2. **Warmup** over ``warmup_epochs`` (default 5), counted in iterations:
   ``"gradual"`` starts at ``base_lr`` and adds a constant amount every
   iteration so that it reaches the peak at the end of warmup; ``"constant"``
   holds ``base_lr`` for the whole warmup and then jumps to the peak (Goyal
   shows this fails for large k); ``"none"`` starts at the peak. Where the
   global batch is at most ``base_batch`` (k <= 1) the peak is not above
   ``base_lr`` and there is nothing to warm up to: warmup holds the peak
   rather than starting higher and falling to it. ``warmup_from`` starts it
   elsewhere: an asynchronous run whose W updates carry what one synchronous
   step does starts at the rate per sample that step starts at
   (:meth:`hpcjobs.training.config.TrainConfig.schedule`).
3. **Decay** after warmup: ``"step"`` multiplies by ``gamma`` at every epoch
   in ``milestones`` (Goyal: /10 at 30, 60, 80), ``"cosine"`` anneals from the
   peak to ``final_lr`` over the remaining iterations, ``"none"`` holds it.
4. The result depends on nothing but (step, steps_per_epoch, config), so a
   resumed job gets the same rate for the same step.

Goyal's *momentum correction* concerns the form of the momentum update.
``torch.optim.SGD`` keeps ``u <- m*u + g; w <- w - lr*u`` (the rate outside
the buffer, Goyal's eq. 9), which needs no correction when the rate changes.
The other form, ``v <- m*v + lr*g; w <- w - v`` (eq. 10), must scale ``v`` by
``lr_new / lr_old`` (:func:`momentum_correction`) to stay equivalent.
:func:`set_lr` applies a rate to an optimizer; with ``momentum_correction=False``
it reproduces eq. 10 *without* the correction, which is how the ablation runs.

:func:`parameter_groups` turns weight decay off for BatchNorm and bias
parameters (every parameter of fewer than two dimensions: a superset of
Goyal's, who leave BatchNorm's γ and β undecayed; an option here). LARS, for the largest batches, is in
:mod:`hpcjobs.training.lars`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["WARMUPS", "DECAYS", "ScheduleConfig", "scaled_lr", "warmup_steps", "lr_at",
           "momentum_correction", "set_lr", "parameter_groups"]

WARMUPS = ("none", "constant", "gradual")
DECAYS = ("none", "step", "cosine")


@dataclass(frozen=True)
class ScheduleConfig:
    """Everything the learning rate depends on besides the step.

    Attributes:
        base_lr: the rate tuned for ``base_batch`` samples per step.
        base_batch: the reference minibatch (Goyal: 256).
        global_batch: samples per optimizer step over all ranks and
            accumulated backward passes.
        warmup: "none", "constant" or "gradual".
        warmup_epochs: length of the warmup, in epochs (may be fractional).
        decay: "none", "step" or "cosine", applied after warmup.
        epochs: total training length; cosine anneals to its end.
        milestones: epochs at which "step" multiplies the rate by ``gamma``
            (one inside the warmup cuts the climbing rate).
        gamma: the step-decay factor.
        final_lr: where "cosine" ends.
        warmup_from: the rate a warmup starts at (None: ``base_lr``); where it
            is at or above the peak, warmup holds the peak.
    """

    base_lr: float = 0.1
    base_batch: int = 256
    global_batch: int = 256
    warmup: str = "gradual"
    warmup_epochs: float = 5.0
    decay: str = "none"
    epochs: int = 90
    milestones: tuple[float, ...] = field(default=(30, 60, 80))
    gamma: float = 0.1
    final_lr: float = 0.0
    warmup_from: float | None = None

    def __post_init__(self):
        if self.warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {self.warmup!r}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if not (self.base_lr > 0 and math.isfinite(self.base_lr)):
            raise ValueError(f"base_lr must be a positive number, got {self.base_lr}")
        for name in ("base_batch", "global_batch", "epochs"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not (self.warmup_epochs >= 0 and math.isfinite(self.warmup_epochs)):
            raise ValueError(f"warmup_epochs must be a number >= 0, got {self.warmup_epochs}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        if self.warmup_from is not None and not (self.warmup_from > 0 and math.isfinite(self.warmup_from)):
            raise ValueError(f"warmup_from must be a positive number, got {self.warmup_from}")
        if self.final_lr < 0:
            raise ValueError(f"final_lr must be >= 0, got {self.final_lr}")
        object.__setattr__(self, "milestones", tuple(sorted(float(m) for m in self.milestones)))


def scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule: ``base_lr * global_batch / base_batch``."""
    return base_lr * global_batch / base_batch


def warmup_steps(steps_per_epoch: int, cfg: ScheduleConfig) -> int:
    """Iterations of warmup (0 for ``warmup="none"``)."""
    if cfg.warmup == "none":
        return 0
    return int(round(cfg.warmup_epochs * steps_per_epoch))


def lr_at(step: int, steps_per_epoch: int, cfg: ScheduleConfig) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    Args:
        step: the optimizer step about to be taken, counted from 0 over the
            whole run.
        steps_per_epoch: optimizer steps in one epoch (> 0).
        cfg: the schedule.

    Returns:
        The rate, a float > 0 (>= ``final_lr`` for cosine).
    """
    if steps_per_epoch <= 0:
        raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    # 1) linear scaling
    peak = scaled_lr(cfg.base_lr, cfg.base_batch, cfg.global_batch)
    # step decay: gamma for each milestone passed, from the run's first step (inside a warmup too: there it cuts
    # the climbing rate, where it had waited for the warmup's end -- with k = 1, a "warmup" that changes nothing)
    cut = 1.0
    if cfg.decay == "step":
        epoch = step / steps_per_epoch
        cut = cfg.gamma ** sum(1 for m in cfg.milestones if epoch >= m)
    # 2) warmup, per iteration
    n_warm = warmup_steps(steps_per_epoch, cfg)
    if step < n_warm:
        # k < 1: the peak is below base_lr, and warmup never climbs down
        start = min(cfg.base_lr if cfg.warmup_from is None else cfg.warmup_from, peak)
        if cfg.warmup == "constant":
            return start * cut
        return (start + (peak - start) * step / n_warm) * cut
    # 3) decay after warmup
    if cfg.decay == "step":
        return peak * cut
    if cfg.decay == "cosine":
        total = cfg.epochs * steps_per_epoch
        span = max(total - n_warm, 1)
        progress = min((step - n_warm) / span, 1.0)
        return cfg.final_lr + 0.5 * (peak - cfg.final_lr) * (1 + math.cos(math.pi * progress))
    return peak


def momentum_correction(lr_new: float, lr_old: float) -> float:
    """Goyal's factor for the ``v <- m*v + lr*g`` form when the rate changes:
    scale the buffer by ``lr_new / lr_old`` (1 when either is 0)."""
    if lr_old == 0 or lr_new == 0:
        return 1.0
    return lr_new / lr_old


def set_lr(optimizer, lr: float, momentum_correction: bool = True) -> None:
    """Set every param group's rate to ``lr``.

    ``torch.optim.SGD`` keeps its momentum buffer without the rate in it, which
    is the corrected form already. ``momentum_correction=False`` reproduces
    the uncorrected ``v <- m*v + lr*g`` form instead: the buffer, which in that
    form holds ``lr_old * u``, is *not* rescaled, so in torch's terms ``u`` is
    scaled by ``lr_old / lr_new``.
    """
    for group in optimizer.param_groups:
        old = group["lr"]
        group["lr"] = lr
        if momentum_correction or old == lr or old == 0 or lr == 0:
            continue
        factor = old / lr
        for p in group["params"]:
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                buf.mul_(factor)


def parameter_groups(model, weight_decay: float, no_decay_bn_bias: bool = False) -> list[dict]:
    """Param groups for a torch optimizer: with ``no_decay_bn_bias``, biases and
    normalisation-layer parameters (every parameter with fewer than 2 dims)
    get ``weight_decay=0`` and are flagged ``lars_exclude`` for LARS."""
    if not no_decay_bn_bias:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lars_exclude": True})
    return groups
