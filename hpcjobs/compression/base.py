"""The compressor contract (after Horovod's ``horovod/torch/compression.py``
and GRACE, Xu et al. 2021).

A compressor is stateless:

- ``compress(tensor) -> (payload, ctx)``: ``payload`` is what travels (a
  tensor, or a tuple of tensors), ``ctx`` what the receiver needs to undo it
  (dtype, shape, ...) and never travels;
- ``decompress(payload, ctx) -> tensor``: the tensor's dtype and shape again;
- ``summable``: True when payloads from different ranks may be added by an
  allreduce and then decompressed (fp16, bf16, random-k with a shared seed,
  PowerSGD's factors); False when each rank's payload must travel by
  allgather and be decompressed separately (top-k, QSGD, sign).

Error-feedback residuals, the only state, live outside the compressor.
"""

from __future__ import annotations

import abc

import torch

__all__ = ["Compressor", "NoneCompressor"]


class Compressor(abc.ABC):
    summable: bool = False

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor):
        """Returns ``(payload, ctx)``."""

    @abc.abstractmethod
    def decompress(self, payload, ctx) -> torch.Tensor:
        """Returns a tensor of the original dtype and shape."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoneCompressor(Compressor):
    """The identity: the payload is the tensor itself."""

    summable = True

    def compress(self, tensor):
        return tensor, None

    def decompress(self, payload, ctx):
        return payload
