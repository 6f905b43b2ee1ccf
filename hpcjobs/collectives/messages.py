"""The message-passing algorithms by name.

They move data only in messages on the communicator they are given, so they
run across nodes and their bytes can be counted
(:mod:`~hpcjobs.collectives.counting`): ``hierarchical``'s inter-node stage
and compressed payloads take one of them. :data:`MESSAGE_PASSING` is the
registry; :mod:`~hpcjobs.collectives.select` adds the shared-memory and
two-level algorithms to it.
"""

from __future__ import annotations

from . import parameter_server, rabenseifner, recursive_doubling, ring, tree
from ._frame import Algorithm
from .names import ALGORITHMS, MESSAGE_ALGORITHMS

__all__ = ["MESSAGE_PASSING", "message_passing"]

MESSAGE_PASSING: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("ring", "ring_allreduce", ring.allreduce),
    Algorithm("ring_pipelined", "ring_allreduce", ring.allreduce, {"segment_bytes": ring.DEFAULT_SEGMENT_BYTES}),
    Algorithm("recursive_doubling", "recursive_doubling_allreduce", recursive_doubling.allreduce),
    Algorithm("rabenseifner", "rabenseifner_allreduce", rabenseifner.allreduce),
    Algorithm("tree", "tree_allreduce", tree.allreduce),
    Algorithm("parameter_server", "parameter_server_allreduce", parameter_server.allreduce),
)}


def message_passing(name: str, what: str = "algorithm", also: tuple[str, ...] = ()) -> Algorithm:
    """The message-passing algorithm ``name``.

    Raises:
        ValueError: an unknown name, or one that moves data through shared
            memory or in two levels; ``what`` names the argument and ``also``
            the other names the caller takes, in the message.
    """
    if name in MESSAGE_PASSING:
        return MESSAGE_PASSING[name]
    choices = ", ".join([*also, *MESSAGE_ALGORITHMS])
    if name in ALGORITHMS or name == "auto":
        raise ValueError(f"{what}={name!r}: this needs a flat message-passing algorithm, one of {choices} "
                         f"({name} moves data through shared memory, in two levels or by choosing among them)")
    raise ValueError(f"unknown algorithm {name!r}; choose one of {choices}")
