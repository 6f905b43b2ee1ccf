"""Every rank must call a collective with the same arguments; this module
checks that they do, before any data moves.

MPI programs that skip this hang, or worse: a rank with a shorter buffer
receives a short message without complaint and the job returns wrong
numbers. Horovod checks every tensor's dtype, shape and op across ranks and
names the mismatch; so do we.

How: each rank packs its call's signature -- collective, count, dtype, op,
the algorithm's options -- into a few int64s ``v`` and a flag ``bad`` for a
local error (unsupported dtype, read-only or non-contiguous buffer, CUDA
tensor, ...), and one ``MPI_Allreduce`` with MIN of ``[v, -v, -bad]`` gives
every rank the smallest and the largest value of each field and whether any
rank failed. Equal extremes mean agreement and the data may move. Otherwise
every rank gathers everyone's readable signature and raises the same
:class:`MismatchError`, naming the ranks and their values.

Why not skip the exchange for signatures already seen, as Horovod's response
cache does? A per-rank cache is not safe: if one rank's signature changes,
it alone would enter the exchange while the others, on a cache hit, went
straight on to the data phase -- a hang. Horovod's cache still exchanges a
bit vector every cycle for the same reason. The exchange is one 9-element
allreduce (its cost against each algorithm: docs/results/reliability.md,
"What the agreement check costs"); benchmarks
and callers that have agreed on their layout once (``DistributedOptimizer``)
turn it off with :func:`set_checks` / ``HPCJOBS_CHECKS=0``.
"""

from __future__ import annotations

import contextlib
import functools
import os

import numpy as np
from mpi4py import MPI

from ..comm import signature
from ._shared import is_single_node

__all__ = ["MismatchError", "checks_enabled", "set_checks", "checking", "agree_or_raise"]


class MismatchError(ValueError):
    """Ranks called a collective with different arguments, or one rank's
    arguments were invalid; raised on every rank with the same message."""


_enabled = os.environ.get("HPCJOBS_CHECKS", "1").lower() not in ("0", "off", "false", "no")


def set_checks(enabled: bool) -> None:
    """Turn the cross-rank agreement checks on or off for this process
    (every rank must choose the same). Default: on, unless ``HPCJOBS_CHECKS=0``."""
    global _enabled
    _enabled = bool(enabled)


def checks_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def checking(enabled: bool):
    """``with checking(False): ...``: checks off (or on) inside the block."""
    global _enabled
    before, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = before


@functools.lru_cache(maxsize=1024)
def _encode(items: tuple, failed: bool) -> np.ndarray:
    # A signature seen before costs a cache lookup, not its encoding (crc32
    # of the strings): a few microseconds per call on small messages. The
    # exchange is comm.extremes' [v, -v] with the failure flag after it, in
    # one allreduce, built here once per signature.
    v = signature(value for _, value in items)
    out = np.concatenate([v, -v, [-int(failed)]])
    out.flags.writeable = False
    return out


def agree_or_raise(comm: MPI.Intracomm, what: str, fields: dict, error: BaseException | None = None) -> None:
    """Check that every rank of ``comm`` has the same ``fields`` and no
    ``error``; raise :class:`MismatchError` on every rank if not (collective).
    With checks off, or on one rank, nothing is exchanged and ``error``, if
    any, is raised as it is, on this rank.

    Args:
        what: the collective, for the message ("ring_allreduce").
        fields: name -> int or str (or None where this rank could not tell,
            because of its ``error``).
        error: this rank's local validation error, if any.
    """
    if not _enabled or comm.Get_size() == 1:
        if error is not None:
            raise error
        return
    local = _encode(tuple(fields.items()), error is not None)
    out = local.copy()
    _exchange(out, comm)
    # Every rank agrees, and none failed, exactly when the MIN of [v, -v, -bad]
    # is this rank's own [v, -v, 0]: a rank with a larger value in a field
    # lowers -v, a smaller one lowers v, a failure lowers -bad. Every rank
    # then sees a difference, or none does.
    if error is None and out.tobytes() == local.tobytes():
        return
    names = list(fields)
    n = len(names)
    lo, hi = out[:n], -out[n:2 * n]
    everyone = comm.allgather(({k: fields[k] for k in names},
                               None if error is None else f"{type(error).__name__}: {error}", what))
    problems = [f"rank {r}: {err}" for r, (_, err, _) in enumerate(everyone) if err]
    for i, k in enumerate(names):
        if lo[i] != hi[i]:
            values = {}
            for r, (f, err, _) in enumerate(everyone):
                if not err:
                    values.setdefault(str(f[k]), []).append(r)
            if len(values) > 1:
                problems.append(f"{k} differs: " + "; ".join(f"{_ranks(rs)}: {val}" for val, rs in values.items()))
    whats = " / ".join(dict.fromkeys(w for _, _, w in everyone))  # the same text on every rank
    raise MismatchError(f"{whats}: the ranks of the communicator disagree or failed, so nothing was sent -- "
                        + " | ".join(problems))


def _exchange(out: np.ndarray, comm: MPI.Intracomm) -> None:
    """The MIN allreduce of the signatures, in place: ``MPI_Allreduce``,
    which measured faster for it than oneshot's shared segment (one exchange
    in C against one in Python: docs/results/allreduce.md, "Small messages:
    oneshot"); with ``HPCJOBS_AGREE_VIA=oneshot``, the segment on a node
    where every rank has a core."""
    exchange = comm.Get_attr(_EXCHANGE_KEYVAL)
    if exchange is None:  # decided once per communicator, the same on every rank
        from . import oneshot  # (oneshot runs in the frame, which imports this module)

        shared = _VIA == "oneshot" and is_single_node(comm) and not oneshot.oversubscribed(comm)
        exchange = oneshot.allreduce_array if shared else _mpi_min
        comm.Set_attr(_EXCHANGE_KEYVAL, exchange)
    exchange(out, "min", comm)


def _mpi_min(out: np.ndarray, op: str, comm: MPI.Intracomm) -> None:
    comm.Allreduce(MPI.IN_PLACE, out, op=MPI.MIN)


_EXCHANGE_KEYVAL = MPI.Comm.Create_keyval()
# HPCJOBS_AGREE_VIA=mpi|oneshot: the exchange (to measure both; mpi by default).
_VIA = os.environ.get("HPCJOBS_AGREE_VIA", "mpi")


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))
