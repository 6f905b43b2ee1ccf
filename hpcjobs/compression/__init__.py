"""Gradient compression: stateless compressors with a ``summable`` flag
(see :mod:`hpcjobs.compression.base` for the contract)."""

from .base import Compressor, NoneCompressor
from .fp16 import BF16Compressor, FP16Compressor

__all__ = ["BF16Compressor", "Compressor", "FP16Compressor", "NoneCompressor"]
