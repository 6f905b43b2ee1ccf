"""Gradient compression: stateless compressors with a ``summable`` flag
(see :mod:`hpcjobs.compression.base` for the contract), error feedback, and
``compressed_allreduce``, which moves each on the collective it needs."""

from .base import Compressor, NoneCompressor
from .collective import compressed_allreduce
from .error_feedback import ErrorFeedback
from .fp16 import BF16Compressor, FP16Compressor
from .names import COMPRESSIONS, make_compressor
from .powersgd import PowerSGDCompressor
from .qsgd import QSGDCompressor
from .randomk import RandomKCompressor
from .sign import SignCompressor
from .topk import TopKCompressor

__all__ = ["COMPRESSIONS", "BF16Compressor", "Compressor", "ErrorFeedback", "FP16Compressor", "NoneCompressor",
           "PowerSGDCompressor", "QSGDCompressor", "RandomKCompressor", "SignCompressor", "TopKCompressor",
           "compressed_allreduce", "make_compressor"]
