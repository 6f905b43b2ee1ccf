"""QSGD: stochastic quantisation to s levels (Alistarh et al. 2017).

For x with norm ||x||_2, each entry becomes sign(x_i) * l_i / s * ||x||_2
where l_i is |x_i| / ||x|| * s rounded down or up at random, up with
probability equal to the fraction dropped -- so E[l_i] = |x_i| / ||x|| * s
and the quantised vector is unbiased. Variance <= min(n/s^2, sqrt(n)/s)
||x||^2 (their Lemma 3.1).

Payload: the norm (one fp32) and sign * level per entry as int8 (s <= 127)
or int16 (s <= 32767): 4x or 2x fewer bytes than fp32. The levels are not
comparable across ranks (each rank has its own norm), so payloads travel by
allgather: each rank sends (P-1) payloads where the ring sends 2(P-1)/P of
the fp32 tensor, 8/P (int8) or 4/P (int16) times fewer bytes -- none saved
from 8 ranks on (docs/results/compression.md measured 2).

With error feedback QSGD must be a contraction, which it is only where its
variance factor min(n/s^2, sqrt(n)/s) is below 1: tensors of fewer than s^2
entries. Above, the residual can grow without bound (1,000 x 1,000 at
s = 127: 1,636 times the gradient's norm after 30 steps); error feedback warns
(:meth:`QSGDCompressor.feedback_note`): give s >= sqrt(n) there.

The rounding noise comes from torch's generator: seed it per rank
(``torch.manual_seed``) for repeatable runs.
"""

from __future__ import annotations

import torch

from .base import Compressor, check_float

__all__ = ["QSGDCompressor"]


class QSGDCompressor(Compressor):
    """Unbiased stochastic rounding to ``levels`` levels (not summable)."""

    summable = False

    def __init__(self, levels: int = 127):
        if isinstance(levels, bool) or int(levels) != levels or not 1 <= levels <= 32767:
            raise ValueError(f"levels must be an integer in [1, 32767], got {levels!r}")
        self.levels = int(levels)
        self.wire_dtype = torch.int8 if levels <= 127 else torch.int16

    def compress(self, tensor: torch.Tensor, name=None, step=0):
        check_float(self, tensor)
        x = tensor.detach().reshape(-1).float()
        norm = _norm(x).reshape(1)
        if norm.item() == 0.0 or not torch.isfinite(norm).item():
            # all zeros; or a NaN/Inf gradient, whose norm then turns every
            # decompressed entry into NaN rather than into a finite lie
            q = torch.zeros(x.numel(), dtype=self.wire_dtype, device=x.device)
        else:  # |x_i| / norm <= 1 first: levels / norm overflows float32 where the norm is below 4e-37
            level = x.abs().div_(norm).mul_(self.levels).add_(torch.rand_like(x)).floor_()
            # an ulp over `levels` where |x_i| is the norm must not wrap around in int8
            q = level.clamp_(max=self.levels).copysign_(x).to(self.wire_dtype)
        return (norm, q), (tensor.shape, tensor.dtype)

    def feedback_note(self, n: int) -> str | None:
        """What error feedback on an ``n``-entry tensor should be told (module
        docstring), or None where QSGD is a contraction."""
        omega = min(n / self.levels ** 2, n ** 0.5 / self.levels)
        if omega < 1:
            return None
        return (f"qsgd:{self.levels} with error feedback on a tensor of {n:,} entries: above levels² = "
                f"{self.levels ** 2:,} entries QSGD is no contraction (its variance is up to {omega:.3g} times the "
                f"tensor's squared norm), and the residual can grow without bound; give qsgd:"
                f"{min(32767, int(n ** 0.5) + 1)} or more, or leave error feedback off")

    def decompress(self, payload, ctx) -> torch.Tensor:
        norm, q = payload
        shape, dtype = ctx
        scale = norm.reshape(-1)[0] / self.levels
        return (q.reshape(-1).float() * scale).to(dtype).reshape(shape)

    def __repr__(self) -> str:
        return f"QSGDCompressor(levels={self.levels})"


def _norm(x: torch.Tensor) -> torch.Tensor:
    """||x||_2 in float32, scaled by the largest |x_i| first: vector_norm squares
    the entries as they are, so a finite gradient with an entry above ~1.8e19
    had an infinite norm (every entry decompressed to NaN, the step skipped as
    an overflow) and one whose entries were all below ~1e-23 a norm of 0 (sent
    as zeros). NaN, Inf and zeros still give a norm that is NaN, Inf or 0."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    amax = x.abs().max()
    if not torch.isfinite(amax).item() or amax.item() == 0.0:
        return amax
    return amax * torch.linalg.vector_norm(x / amax)
