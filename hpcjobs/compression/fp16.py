"""Half-precision casts: fp16 (10-bit mantissa, range +-65504) and bf16
(8-bit mantissa, fp32's range). Half the bytes of fp32; summable, so the
payload goes through the ordinary allreduce. fp16 can overflow: the sum over
P ranks travels in fp16 before the average divides it, so where it exceeds
65504 (a gradient entry above 65504 / P on every rank) the mean is inf. bf16
cannot overflow but keeps ~3 significant digits.
"""

from __future__ import annotations

import torch

from .base import Compressor, check_float

__all__ = ["FP16Compressor", "BF16Compressor"]


class _Cast(Compressor):
    summable = True
    fusable = True
    wire_dtype: torch.dtype

    def compress(self, tensor: torch.Tensor, name=None, step=0):
        check_float(self, tensor)
        return tensor.to(self.wire_dtype), (tensor.dtype, tensor.shape)

    def decompress(self, payload: torch.Tensor, ctx) -> torch.Tensor:
        dtype, shape = ctx
        return payload.to(dtype).reshape(shape)


class FP16Compressor(_Cast):
    wire_dtype = torch.float16


class BF16Compressor(_Cast):
    wire_dtype = torch.bfloat16
