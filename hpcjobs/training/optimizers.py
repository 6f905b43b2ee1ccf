"""The optimizer a run's ranks step with, from its config (``train
--optimizer``): every mode builds it here, the synchronous loop, local SGD,
EASGD, Hogwild! and the parameter server's workers."""

from __future__ import annotations

import torch

from . import schedule as sched
from .config import TrainConfig
from .lars import LARS

__all__ = ["make_optimizer"]


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``model``'s parameter groups (weight decay, and
    none on BatchNorm and biases with ``cfg.no_decay_bn_bias``) at
    ``cfg.lr``; the schedule sets each step's rate."""
    # the "lars_exclude" flag of a group is read by LARS and kept, unread, by the others
    groups = sched.parameter_groups(model, cfg.weight_decay, cfg.no_decay_bn_bias)
    lr = cfg.lr
    if cfg.optimizer in ("sgd", "nesterov"):
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.optimizer == "nesterov")
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if cfg.optimizer == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    if cfg.optimizer == "adadelta":
        return torch.optim.Adadelta(groups, lr=lr)
    if cfg.optimizer == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, momentum=cfg.momentum)
    return LARS(groups, lr=lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient)
