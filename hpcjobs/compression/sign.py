"""1-bit sign compression with a scale (1-bit SGD, Seide et al. 2014;
EF-SignSGD, Karimireddy et al. 2019).

Each entry becomes +scale or -scale, scale = ||x||_1 / n (the mean
magnitude: the scale that minimises ||x - scale·sign(x)||_2, which makes
the compressor a contraction and error feedback converge). Zero counts as
positive.

Payload: the signs packed 8 to a byte (``numpy.packbits``) and the scale as
one fp32: n/8 + 4 bytes, 32x fewer bits than fp32. Signs from different
ranks cannot be added as bits, so payloads travel by allgather: each rank
sends (P-1) of them where the ring sends 2(P-1)/P of the fp32 tensor, 64/P
times fewer bytes. On a GPU
the packing is done with torch ops on the device, to the same bytes.
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
        positive = x >= 0
        bits = torch.from_numpy(np.packbits(positive.numpy())) if x.is_cpu else _pack(positive)
        return (bits, scale), (tensor.shape, tensor.dtype, n)

    def decompress(self, payload, ctx) -> torch.Tensor:
        bits, scale = payload
        shape, dtype, n = ctx
        bits = bits.reshape(-1)
        if bits.is_cpu:
            signs = torch.from_numpy(np.unpackbits(bits.numpy(), count=n).astype(np.float32))
        else:
            signs = _unpack(bits, n)
        out = signs.mul_(2).sub_(1).mul_(scale.reshape(-1)[0].to(signs.device))
        return out.to(dtype).reshape(shape)


# numpy.packbits' layout (the first entry in the byte's top bit), in torch
# ops, for tensors on a GPU: the same bytes whichever device packed them.
def _weights(device) -> torch.Tensor:
    return torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)


def _pack(positive: torch.Tensor) -> torch.Tensor:
    n = positive.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=positive.device)
    padded[:n] = positive
    return (padded.view(-1, 8) * _weights(positive.device)).sum(dim=1, dtype=torch.uint8)


def _unpack(bits: torch.Tensor, n: int) -> torch.Tensor:
    w = _weights(bits.device)
    return (bits.view(-1, 1).bitwise_and(w) != 0).reshape(-1)[:n].float()
