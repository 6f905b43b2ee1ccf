"""The compressor contract (after Horovod's ``horovod/torch/compression.py``
and GRACE, Xu et al. 2021).

A compressor is stateless:

- ``compress(tensor, name=None, step=0) -> (payload, ctx)``: ``payload`` is
  what travels (a tensor, or a tuple of tensors), ``ctx`` what the receiver
  needs to undo it (dtype, shape, shared indices, ...) and never travels.
  ``name`` and ``step`` say which tensor and which iteration this is; only
  compressors whose choices must agree across ranks use them (random-k
  draws its indices from (seed, name, step));
- ``decompress(payload, ctx) -> tensor``: the tensor's dtype and shape
  again. Every payload tensor may arrive flattened to 1-D (it has come
  through an allgather), so ``decompress`` reshapes what it needs;
- ``summable``: True when payloads from different ranks may be added by an
  allreduce and then decompressed (fp16, bf16, random-k with a shared seed,
  and PowerSGD's factors through its own ``reduce_mean``, below: the P and
  Q its ``compress`` alone returns are one rank's approximation, each
  orthonormalised on its own, and are never summed); False when each
  rank's payload must travel by allgather and be decompressed separately
  (top-k, QSGD, sign);
- ``fusable``: True when compressing a concatenation equals concatenating
  the compressions (the casts), so fused gradient buckets may be compressed
  whole; the others see one parameter at a time.

Error-feedback residuals live outside the compressor
(:class:`~hpcjobs.compression.error_feedback.ErrorFeedback`). PowerSGD is
the one method that needs more: two allreduces with an orthogonalisation
between them, and a warm-start matrix kept from step to step. It provides
``reduce_mean`` for the first and ``state_dict``/``load_state_dict`` for the
second (:mod:`hpcjobs.compression.powersgd`).
"""

from __future__ import annotations

import abc
import math
from fractions import Fraction

import numpy as np
import torch

__all__ = ["Compressor", "NoneCompressor", "check_float", "check_ratio"]


class Compressor(abc.ABC):
    summable: bool = False
    fusable: bool = False

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor, name: str | None = None, step: int = 0):
        """Returns ``(payload, ctx)``."""

    @abc.abstractmethod
    def decompress(self, payload, ctx) -> torch.Tensor:
        """Returns a tensor of the original dtype and shape."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoneCompressor(Compressor):
    """The identity: the payload is the tensor itself."""

    summable = True
    fusable = True

    def compress(self, tensor, name=None, step=0):
        return tensor, None

    def decompress(self, payload, ctx):
        return payload


def check_float(compressor: Compressor, tensor: torch.Tensor) -> None:
    """TypeError unless ``tensor`` holds floating-point numbers."""
    if not tensor.is_floating_point():
        raise TypeError(f"{type(compressor).__name__} compresses floating-point tensors, got {tensor.dtype}")


def check_seed(seed) -> int:
    """``seed`` as an integer >= 0 (numpy's seed sequences take no other),
    else ValueError here, not numpy's bare words at the first draw."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def check_ratio(ratio) -> float:
    """``ratio`` as a float in (0, 1], else ValueError."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def kept(ratio: float, numel: int) -> int:
    """How many of ``numel`` elements a ratio keeps: ceil(ratio * numel), at least 1.
    The ratio as it is written (0.07 is 7/100): in binary floating point
    0.07 * 100 is 7.000000000000001, which would keep 8."""
    return min(numel, max(1, math.ceil(Fraction(repr(float(ratio))) * numel))) if numel else 0
