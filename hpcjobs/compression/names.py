"""Compressors by name, for command lines and configs: ``NAME[:PARAM]``.

This module imports torch only when it makes a compressor, so the command
line can offer :data:`COMPRESSIONS` without it.

=========  ==========================  =========================
name       compressor                  PARAM (default)
=========  ==========================  =========================
none       no compression (None)       --
fp16       FP16Compressor              --
bf16       BF16Compressor              --
topk       TopKCompressor              ratio kept (0.01)
randomk    RandomKCompressor           ratio kept (0.01)
qsgd       QSGDCompressor              levels (127)
sign       SignCompressor              --
powersgd   PowerSGDCompressor          rank (2)
=========  ==========================  =========================
"""

from __future__ import annotations

__all__ = ["COMPRESSIONS", "make_compressor"]

COMPRESSIONS = ("none", "fp16", "bf16", "topk", "randomk", "qsgd", "sign", "powersgd")
_PARAM = {"topk": float, "randomk": float, "qsgd": int, "powersgd": int}


def make_compressor(spec: str, seed: int = 0):
    """The compressor a spec names ("none": None); ``seed`` goes to the
    compressors that draw shared random numbers (random-k, PowerSGD).

    Raises:
        ValueError: an unknown name, a parameter where none is taken, or a
            bad parameter value.
    """
    name, sep, param = str(spec).partition(":")
    if name not in COMPRESSIONS:
        raise ValueError(f"unknown compression {name!r}; choose from {', '.join(COMPRESSIONS)} "
                         "(topk:RATIO, randomk:RATIO, qsgd:LEVELS, powersgd:RANK)")
    value = None
    if sep:
        if name not in _PARAM:
            raise ValueError(f"compression {name!r} takes no parameter, got {spec!r}")
        try:
            value = _PARAM[name](param)
        except ValueError:
            kind = "an integer" if _PARAM[name] is int else "a number"
            raise ValueError(f"compression {spec!r}: {param!r} is not {kind}") from None
    if name == "none":
        return None
    from .fp16 import BF16Compressor, FP16Compressor
    from .powersgd import PowerSGDCompressor
    from .qsgd import QSGDCompressor
    from .randomk import RandomKCompressor
    from .sign import SignCompressor
    from .topk import TopKCompressor

    if name == "fp16":
        return FP16Compressor()
    if name == "bf16":
        return BF16Compressor()
    if name == "topk":
        return TopKCompressor(0.01 if value is None else value)
    if name == "randomk":
        return RandomKCompressor(0.01 if value is None else value, seed=seed)
    if name == "qsgd":
        return QSGDCompressor(127 if value is None else value)
    if name == "sign":
        return SignCompressor()
    return PowerSGDCompressor(2 if value is None else value, seed=seed)
