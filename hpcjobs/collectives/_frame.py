"""The frame every public collective runs in, around its step function.

The collectives have two layers. A *step* is the algorithm itself:
``step(flat, op, comm, **options) -> None`` works in place on a validated
:class:`~hpcjobs.collectives._buffers.Flat` and the suite's private
communicator, every rank calling it with the same arguments; it checks
nothing, so steps compose (``hierarchical`` runs ``ring.reduce_scatter`` and
``shm.allgather`` on sub-communicators, ``auto`` runs whichever it chose).
The steps are the modules' public functions without a prefix
(``ring.allreduce``, ``tree.reduce``, ``shm.allgather``, ...); those that
only move data (``ring.allgather``, ``shm.allgather``, ``tree.bcast``) take
no op: ``step(flat, comm)``.

A *public collective* (``ring_allreduce(buf, ...)``) is :func:`run` around
its step: validate the buffer and op, check that every rank agrees on the
call (:mod:`~hpcjobs.collectives.agreement`), watch for stalls
(:mod:`~hpcjobs.collectives.watchdog`), then run the step.

A CUDA tensor becomes a :class:`~hpcjobs.collectives.device.DeviceFlat`
instead, and every rank must pass one (the device type is part of the
agreed signature). Steps that work on device memory themselves say so with
a ``takes_device = True`` attribute (``cuda_ipc``, ``hierarchical``, the
``auto`` step); any other step runs on host memory through the staged
transport (:mod:`~hpcjobs.collectives.staged`): pipelined in chunks for an
allreduce, which is elementwise, and whole for the rest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..comm import private
from ._buffers import OP_TABLE, Flat, as_flat, check_op
from . import agreement as _agreement
from .agreement import agree_values
from .device import DeviceFlat, as_device_flat, is_device_buffer
from .watchdog import enter, leave

__all__ = ["run", "prepare", "refuse", "checked", "Algorithm"]


def run(buf, op: str, comm, name: str, step: Callable, **options):
    """Run ``step(flat, op, private_comm, **options)`` on ``buf`` as the
    public collective ``name``.

    :func:`prepare` first (validate, and check that every rank agrees on
    ``name``, count, dtype, op and the options that are numbers or strings or say
    what must agree (``agreed``: a topology's layout);
    an option left at None is left out of them, so a call that passes it and
    one that does not differ), then the step, unless there is nothing to do (one rank, or zero
    elements: every rank then returns at once, which is safe because the
    count is the same on every rank), all under the stall watchdog.

    Args:
        name: what the agreement check and the watchdog call this collective,
            e.g. "ring_allreduce".

    The step runs with numpy's floating-point errors ignored, as MPI's own
    reductions do: under ``np.seterr(all="raise")`` (a NaN hunt) the rank
    whose sum overflowed raised alone and left the others in the collective
    until the watchdog; an overflow is inf and an invalid sum NaN, alike on
    every rank.

    Returns:
        ``buf``, reduced in place.
    """
    token = enter(name, comm)  # the stall watchdog's registration (not a `with guard`: cheaper, on every call)
    try:
        with np.errstate(all="ignore"):  # the step's reductions, and the check's of a message it carries
            if not _agreement._enabled and type(buf) is np.ndarray:
                # Checks off, a numpy array: nothing to agree on, and a bad buffer
                # or op raises on this rank as prepare() would -- minus its
                # bookkeeping, which on a small message costs as much as the step.
                if not isinstance(op, str) or op not in OP_TABLE:  # (MPI.SUM is unhashable: check_op names it)
                    check_op(op)
                flat, comm = as_flat(buf), private(comm)
            else:
                checked = ""
                if options and _agreement._enabled:
                    # numbers and strings, and an object's own words where it has them (a topology's layout: one
                    # detected otherwise on one rank ran other nodes' stages there, and hung)
                    checked = {k: v if isinstance(v, (bool, int, str)) else v.agreed for k, v in sorted(options.items())
                               if isinstance(v, (bool, int, str)) or hasattr(v, "agreed")}
                    checked = repr(checked) if checked else ""
                flat, comm, carried = _prepare(buf, op, comm, name, _RUN_FIELDS, (checked,), step)
                if carried:  # the check's exchange carried the message: done
                    return buf
            if type(flat) is Flat:
                if flat.data.size and comm.Get_size() > 1:
                    if options:
                        step(flat, op, comm, **options)
                    else:  # (a plain call: cheaper than unpacking an empty dict)
                        step(flat, op, comm)
            elif flat.count and comm.Get_size() > 1:
                if getattr(step, "takes_device", False):
                    step(flat, op, comm, **options)
                else:
                    _staged(flat, op, comm, name, step, options)
    finally:
        leave(token)
    return buf


def _staged(flat: DeviceFlat, op: str, comm, name: str, step: Callable, options: dict) -> None:
    from . import staged

    # Every allreduce's public name says so ("ring_allreduce", "allreduce_auto").
    if "allreduce" in name:
        staged.allreduce(flat, op, comm, functools.partial(step, **options) if options else step)
    else:
        staged.whole(flat, op, comm, step, **options)


def prepare(buf, op: str, comm, name: str, **fields):
    """Validate ``buf`` and ``op`` and, with checks on, agree across the
    ranks of ``comm`` on count, dtype, op, ``name`` and ``fields``.
    Returns ``(flat, private comm)``.

    Raises:
        TypeError, ValueError: a bad buffer or op, on this rank alone when
            checks are off; with checks on, every rank raises a
            MismatchError naming the rank(s) and their error or values.
    """
    flat, comm, _ = _prepare(buf, op, comm, name, _FIELDS + tuple(fields), tuple(fields.values()))
    return flat, comm


_FIELDS = ("algorithm", "count", "dtype", "op", "device")  # what every collective's check compares, then its own
_RUN_FIELDS = (*_FIELDS, "options")


def _prepare(buf, op: str, comm, name: str, names: tuple, extra: tuple, step: Callable | None = None):
    """:func:`prepare`, the fields given as their ``names`` (:data:`_FIELDS`
    and the caller's own) and the values of the caller's own (``extra``).
    Where ``step`` would run oneshot's step next on a small message, the
    check carries the message (one exchange, not two:
    :func:`~hpcjobs.collectives.agreement.agree_or_raise`). Returns
    ``(flat, private comm, whether the message was reduced)``."""
    comm = private(comm)
    flat, error = None, None
    try:
        if not isinstance(op, str) or op not in OP_TABLE:
            check_op(op)
        flat = as_flat(buf) if type(buf) is np.ndarray or not is_device_buffer(buf) else as_device_flat(buf)
    except (TypeError, ValueError) as e:
        error = e
    if error is None and (not _agreement._enabled or comm.Get_size() == 1):
        return flat, comm, False  # nothing to agree on
    carry = None
    if step is not None and type(flat) is Flat and flat.data.size:
        # A step that would run oneshot's step next, in one piece, says so
        # with a function to call once the check has carried the message.
        oneshot_next = getattr(step, "oneshot_next", None)
        count = oneshot_next(flat, op, comm) if oneshot_next is not None else None
        if count is not None:
            carry = (flat, op)
    carried = agree_values(comm, name, names, (*_values(name, buf, flat, op), *extra), error, carry)
    if carried:
        count()
    return flat, comm, carried


def _values(name: str, buf, flat, op: str) -> tuple:
    """The check's values of :data:`_FIELDS` for ``buf`` (``flat``: it as
    parsed, or None). An array of more than one dimension in Fortran order
    says so: its elements are reduced in memory order, so against a C-order
    array on another rank element (i, j) would meet another element. An op
    that is not a string (``MPI.SUM``, which cannot be hashed) is its repr:
    every rank then raises the refusal of it, not this one alone."""
    op = op if isinstance(op, str) else repr(op)
    if flat is None:
        return name, None, None, op, None
    if type(flat) is Flat:
        fortran = isinstance(buf, np.ndarray) and buf.ndim > 1 and not buf.flags.c_contiguous
        return name, flat.data.size, flat.dtype, op, "cpu, Fortran order" if fortran else "cpu"
    return name, flat.count, flat.dtype, op, flat.device


def refuse(buf, op: str, comm, name: str, error: BaseException):
    """Raise ``error`` on every rank of ``comm``: this rank cannot make the
    call (an unknown algorithm's) that the others make, and they wait in its
    check, where every rank now raises a MismatchError naming this rank's
    error. With checks off it is raised here alone."""
    comm = private(comm)
    try:
        flat = as_flat(buf) if type(buf) is np.ndarray or not is_device_buffer(buf) else as_device_flat(buf)
    except (TypeError, ValueError):
        flat = None
    agree_values(comm, name, _RUN_FIELDS, (*_values(name, buf, flat, op), ""), error)
    raise error


def checked(buf, op: str, comm, name: str, check: Callable, *args):
    """``check(*args)`` -- a public collective's check of its own options,
    which returns them as the step takes them. Where it raises (a bad option
    on this rank, which the others may not share: ``int(inf)``'s
    OverflowError too) the error is raised, with checks on, on every rank
    through :func:`refuse`, so the ranks that passed good options do not
    wait in the call's check for ever; with checks off on this rank alone,
    as :func:`refuse` says."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 -- a check's own error, whatever its kind: told to every rank
        refuse(buf, op, comm, name, e)


@dataclass(frozen=True)
class Algorithm:
    """An allreduce algorithm by name: its step, the options it passes, and
    the public function ``allreduce(algorithm=name)`` is the same call as
    (the name the agreement check and the watchdog use), so that ranks
    calling either agree."""

    name: str
    public: str
    step: Callable
    options: dict = field(default_factory=dict)

    @property
    def bound(self) -> Callable:
        """``step(flat, op, comm)`` with the options bound."""
        return functools.partial(self.step, **self.options) if self.options else self.step

    def run(self, buf, op: str, comm):
        """The public collective on ``buf``: :func:`run`."""
        return run(buf, op, comm, self.public, self.step, **self.options)
