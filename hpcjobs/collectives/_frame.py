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
from .agreement import agree_or_raise, checks_enabled
from .device import DeviceFlat, as_device_flat, is_device_buffer
from .watchdog import guard

__all__ = ["run", "prepare", "Algorithm"]


def run(buf, op: str, comm, name: str, step: Callable, **options):
    """Run ``step(flat, op, private_comm, **options)`` on ``buf`` as the
    public collective ``name``.

    :func:`prepare` first (validate, and check that every rank agrees on
    ``name``, count, dtype, op and the options that are numbers or strings;
    an option left at None is not compared, so a call that passes it and one
    that does not agree), then the step, unless there is nothing to do (one rank, or zero
    elements: every rank then returns at once, which is safe because the
    count is the same on every rank), all under the stall watchdog.

    Args:
        name: what the agreement check and the watchdog call this collective,
            e.g. "ring_allreduce".

    Returns:
        ``buf``, reduced in place.
    """
    checked = ""
    if options and checks_enabled():
        checked = {k: v for k, v in sorted(options.items()) if isinstance(v, (bool, int, str))}
        checked = repr(checked) if checked else ""
    with guard(name):
        flat, comm = prepare(buf, op, comm, name, options=checked)
        if type(flat) is Flat:
            if flat.data.size and comm.Get_size() > 1:
                step(flat, op, comm, **options)
        elif flat.count and comm.Get_size() > 1:
            if getattr(step, "takes_device", False):
                step(flat, op, comm, **options)
            else:
                _staged(flat, op, comm, name, step, options)
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
    comm = private(comm)
    flat, error = None, None
    try:
        if op not in OP_TABLE:
            check_op(op)
        flat = as_flat(buf) if type(buf) is np.ndarray or not is_device_buffer(buf) else as_device_flat(buf)
    except (TypeError, ValueError) as e:
        error = e
    if error is None and (not checks_enabled() or comm.Get_size() == 1):
        return flat, comm  # nothing to agree on (the fast path of every call with checks off)
    agree_or_raise(comm, name, {"algorithm": name, "count": flat.count if flat else None,
                                "dtype": flat.dtype if flat else None, "op": op,
                                "device": (flat.device if isinstance(flat, DeviceFlat) else "cpu") if flat else None,
                                **fields}, error)
    return flat, comm


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
