"""Bytes on the wire, counted as they are sent.

:class:`CountingComm` wraps a communicator and adds up the size of every
buffer handed to a point-to-point send; :func:`counted_allreduce` runs one
of the message-passing algorithms through it and returns what this rank
sent. ``hpcjobs model`` uses it to check the byte formulas, and
``compressed_allreduce`` to report real wire bytes for each compressor.

The shared-memory algorithms (``shm``, and ``hierarchical``'s stages on
sub-communicators) move data through shared windows rather than messages
on the given communicator, so they cannot be counted here: counting asks
for one of :data:`~hpcjobs.collectives.names.MESSAGE_ALGORITHMS`, and
``auto`` is resolved among them.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ._buffers import Flat
from ._frame import prepare
from .auto import _agree_on as agree_on, _decisions as auto_decisions, choose
from .messages import message_passing
from .names import MESSAGE_ALGORITHMS
from .watchdog import guard

__all__ = ["CountingComm", "MESSAGE_ALGORITHMS", "counted_allreduce", "message_algorithm", "send_counted"]


class CountingComm:
    """A communicator proxy that adds up the bytes of every buffer sent
    through it; everything else goes to the real communicator."""

    def __init__(self, comm: MPI.Intracomm):
        self._comm = comm
        self.sent = 0
        self.received = 0
        self.sent_to: dict[int, int] = {}  # destination rank -> bytes (which of them cross a node's uplink)

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _count(self, buf, dest) -> None:
        n = memoryview(buf).nbytes
        self.sent += n
        self.sent_to[dest] = self.sent_to.get(dest, 0) + n

    def Send(self, buf, dest, tag=0):
        self._count(buf, dest)
        return self._comm.Send(buf, dest, tag)

    def Isend(self, buf, dest, tag=0):
        self._count(buf, dest)
        return self._comm.Isend(buf, dest, tag)

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        self.received += memoryview(buf).nbytes
        return self._comm.Recv(buf, source, tag)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        self.received += memoryview(buf).nbytes
        return self._comm.Irecv(buf, source, tag)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG):
        self._count(sendbuf, dest)
        self.received += memoryview(recvbuf).nbytes
        return self._comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)


def message_algorithm(algorithm: str, nbytes: int, ranks: int) -> str:
    """``algorithm`` itself, or for "auto" the tuning table's choice with the
    shared-memory algorithms replaced by the ring.

    Raises:
        ValueError: an unknown or shared-memory algorithm.
    """
    if algorithm == "auto":
        name = choose(nbytes, ranks)
        return name if name in MESSAGE_ALGORITHMS else "ring"
    return message_passing(algorithm, also=("auto",)).name


def agreed(nbytes: int, comm: MPI.Intracomm, choice) -> str:
    """``choice()``, the algorithm this rank's table gives a collective of
    ``nbytes`` that does not time its contenders (a compressed payload's,
    :func:`hpcjobs.collectives.counting.send_counted`), checked to be every
    rank's once per size on ``comm``: as in auto's own check, ranks whose
    tables differ would each run their own algorithm and hang (collective
    the first time)."""
    decisions = auto_decisions(comm)
    key = ("message", nbytes)
    name = decisions.get(key)
    if name is None:
        try:
            name, error = choice(), None
        except Exception as e:  # noqa: BLE001 -- this rank's own table: every rank raises it below
            name, error = "", f"{type(e).__name__}: {e}"
        agree_on([name] if name else [], error, nbytes, comm)
        decisions[key] = name
    return name


def counted_allreduce(buf, op: str = "sum", algorithm: str = "auto", comm: MPI.Intracomm | None = None) -> int:
    """Allreduce ``buf`` in place like :func:`hpcjobs.collectives.allreduce`
    and return the bytes this rank sent (collective).

    Args:
        comm: intracommunicator; None for COMM_WORLD.
    """
    with guard("counted_allreduce", comm):
        flat, comm = prepare(buf, op, comm, "counted_allreduce", algorithm=algorithm)
        return send_counted(flat, op, algorithm, comm)


def send_counted(flat: Flat, op: str, algorithm: str, comm: MPI.Intracomm) -> int:
    """The allreduce of :func:`counted_allreduce` on a validated Flat and a
    private communicator whose ranks have already agreed: no check."""
    if comm.Get_size() == 1 or flat.count == 0:
        return 0
    proxy = CountingComm(comm)
    size = comm.Get_size()
    name = (agreed(flat.nbytes, comm, lambda: message_algorithm(algorithm, flat.nbytes, size)) if algorithm == "auto"
            else message_algorithm(algorithm, flat.nbytes, size))
    with np.errstate(all="ignore"):  # as the public collectives (hpcjobs.collectives._frame.run)
        message_passing(name).bound(flat, op, proxy)
    return proxy.sent
