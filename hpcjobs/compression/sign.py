"""1-bit sign compression with a scale (1-bit SGD, Seide et al. 2014;
EF-SignSGD, Karimireddy et al. 2019).

Each entry becomes +scale or -scale, scale = ||x||_1 / n (the mean
magnitude: the scale that minimises ||x - scale·sign(x)||_2, which makes
the compressor a contraction and error feedback converge). Zero counts as
positive.

Payload: the signs packed 8 to a byte (``numpy.packbits``) and the scale as
one fp32: n/8 + 4 bytes, 32x fewer bits than fp32. Signs from different
ranks cannot be added as bits, so payloads travel by allgather.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Compressor, check_float

__all__ = ["SignCompressor"]


class SignCompressor(Compressor):
    """One bit per entry plus a per-tensor scale (not summable)."""

    summable = False

    def compress(self, tensor: torch.Tensor, name=None, step=0):
        check_float(self, tensor)
        x = tensor.reshape(-1).float()
        n = x.numel()
        scale = (x.abs().sum() / max(n, 1)).reshape(1)
        bits = torch.from_numpy(np.packbits((x >= 0).numpy()))
        return (bits, scale), (tensor.shape, tensor.dtype, n)

    def decompress(self, payload, ctx) -> torch.Tensor:
        bits, scale = payload
        shape, dtype, n = ctx
        signs = np.unpackbits(bits.reshape(-1).numpy(), count=n).astype(np.float32)
        out = torch.from_numpy(signs).mul_(2).sub_(1).mul_(scale.reshape(-1)[0])
        return out.to(dtype).reshape(shape)
