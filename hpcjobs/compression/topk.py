"""Top-k sparsification (Aji & Heafield 2017; Deep Gradient Compression,
Lin et al. 2018; with memory, Stich et al. 2018).

Keep the k = ceil(ratio * n) entries of largest magnitude, send their
values and their indices. The indices differ from rank to rank, so the
payloads cannot be added by an allreduce: they travel by allgather, and each
rank decompresses and adds all P of them.

Payload: k values in the tensor's dtype and k int32 indices (int64 past
2^31 elements): 8k bytes for fp32, so ratio 0.01 sends 50x fewer bytes than
the dense tensor (ring allgather at P ranks: each rank sends (P-1)·8k bytes
against the dense ring allreduce's 2(P-1)/P·4n). Biased: without error
feedback the small entries are lost for good.

On the CPU the selection is numpy's introselect; on a GPU ``torch.topk``,
on the device (as every compressor here works where its tensor lives).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Compressor, check_float, check_ratio, kept

__all__ = ["TopKCompressor"]

_NUMPY_SELECT = (torch.float16, torch.float32, torch.float64)


class TopKCompressor(Compressor):
    """The k largest magnitudes and their positions (not summable)."""

    summable = False

    def __init__(self, ratio: float = 0.01):
        self.ratio = check_ratio(ratio)

    def compress(self, tensor: torch.Tensor, name=None, step=0):
        check_float(self, tensor)
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = kept(self.ratio, n)
        if flat.dtype in _NUMPY_SELECT and k < n and flat.device.type == "cpu":
            # introselect: about 2x faster than torch.topk on CPU at 25M elements
            a = flat.detach().numpy()
            idx = torch.from_numpy(np.argpartition(np.abs(a), n - k)[n - k:])
        else:
            _, idx = torch.topk(flat.abs(), k, sorted=False)
        index_dtype = torch.int32 if n < 2 ** 31 else torch.int64
        return (flat[idx], idx.to(index_dtype)), (tensor.shape, tensor.dtype, n)

    def decompress(self, payload, ctx) -> torch.Tensor:
        values, idx = payload
        shape, dtype, n = ctx
        out = torch.zeros(n, dtype=dtype, device=values.device)
        out[idx.reshape(-1).long()] = values.reshape(-1).to(dtype)
        return out.reshape(shape)

    def __repr__(self) -> str:
        return f"TopKCompressor(ratio={self.ratio!r})"
