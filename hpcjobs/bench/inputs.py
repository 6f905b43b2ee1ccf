"""The benchmarks' crafted inputs and their exact result (``#wrong``:
:mod:`hpcjobs.bench.sweep` module docstring)."""

from __future__ import annotations

import numpy as np

from ..collectives._buffers import OP_TABLE, finish_avg

__all__ = ["VARIANTS", "expected_output", "make_input"]

# The inputs repeat every _PERIOD elements, a prime: a chunk moved by a whole number of periods is the only
# misplacement the check cannot see (with the period of 3 before, ranks r and r + 3 held the same input and
# sums at 3, 6, 12 ranks came out the same at every element: a rank dropped or a chunk rotated went unseen).
_PERIOD = 251


def _pattern(rank: int, op: str) -> np.ndarray:
    """Rank ``rank``'s small integers, a hash of position and rank: every
    rank's differ from every other's, and so do the sums along the buffer.
    0 or 1 to sum (exact in bfloat16 up to 256 ranks), 1 or 2 to multiply,
    and for min and max 0..27, whose extremes vary with the position."""
    i = np.arange(_PERIOD, dtype=np.uint64)
    with np.errstate(over="ignore"):  # splitmix64's finalizer, wrapping in uint64 as it should
        x = i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(rank + 1) * np.uint64(0xD1B54A32D192ED03)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    h = (x ^ (x >> np.uint64(31))).astype(np.int64) & 0xFFFF
    i = i.astype(np.int64)
    if op == "prod":
        return 1 + h % 2
    if op in ("min", "max"):
        return (i % 7) * 4 + h % 4
    return h % 2


def _to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """Small integers as ``dtype`` elements (bfloat16 as its uint16 bits)."""
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return values.astype(dtype)


# Calls take turns among this many variants of the inputs (each the pattern turned by one more position): a
# result left from an earlier call -- a stale slot, a missed fence -- differs from this call's where it would
# have been bit for bit the same with one input for every call (two slots in turn: a variant count that 2
# does not divide).
VARIANTS = 3


def make_input(count: int, dtype: str, op: str, rank: int, variant: int = 0) -> np.ndarray:
    """Rank ``rank``'s input, as the typed data of a Flat (bf16 as bits);
    ``variant``: the pattern turned by that many positions. (Typed, then
    tiled: tiled in int64 first, a large input briefly took 8 bytes an
    element more than itself.)"""
    return np.resize(_to_dtype(np.roll(np.array(_pattern(rank, op), dtype=np.int64), variant), dtype), count)


def expected_output(count: int, dtype: str, op: str, size: int, variant: int = 0) -> np.ndarray:
    """The exact allreduce of every rank's :func:`make_input` (of ``variant``).

    Integers are reduced in int64, whose wrap-around agrees with any narrower
    integer type's modulo its width; floats in float64, exact for these values.
    """
    integer = dtype != "bfloat16" and np.issubdtype(np.dtype(dtype), np.integer)
    ufunc = OP_TABLE[op].ufunc
    acc = np.roll(np.array(_pattern(0, op), dtype=np.int64 if integer else np.float64), variant)
    with np.errstate(over="ignore"):
        for r in range(1, size):
            ufunc(acc, np.roll(np.array(_pattern(r, op), dtype=acc.dtype), variant), out=acc)
        period = _to_dtype(acc, dtype)
    if op == "avg":
        finish_avg(period, dtype, size)
    return np.resize(period, count)  # one period typed and finished, then tiled: elementwise, the same bits
