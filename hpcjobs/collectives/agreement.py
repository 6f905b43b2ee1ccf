"""Every rank must call a collective with the same arguments; this module
checks that they do, before any data moves.

MPI programs that skip this hang, or worse: a rank with a shorter buffer
receives a short message without complaint and the job returns wrong
numbers. Horovod checks every tensor's dtype, shape and op across ranks and
names the mismatch; so do we, with the count in the shape's place (a buffer
is reduced element by element in memory order, as ``MPI_Allreduce`` does:
a (2, 3) on one rank and a (3, 2) on another agree).

How: each rank packs its call's signature -- collective, count, dtype, op,
the algorithm's options -- into a few int64s ``v`` and a flag ``bad`` for a
local error (unsupported dtype, read-only or non-contiguous buffer, CUDA
tensor, ...), and one exchange tells every rank whether all are equal:

- on one node: through oneshot's shared
  segment (:mod:`~hpcjobs.collectives.oneshot`). Each rank writes its words
  into its signature slot, waits for the others as oneshot does, and
  compares theirs with its own. A small message that would go through
  oneshot next rides in the same call (``carry``), so a checked small
  allreduce waits once, not twice;
- elsewhere: one ``MPI_Allreduce`` with MIN of ``[v, -v, -bad]`` gives every
  rank the smallest and the largest value of each field and whether any rank
  failed; equal extremes mean agreement.

If a rank's signature differs from another's, every rank sees a difference
(from its own, or its own from the other), gathers everyone's readable
signature and raises the same :class:`MismatchError`, naming the ranks and
their values; nothing was reduced.

Why not skip the exchange for signatures already seen, as Horovod's response
cache does? A per-rank cache is not safe: if one rank's signature changes,
it alone would enter the exchange while the others, on a cache hit, went
straight on to the data phase -- a hang. Horovod's cache still exchanges a
bit vector every cycle for the same reason. What the exchange costs against
each algorithm: docs/results/reliability.md, "What the agreement check
costs"; benchmarks and callers that have agreed on their layout once
(``DistributedOptimizer``) turn it off with :func:`set_checks` /
``HPCJOBS_CHECKS=0``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import zlib

import numpy as np
from mpi4py import MPI

from ..comm import ranks_text, setting, signature
from ._shared import is_single_node

__all__ = ["AGREE_VIA_VALUES", "CHECKS_VALUES", "MismatchError", "SIG_WORDS", "checks_choice", "checks_enabled",
           "set_checks", "checking", "agree_or_raise", "agree_values", "exchange_of", "disagreements", "ranks_text"]

SIG_WORDS = 32  # int64s of a signature on oneshot's segment


class MismatchError(ValueError):
    """Ranks called a collective with different arguments, or one rank's
    arguments were invalid; raised on every rank with the same message."""


# HPCJOBS_CHECKS: on, or off with one of the last four (hpcjobs.comm refuses any other value on every rank)
CHECKS_VALUES = ("1", "on", "true", "yes", "0", "off", "false", "no")


def checks_choice() -> str:
    """``HPCJOBS_CHECKS`` as it is read: stripped, lower case ("" unset)."""
    return os.environ.get("HPCJOBS_CHECKS", "").strip().lower()


_enabled = checks_choice() not in CHECKS_VALUES[4:]


def set_checks(enabled: bool) -> None:
    """Turn the cross-rank agreement checks on or off for this process
    (every rank must choose the same). Default: on, unless ``HPCJOBS_CHECKS=0``."""
    global _enabled
    _enabled = bool(enabled)


def checks_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def checking(enabled: bool):
    """``with checking(False): ...``: checks off (or on) inside the block.
    Process-wide, as :func:`set_checks`: collectives other threads start
    meanwhile (a torch.distributed or Horovod worker's) run so too, so use it
    where every rank's threads are in step, not around one thread's calls
    while another's run (a rank checking a call another rank does not would
    leave them waiting on each other)."""
    global _enabled
    before, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = before


@functools.lru_cache(maxsize=1024)
def _encode(values: tuple, failed: bool) -> tuple[np.ndarray, memoryview]:
    # A signature seen before costs a cache lookup, not its encoding (crc32
    # of the strings): a few microseconds per call on small messages. Two
    # forms, built here once per signature: for MPI_Allreduce, comm.extremes'
    # [v, -v] with the failure flag after it (MIN over the ranks); for
    # oneshot's segment, [length, v..., failure flag] padded to
    # SIG_WORDS (compared word for word), long ones folded into a crc32.
    v = signature(values)
    mpi = np.concatenate([v, -v, [-int(failed)]])
    mpi.flags.writeable = False
    words = np.concatenate([[v.size], v, [int(failed)]]).astype(np.int64)
    if words.size > SIG_WORDS:
        words = np.concatenate([words[:SIG_WORDS - 1], [zlib.crc32(words[SIG_WORDS - 1:].tobytes())]])
    padded = np.zeros(SIG_WORDS, dtype=np.int64)
    padded[:words.size] = words
    return mpi, memoryview(padded)


def raise_if_any(comm: MPI.Intracomm, error: str | None, what: str, kind: type = RuntimeError) -> None:
    """Raise ``kind`` on every rank of ``comm`` where any rank has an ``error``
    (a message; None: none here), naming each such rank (collective, even with
    checks off: a failure on one rank would otherwise leave the others waiting)."""
    errors = [f"rank {r} ({e})" for r, e in enumerate(comm.allgather(error)) if e]
    if errors:
        raise kind(f"{what} on " + "; ".join(errors))


def agree_or_raise(comm: MPI.Intracomm, what: str, fields: dict, error: BaseException | None = None,
                   carry: tuple | None = None) -> bool:
    """Check that every rank of ``comm`` has the same ``fields`` and no
    ``error``; raise :class:`MismatchError` on every rank if not (collective).
    With checks off, or on one rank, nothing is exchanged and ``error``, if
    any, is raised as it is, on this rank.

    Args:
        what: the collective, for the message ("ring_allreduce").
        fields: name -> int or str (or None where this rank could not tell,
            because of its ``error``).
        error: this rank's local validation error, if any.
        carry: ``(flat, op)``, a small allreduce (at most
            ``oneshot.MAX_BYTES``) to run in the same exchange where the
            exchange is oneshot's segment: the ranks then wait once, not
            twice. Offer it only where the collective would run the oneshot
            step next anyway, so that ranks that agree also agree on whether
            it was carried.

    Returns:
        Whether ``carry`` was reduced (in place; then the caller is done).
    """
    return agree_values(comm, what, tuple(fields), tuple(fields.values()), error, carry)


def agree_values(comm: MPI.Intracomm, what: str, names: tuple, values: tuple,
                 error: BaseException | None = None, carry: tuple | None = None) -> bool:
    """:func:`agree_or_raise` with the fields as two tuples (the frame's
    form, which spares every checked call building a dict)."""
    if not _enabled or comm.Get_size() == 1:
        if error is not None:
            raise error
        return False
    mpi, padded = _encode(values, error is not None)
    last_comm, exchange = _last
    if last_comm is not comm:
        exchange = exchange_of(comm)
    carried = False
    if exchange is _SEGMENT:
        if carry is not None and error is None:
            agreed = carried = _oneshot.agree(comm, padded, *carry)
        else:
            agreed = _oneshot.agree(comm, padded)
    else:
        # Every rank agrees, and none failed, exactly when the MIN of [v, -v, -bad]
        # is this rank's own [v, -v, 0]: a rank with a larger value in a field
        # lowers -v, a smaller one lowers v, a failure lowers -bad. Every rank
        # then sees a difference, or none does.
        out = mpi.copy()
        comm.Allreduce(MPI.IN_PLACE, out, op=MPI.MIN)
        agreed = out.tobytes() == mpi.tobytes()
    if agreed and error is None:
        return carried
    # Every rank found a difference (a rank whose signature differs from some
    # other's differs from this one's, or this one differs from it): all
    # gather the readable signatures and raise the same message.
    fields = dict(zip(names, values))
    everyone = comm.allgather((fields, None if error is None else f"{type(error).__name__}: {error}", what))
    problems = disagreements({r: (f, err) for r, (f, err, _) in enumerate(everyone)}, fields)
    if not problems:  # a field this rank does not have, or a crc32 collision's reverse
        problems.append("the calls differ: " + "; ".join(f"rank {r}: {sorted(f)}" for r, (f, _, _) in enumerate(everyone)))
    whats = " / ".join(dict.fromkeys(w for _, _, w in everyone))  # the same text on every rank
    raise MismatchError(f"{whats}: the ranks of the communicator disagree or failed, so nothing was sent -- "
                        + " | ".join(problems))


def disagreements(calls: dict, names) -> list[str]:
    """What is wrong with the ranks' calls to one collective: ``calls`` maps
    a rank to ``(fields, error text or None)``; each rank's error, then each
    of ``names`` whose value differs among the ranks without an error
    ("shapes differs: rank 0: (3,); ranks 1,2: (4,)"). Empty when they agree."""
    problems = [f"rank {r}: {err}" for r, (_, err) in sorted(calls.items()) if err]
    for k in names:
        seen: dict[str, list[int]] = {}
        for r, (f, err) in sorted(calls.items()):
            if not err:
                seen.setdefault(str(f.get(k)), []).append(r)
        if len(seen) > 1:
            problems.append(f"{k} differs: " + "; ".join(f"{ranks_text(rs)}: {val}" for val, rs in seen.items()))
    return problems


_SEGMENT, _MPI = "segment", "mpi"
_EXCHANGE_KEYVAL = MPI.Comm.Create_keyval()
# HPCJOBS_AGREE_VIA=oneshot|mpi: the exchange (oneshot's segment on one
# node, by default; mpi to measure the other).
AGREE_VIA_VALUES = ("oneshot", "mpi")
_VIA = setting("HPCJOBS_AGREE_VIA")


def exchange_of(comm: MPI.Intracomm) -> str:
    """How the check exchanges on ``comm``, chosen once per communicator and
    the same on every rank (collective on first call): "segment", oneshot's,
    where every rank shares one node (one write, one wait, and a small
    message carried along), else "mpi" (``MPI_Allreduce``)."""
    global _last, _oneshot
    exchange = comm.Get_attr(_EXCHANGE_KEYVAL)
    if exchange is None:
        from . import oneshot  # (oneshot runs in the frame, which imports this module)

        _oneshot = oneshot
        shared = _VIA == "oneshot" and is_single_node(comm)
        exchange = _SEGMENT if shared else _MPI
        comm.Set_attr(_EXCHANGE_KEYVAL, exchange)
    _last = (comm, exchange)  # the usual run of calls on one communicator skips the attribute lookup
    return exchange


_last: tuple = (None, None)
_oneshot = None  # the module, imported on first use
