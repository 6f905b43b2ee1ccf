"""``allreduce(buf, algorithm=...)``: one entry point over every algorithm.

:data:`REGISTRY` holds every algorithm by name
(:data:`~hpcjobs.collectives.names.ALGORITHMS`): the message-passing ones
(:mod:`~hpcjobs.collectives.messages`), the shared-memory one and the
two-level one. ``algorithm="auto"`` chooses among them
(:mod:`~hpcjobs.collectives.auto`).
"""

from __future__ import annotations

import functools

from mpi4py import MPI

from . import auto, hierarchical, shm
from ._frame import Algorithm, run
from .messages import MESSAGE_PASSING
from .names import ALGORITHMS

__all__ = ["REGISTRY", "AUTO", "allreduce", "lookup"]

REGISTRY: dict[str, Algorithm] = {
    **MESSAGE_PASSING,
    # with the public functions' defaults, so that both calls agree across ranks
    "hierarchical": Algorithm("hierarchical", "hierarchical_allreduce", hierarchical.allreduce,
                              {"inter": "ring", "intra": "ring"}),
    "shm": Algorithm("shm", "shm_allreduce", shm.allreduce, {"block_bytes": shm.DEFAULT_BLOCK_BYTES}),
}
# The public name of auto's calls: what the agreement check and the watchdog say.
AUTO = "allreduce_auto"


def lookup(name: str) -> Algorithm:
    """The algorithm ``name`` (one of :data:`ALGORITHMS`).

    Raises:
        ValueError: an unknown name.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(['auto', *ALGORITHMS])}") from None


def allreduce(buf, op: str = "sum", algorithm: str = "auto", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place with the named algorithm.

    Args:
        buf: numpy array or torch CPU tensor, contiguous and writable; the
            same count and dtype on every rank.
        op: "sum", "avg", "min", "max" or "prod".
        algorithm: one of :data:`ALGORITHMS`, or "auto" (tuning table).
        comm: intracommunicator; None for COMM_WORLD.

    Returns:
        ``buf``, reduced in place.

    Raises:
        ValueError: unknown algorithm or op, an unreadable tuning table, or a
            bad buffer (TypeError: unsupported buffer type or dtype).
    """
    if algorithm == "auto":
        return run(buf, op, comm, AUTO, _auto)
    return lookup(algorithm).run(buf, op, comm)


_auto = functools.partial(auto.allreduce, registry=REGISTRY)
