"""``allreduce(buf, algorithm=...)``: one entry point over every algorithm.

``algorithm="auto"`` chooses per message size and group size (:func:`choose`).
"""

from __future__ import annotations

from typing import Callable

from mpi4py import MPI

from ._buffers import as_flat, check_op
from .ring import DEFAULT_SEGMENT_BYTES, ring_allreduce

__all__ = ["ALGORITHMS", "allreduce", "choose"]


def _ring_pipelined(buf, op, comm):
    return ring_allreduce(buf, op, comm, pipeline=True, segment_bytes=DEFAULT_SEGMENT_BYTES)


# name -> fn(buf, op, comm); "auto" is resolved by choose().
ALGORITHMS: dict[str, Callable] = {
    "ring": ring_allreduce,
    "ring_pipelined": _ring_pipelined,
}

def choose(nbytes: int, size: int) -> str:
    """The algorithm ``auto`` uses for ``nbytes`` bytes over ``size`` ranks.

    The plain ring, for now. Pipelining pays where something else moves the
    bytes while the CPU reduces (a NIC, a copy engine); on a shared-memory
    node with one core per rank the same CPU does both, and at 2 ranks here
    the pipelined ring measured no better at any size (README, "Pipelined
    ring"). The tuning table replaces this with per-machine measurements.
    """
    return "ring"


def allreduce(buf, op: str = "sum", algorithm: str = "auto", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place with the named algorithm.

    Args:
        buf: numpy array or torch CPU tensor, contiguous and writable.
        op: "sum", "avg", "min", "max" or "prod".
        algorithm: a key of :data:`ALGORITHMS`, or "auto".
        comm: intracommunicator; None for COMM_WORLD.

    Returns:
        ``buf``, reduced in place.

    Raises:
        ValueError: unknown algorithm or op; TypeError/ValueError for a bad buffer.
    """
    check_op(op)
    if algorithm == "auto":
        algorithm = choose(as_flat(buf).nbytes, (comm or MPI.COMM_WORLD).Get_size())
    try:
        fn = ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {algorithm!r}; choose one of {', '.join(['auto', *ALGORITHMS])}"
        ) from None
    return fn(buf, op, comm)
