"""Gradient compression: stateless compressors with a ``summable`` flag
(see :mod:`hpcjobs.compression.base` for the contract), error feedback, and
``compressed_allreduce``, which moves each on the collective it needs."""

from .._lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    "Compressor": "base", "NoneCompressor": "base", "compressed_allreduce": "collective",
    "ErrorFeedback": "error_feedback", "FP16Compressor": "fp16", "BF16Compressor": "fp16",
    "COMPRESSIONS": "names", "make_compressor": "names", "PowerSGDCompressor": "powersgd",
    "QSGDCompressor": "qsgd", "RandomKCompressor": "randomk", "SignCompressor": "sign", "TopKCompressor": "topk",
})
