"""The communicators DistributedOptimizers reduce on, and their threads.

One optimizer reduces on the suite's private duplicate of its communicator
(:func:`~hpcjobs.comm.private`). Two on one model -- Muon for the matrices
and AdamW for the rest, a GAN's pair -- each reduce on a communication
thread of their own during backward, and on one communicator their
collectives met the other's: wrong averages that differed by rank, an
IndexError, or a hang. So an optimizer made while another one not closed
reduces on that communicator gets a duplicate of its own, which its
``close()`` frees.

Whether one is live is agreed over the user's communicator itself, never
over one a thread may be reducing on: a dropped optimizer (its hooks make a
cycle) is collected at different times on different ranks, so each rank
collects first and the ranks take the OR. Below ``MPI_THREAD_MULTIPLE``
only one thread may be in MPI at once: :data:`THREADS` takes the
optimizers' threads one at a time there.
"""

from __future__ import annotations

import gc
import threading
import weakref

from mpi4py import MPI

from ..comm import private

__all__ = ["THREADS", "communicator"]


class _Serial:
    """A lock below MPI_THREAD_MULTIPLE, a no-op above it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._needed: bool | None = None

    def __enter__(self):
        if self._needed is None:
            self._needed = MPI.Query_thread() < MPI.THREAD_MULTIPLE
        if self._needed:
            self._lock.acquire()

    def __exit__(self, *exc):
        if self._needed:
            self._lock.release()
        return False


THREADS = _Serial()
_LIVE: dict[int, weakref.WeakSet] = {}  # id of a private communicator -> the optimizers made on it


def communicator(owner, comm: MPI.Comm | None) -> tuple[MPI.Comm, MPI.Intracomm, MPI.Comm | None]:
    """``(user communicator, private communicator, own duplicate or None)``
    for the optimizer ``owner`` (collective over ``comm``; None:
    COMM_WORLD). ``owner`` has a ``_closed`` flag, True once closed."""
    comm = comm if comm is not None else MPI.COMM_WORLD
    shared = private(comm)  # collective: done here, never first on the thread
    live = _LIVE.setdefault(id(shared), weakref.WeakSet())
    if any(not o._closed for o in live):  # one dropped but not yet collected
        gc.collect()
    busy = comm.allreduce(any(not o._closed for o in live), op=MPI.LOR)
    live.add(owner)
    if not busy:
        return comm, shared, None
    own = comm.Dup()
    return own, private(own), own
