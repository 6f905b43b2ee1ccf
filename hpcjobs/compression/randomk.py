"""Random-k sparsification (Stich et al. 2018, "Sparsified SGD with memory";
Wangni et al. 2018).

Keep k = ceil(ratio * n) entries chosen uniformly at random, without
replacement. The choice is drawn from (seed, name, step), so every rank
keeps the same positions of the same tensor at the same step: only the
values travel, the indices are rebuilt on the receiving side, and payloads
from different ranks add up position by position -- random-k is summable
and goes through the ordinary allreduce (4k bytes for fp32). The indices
are drawn on the host (numpy, the same on every rank whatever its device)
and moved to the tensor's device.

Two scalings:

- ``unbiased=False`` (default): the kept entries as they are. The
  compressor is then a contraction (E||x - C(x)||^2 = (1 - k/n)||x||^2),
  which is what error feedback needs (Stich et al.); without error feedback
  each step moves only k/n of the gradient.
- ``unbiased=True``: the kept entries times n/k, so E[C(x)] = x, at a
  variance of (n/k - 1)||x||^2. That is no contraction: do not combine it
  with error feedback, whose residual would then grow.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from .base import Compressor, check_float, check_ratio, check_seed, kept

__all__ = ["RandomKCompressor"]


class RandomKCompressor(Compressor):
    """k random positions, the same on every rank (summable)."""

    summable = True

    def __init__(self, ratio: float = 0.01, seed: int = 0, unbiased: bool = False):
        self.ratio = check_ratio(ratio)
        self.seed = check_seed(seed)
        self.unbiased = bool(unbiased)

    def indices(self, n: int, name: str | None, step: int) -> torch.Tensor:
        """The kept positions of an n-element tensor, sorted: a function of
        (seed, name, step, n) alone."""
        key = np.random.SeedSequence([self.seed, zlib.crc32((name or "").encode()), int(step), n])
        idx = np.random.default_rng(key).choice(n, kept(self.ratio, n), replace=False, shuffle=False)
        idx.sort()
        return torch.from_numpy(idx)

    def compress(self, tensor: torch.Tensor, name=None, step=0):
        check_float(self, tensor)
        flat = tensor.reshape(-1)
        idx = self.indices(flat.numel(), name, step).to(flat.device)
        return flat[idx], (idx, tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx) -> torch.Tensor:
        idx, shape, dtype = ctx
        n = shape.numel()
        out = torch.zeros(n, dtype=dtype, device=payload.device)
        values = payload.reshape(-1).to(dtype)
        idx = idx.to(payload.device)
        out[idx] = values * (n / idx.numel()) if self.unbiased and idx.numel() else values
        return out.reshape(shape)

    def __repr__(self) -> str:
        return f"RandomKCompressor(ratio={self.ratio!r}, seed={self.seed}, unbiased={self.unbiased})"
