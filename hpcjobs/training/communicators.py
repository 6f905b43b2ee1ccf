"""The communicators DistributedOptimizers reduce on, and their threads.

One optimizer reduces on the suite's private duplicate of its communicator
(:func:`~hpcjobs.comm.private`). Two on one model -- Muon for the matrices
and AdamW for the rest, a GAN's pair -- each reduce on a communication
thread of their own during backward, and on one communicator their
collectives met the other's: wrong averages that differed by rank, an
IndexError, or a hang. So an optimizer made while another one not closed
reduces on that communicator gets a duplicate of its own, which its
``close()`` frees; so does one that reduces on a thread (``overlap="thread"``),
whose buckets had met a metric's average that the main thread ran on the
same communicator between backward and ``step()``. Two threads in MPI at once need ``MPI_THREAD_MULTIPLE``;
below it the second optimizer is refused (taking turns under a lock held
across blocking collectives could deadlock: which thread takes it first
differs by rank).

Whether one is live is agreed over the user's communicator itself, never
over one a thread may be reducing on, after a collection on each rank: a
dropped optimizer is collected at different times on different ranks. Its
hooks and its thread hold it weakly (:func:`weakly`, :func:`serve`), so a
dropped one is collected at all: its hooks are removed and its thread ends
(:func:`dropped`).
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
from mpi4py import MPI

from ..collectives.watchdog import guard
from ..comm import private

__all__ = ["communicator", "weakly", "serve", "dropped", "any_rank"]

_LIVE: dict[int, weakref.WeakSet] = {}  # id of a private communicator -> the optimizers made on it


def communicator(owner, comm: MPI.Comm | None, own: bool = False
                 ) -> tuple[MPI.Comm, MPI.Intracomm, MPI.Comm | None]:
    """``(user communicator, private communicator, own duplicate or None)``
    for the optimizer ``owner`` (collective over ``comm``; None:
    COMM_WORLD). ``owner`` has a ``_closed`` flag, True once closed.
    ``own``: a duplicate whatever else is live (a communication thread's,
    beside the main thread's calls on the user's communicator).

    Raises:
        ValueError: another optimizer is live there and this MPI gives less
            than MPI_THREAD_MULTIPLE (on every rank alike).
    """
    comm = comm if comm is not None else MPI.COMM_WORLD
    shared = private(comm)  # collective: done here, never first on the thread
    live = _LIVE.setdefault(id(shared), weakref.WeakSet())
    if any(not o._closed for o in live):  # one dropped but not yet collected
        gc.collect()
    busy = comm.allreduce(any(not o._closed for o in live), op=MPI.LOR)
    if not busy and not own:
        live.add(owner)
        return comm, shared, None
    if busy and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise ValueError("another DistributedOptimizer on this communicator is not closed, and two reducing at "
                         f"once need MPI_THREAD_MULTIPLE (this MPI gives level {MPI.Query_thread()}): close() the "
                         "other first")
    live.add(owner)
    own = comm.Dup()
    return own, private(own), own


def weakly(owner, name: str):
    """A function calling ``owner.<name>(*args)`` while ``owner`` lives, and
    doing nothing after (a gradient hook that does not keep it alive)."""
    ref = weakref.ref(owner)

    def call(*args):
        o = ref()
        return None if o is None else getattr(o, name)(*args)

    return call


def serve(ref, q) -> None:
    """The communication thread: reduce each bucket ``q`` gives it with the
    optimizer ``ref()`` (held only while it reduces), until None."""
    while True:
        bucket = q.get()
        if bucket is None:
            return
        owner = ref()
        try:
            if owner is not None and owner._error is None:
                owner._reduce(bucket)
        except BaseException as e:  # handed to the main thread in synchronize()
            owner._error = e
        finally:  # the optimizer let go before the main thread wakes: dropped then, it is collected at once
            owner = None
            bucket.done.set()


def _end(handles: list, q) -> None:
    for h in handles:
        h.remove()
    q.put(None)


def dropped(owner, handles: list, q) -> None:
    """Once ``owner`` is collected without ``close()``: remove its hooks
    (``handles``) and end its thread (``q``)."""
    weakref.finalize(owner, _end, handles, q)


def any_rank(comm: MPI.Intracomm, mine: int, what: str) -> int:
    """The largest of the ranks' ``mine`` (a bool: whether it holds on some rank; a level, 0 for none: the
    highest any rank saw), collective over ``comm``, watched as ``what``: one integer's MAX."""
    flag = np.array([int(mine)], np.int32)
    with guard(what, comm):
        comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    return int(flag[0])
