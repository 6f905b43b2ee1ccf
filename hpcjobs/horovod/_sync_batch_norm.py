"""``hvd.SyncBatchNorm``: batch normalization over the samples of every
rank, as if one process held the whole batch.

Forward, in training: one allreduce (Sum, float64) of each channel's
``[sum of x, sum of x squared]`` and the sample count N over all ranks
gives the batch mean and biased variance, ``var = E[x^2] - mean^2``. Each
rank computes its sums around its own mean m (with ``d = x - m``:
``sum x = sum d + n m`` and ``sum x^2 = sum d^2 + 2 m sum d + n m^2``) so
that a large mean does not eat the variance's digits. The running
statistics move as torch's BatchNorm moves them (``momentum``, or the
cumulative average when it is None; the unbiased variance,
``var N / (N - 1)``, for ``running_var``).

Backward: with ``xhat = (x - mean) / std`` and ``g`` the gradient of the
output, the input's gradient needs two sums over the whole batch per
channel, ``sum g`` and ``sum g xhat`` -- one more allreduce (Sum) -- and is
``weight / std * (g - sum g / N - xhat * sum(g xhat) / N)``. The weight's
and bias's gradients are this rank's ``sum g xhat`` and ``sum g``, which
``DistributedOptimizer`` averages like any other gradient (Horovod's
choice too).

In evaluation the running statistics are used (torch's ``batch_norm``), or,
with ``track_running_stats=False``, the batch statistics over all ranks.
On one rank it is torch's ``batch_norm``. Unlike Horovod's, which takes
GPU tensors only, it takes CPU and GPU tensors; float16 and bfloat16
inputs are normalized in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ._allreduce import allreduce_
from ._state import Sum, world

__all__ = ["SyncBatchNorm"]


def _layout(x: torch.Tensor) -> tuple[list, list]:
    """The dimensions a channel's statistics run over, and a channel vector's
    shape for broadcasting against ``x`` (N, C, ...)."""
    return [0, *range(2, x.dim())], [1, -1] + [1] * (x.dim() - 2)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class SyncBatchNorm(_BatchNorm):
    """Batch normalization with the statistics of the batch over all ranks
    (module docstring); Horovod's arguments and defaults."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        if world().size == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True, factor,
                                self.eps)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                    factor)


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        dims, shape = _layout(x)
        channels, n = x.shape[1], x.numel() // x.shape[1]
        xc = x.to(_compute_dtype(x))
        own = xc.mean(dims) if n else xc.new_zeros(channels)
        d = xc - own.view(shape)
        sum_d, sum_dd = d.sum(dims, dtype=torch.float64), (d * d).sum(dims, dtype=torch.float64)
        m = own.to(torch.float64)
        count = torch.tensor([float(n)], dtype=torch.float64, device=x.device)
        stats = torch.cat([sum_d + n * m, sum_dd + 2 * m * sum_d + n * m * m, count])
        allreduce_(stats, op=Sum)
        total = float(stats[-1])
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(total)} over all "
                             f"ranks (input size {list(x.shape)} here)")
        mean = stats[:channels] / total
        var = (stats[channels:2 * channels] / total - mean * mean).clamp_(min=0)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean, invstd = mean.to(xc.dtype), (var + eps).rsqrt().to(xc.dtype)
        y = (xc - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.to(xc.dtype).view(shape) + bias.to(xc.dtype).view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape = _layout(x)
        g = grad.to(mean.dtype)
        xhat = (x.to(mean.dtype) - mean.view(shape)) * invstd.view(shape)
        sum_g, sum_gx = g.sum(dims), (g * xhat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = allreduce_(torch.cat([sum_g, sum_gx]).to(torch.float64), op=Sum)
            mean_g, mean_gx = (sums / ctx.total).to(mean.dtype).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            grad_input = ((g - mean_g.view(shape) - xhat * mean_gx.view(shape)) * scale.view(shape)).to(x.dtype)
        if weight is not None:
            grad_weight = sum_gx.to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = sum_g.to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None
