"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017,
"Large Batch Training of Convolutional Networks", arXiv:1708.03888).

For the largest batches one global rate is too big for some layers and too
small for others. LARS gives each parameter tensor (layer) its own trust
ratio. Per step, for every tensor ``w`` with gradient ``g``:

1. ``g <- g + wd * w`` (weight decay, unless the group sets it to 0);
2. ``trust = eta * ||w|| / (||g_raw|| + wd * ||w|| + eps)`` -- 1 when either
   norm is 0 or the group has ``lars_exclude`` (biases and BatchNorm, see
   :func:`hpcjobs.training.schedule.parameter_groups`);
3. ``u <- m * u + trust * g`` and ``w <- w - lr * u`` (Nesterov optional).

It lives in its own module rather than in ``schedule`` because it is an
optimizer with state, not a pure function.
"""

from __future__ import annotations

import torch

__all__ = ["LARS"]


class LARS(torch.optim.Optimizer):
    """SGD with momentum and LARS trust ratios.

    Args:
        params: parameters or param groups (a group may set ``lars_exclude``).
        lr: the global rate (scheduled as usual).
        momentum: momentum factor m.
        weight_decay: L2 factor wd.
        trust_coefficient: eta (You et al.: 0.001).
        eps: keeps the ratio finite.
        nesterov: Nesterov momentum.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-9, nesterov: bool = False):
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError("LARS needs lr, momentum, weight_decay >= 0 and trust_coefficient > 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov, lars_exclude=False)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd, m = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                d = g.add(p, alpha=wd) if wd else g.clone()
                if not group["lars_exclude"]:
                    w_norm = torch.linalg.vector_norm(p)
                    g_norm = torch.linalg.vector_norm(g)
                    # on the tensor's device: an `if` on the norms waited for a GPU twice per tensor per step
                    trust = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
                    d.mul_(torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust)))
                if m:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = d.clone()
                    else:
                        buf.mul_(m).add_(d)
                    d = d.add(buf, alpha=m) if group["nesterov"] else buf
                p.add_(d, alpha=-group["lr"])
        return loss
