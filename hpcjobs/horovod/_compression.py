"""``hvd.Compression``: Horovod's two compressors, and hpcjobs' others.

Horovod's contract (``horovod/torch/compression.py``) is two static
methods: ``compress(tensor) -> (tensor, ctx)`` before the allreduce and
``decompress(tensor, ctx)`` after. ``Compression.none`` and
``Compression.fp16`` are Horovod's (fp16 casts floating-point tensors only),
and ``Compression.bf16`` is the same cast to bfloat16; any of the three,
or a user's own class with that contract, works wherever Horovod takes a
compression (``hvd.allreduce``, ``hvd.grouped_allreduce``,
``hvd.reducescatter``, ``hvd.DistributedOptimizer``).

hpcjobs' gradient compressors (:mod:`hpcjobs.compression`) need more than
one allreduce of a cast -- top-k and sign travel by allgather, PowerSGD
runs two allreduces with an orthogonalisation between -- so they compress
gradients inside ``hvd.DistributedOptimizer`` only, on CPU parameters
(:func:`engine_compressor` hands them to
:class:`hpcjobs.training.DistributedOptimizer`); elsewhere they raise
ValueError:

==========================  ===========================================
``Compression.topk(r)``     keep the largest fraction ``r`` (0.01)
``Compression.randomk(r)``  keep a shared random fraction ``r`` (0.01)
``Compression.qsgd(s)``     stochastic quantisation to ``s`` levels (127)
``Compression.sign``        signs, with the mean magnitude
``Compression.powersgd(k)`` rank-``k`` factors (2)
==========================  ===========================================

In ``DistributedOptimizer`` the fp16 and bf16 casts become hpcjobs' own
(which compress the fused gradient buckets whole), and a user's class is
adapted to hpcjobs' contract (:class:`_HorovodCompressor`), one parameter
at a time, as Horovod compresses them.
"""

from __future__ import annotations

import torch

from ..compression import Compressor as _OurCompressor, make_compressor

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "engine_compressor"]


class Compressor:
    """Horovod's interface: compress before the allreduce, decompress after."""

    @staticmethod
    def compress(tensor):
        """Returns ``(compressed tensor, ctx)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the tensor as it was before ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _Cast(Compressor):
    wire: torch.dtype

    @classmethod
    def compress(cls, tensor):
        return (tensor.type(cls.wire) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx) if ctx.is_floating_point else tensor


class FP16Compressor(_Cast):
    """Floating-point tensors travel as float16 (Horovod's)."""

    wire = torch.float16


class BF16Compressor(_Cast):
    """Floating-point tensors travel as bfloat16 (fp32's range, 8-bit mantissa)."""

    wire = torch.bfloat16


class _Ours(Compressor):
    """One of hpcjobs' compressors, by its spec (:mod:`hpcjobs.compression.names`)."""

    def __init__(self, spec: str):
        make_compressor(spec)  # a bad parameter fails here, where it was written
        self.spec = spec

    def compress(self, tensor):
        raise ValueError(f"Compression {self.spec!r} compresses gradients inside hvd.DistributedOptimizer only; "
                         "hvd collectives take Compression.none, Compression.fp16 or Compression.bf16")

    def decompress(self, tensor, ctx):
        return self.compress(tensor)

    def __repr__(self) -> str:
        return f"Compression({self.spec!r})"


class Compression:
    """Optional compression for allreduce: Horovod's ``none`` and ``fp16``,
    and hpcjobs' (module docstring)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    sign = _Ours("sign")

    @staticmethod
    def topk(ratio: float = 0.01) -> Compressor:
        return _Ours(f"topk:{ratio}")

    @staticmethod
    def randomk(ratio: float = 0.01) -> Compressor:
        return _Ours(f"randomk:{ratio}")

    @staticmethod
    def qsgd(levels: int = 127) -> Compressor:
        return _Ours(f"qsgd:{levels}")

    @staticmethod
    def powersgd(rank: int = 2) -> Compressor:
        return _Ours(f"powersgd:{rank}")


class _HorovodCompressor(_OurCompressor):
    """A Horovod-style compressor under hpcjobs' contract: its payload is
    allreduced (summable), one parameter at a time (not fusable)."""

    summable = True

    def __init__(self, compression):
        self.compression = compression

    def compress(self, tensor, name=None, step=0):
        return self.compression.compress(tensor)

    def decompress(self, payload, ctx):
        return self.compression.decompress(payload, ctx)

    def __repr__(self) -> str:  # compared across ranks: the class, not the object
        cls = self.compression if isinstance(self.compression, type) else type(self.compression)
        return f"HorovodCompressor({cls.__module__}.{cls.__qualname__})"


def engine_compressor(compression) -> _OurCompressor | None:
    """``compression`` as :class:`hpcjobs.training.DistributedOptimizer`
    takes it: None for no compression, else an hpcjobs compressor."""
    if compression in (None, NoneCompressor) or isinstance(compression, NoneCompressor):
        return None
    if isinstance(compression, _Ours):
        return make_compressor(compression.spec)
    for cast, spec in ((FP16Compressor, "fp16"), (BF16Compressor, "bf16")):
        if compression is cast or isinstance(compression, cast):
            return make_compressor(spec)
    return _HorovodCompressor(compression)
