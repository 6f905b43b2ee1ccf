"""``allreduce(buf, algorithm=...)``: one entry point over every algorithm,
and ``algorithm="auto"``, which picks one from a measured tuning table.

The tuning table (written by ``hpcjobs tune``) lists, for a number of ranks
and nodes, the fastest algorithm up to each message size::

    {"version": 1, "tables": [{"ranks": 2, "nodes": 1,
        "rows": [{"max_bytes": 4096, "algorithm": "recursive_doubling"},
                 {"max_bytes": null, "algorithm": "shm"}]}]}

``auto`` reads the file named by ``HPCJOBS_TUNING`` (or :func:`set_tuning`),
takes the table with the same ranks and nodes, else the same nodes and the
nearest ranks, else the nearest overall, and falls back on
:data:`DEFAULT_TABLE` when there is no file. It reads the node layout
(``hpcjobs.topology``, ``HPCJOBS_RANKS_PER_NODE``) once per communicator and
caches each decision on it per size, so a call costs a dictionary lookup.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
from typing import Callable

from mpi4py import MPI

from ._buffers import Flat, run
from .hierarchical import _hierarchical
from .parameter_server import _parameter_server
from .rabenseifner import _rabenseifner
from .recursive_doubling import _recursive_doubling
from .ring import DEFAULT_SEGMENT_BYTES, _ring_allreduce
from .shm import _shm_allreduce, is_single_node
from .tree import _tree

__all__ = ["ALGORITHMS", "DEFAULT_TABLE", "allreduce", "choose", "flat_algorithm", "load_tuning", "set_tuning"]

# name -> internal fn(flat, op, private_comm); "auto" is resolved by choose().
_INTERNAL: dict[str, Callable] = {
    "ring": _ring_allreduce,
    "ring_pipelined": functools.partial(_ring_allreduce, segment_bytes=DEFAULT_SEGMENT_BYTES),
    "recursive_doubling": _recursive_doubling,
    "rabenseifner": _rabenseifner,
    "tree": _tree,
    "parameter_server": _parameter_server,
    "hierarchical": _hierarchical,
    "shm": _shm_allreduce,
}
ALGORITHMS = tuple(_INTERNAL)

# Used when no tuning file exists: from `hpcjobs tune` at 2 ranks on the CI
# machine (README, "Tuning"), generalised: the latency-optimal algorithm for
# small messages, shared memory on one node for large ones, and the
# two-level algorithm across nodes.
DEFAULT_TABLE = {
    "version": 1,
    "tables": [
        {"ranks": 2, "nodes": 1, "rows": [{"max_bytes": 32 << 10, "algorithm": "recursive_doubling"},
                                          {"max_bytes": 512 << 10, "algorithm": "ring"},
                                          {"max_bytes": None, "algorithm": "shm"}]},
        {"ranks": 16, "nodes": 2, "rows": [{"max_bytes": 16 << 10, "algorithm": "recursive_doubling"},
                                           {"max_bytes": None, "algorithm": "hierarchical"}]},
    ],
}


def flat_algorithm(name: str) -> Callable:
    """The internal ``fn(flat, op, private_comm)`` of an algorithm name."""
    try:
        return _INTERNAL[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(['auto', *ALGORITHMS])}") from None


_tuning_path: str | None = None


def set_tuning(path: str | None) -> None:
    """Use this tuning file for ``auto`` from now on (None: ``HPCJOBS_TUNING``
    or the built-in default). Clears cached decisions."""
    global _tuning_path, _decisions_generation
    _tuning_path = path
    load_tuning.cache_clear()
    _decisions_generation += 1


@functools.lru_cache(maxsize=4)
def load_tuning(path: str | None) -> dict:
    """Read and check a tuning file; None gives :data:`DEFAULT_TABLE`.

    Raises:
        ValueError: the file is missing, not JSON, or names an unknown algorithm.
    """
    if path is None:
        return DEFAULT_TABLE
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read tuning table {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"tuning table {path} is not JSON: {e}") from None
    tables = data.get("tables") if isinstance(data, dict) else None
    if not tables:
        raise ValueError(f"tuning table {path} has no 'tables'")
    for t in tables:
        for row in t.get("rows", []):
            if row.get("algorithm") not in _INTERNAL:
                raise ValueError(f"tuning table {path}: unknown algorithm {row.get('algorithm')!r}")
        if not t.get("rows") or t["rows"][-1].get("max_bytes") is not None:
            raise ValueError(f"tuning table {path}: each table's last row needs max_bytes null (no upper bound)")
    return data


def _pick_table(data: dict, ranks: int, nodes: int) -> dict:
    def distance(t):
        return (t["nodes"] != nodes, abs(t["nodes"] - nodes), abs(t["ranks"] - ranks))

    return min(data["tables"], key=distance)


def choose(nbytes: int, ranks: int, nodes: int = 1, tuning: dict | None = None) -> str:
    """The algorithm ``auto`` picks for ``nbytes`` over ``ranks`` ranks on ``nodes`` nodes."""
    table = _pick_table(tuning or load_tuning(_tuning_path or os.environ.get("HPCJOBS_TUNING") or None), ranks, nodes)
    rows = table["rows"]
    bounds = [r["max_bytes"] for r in rows[:-1]]
    name = rows[bisect.bisect_left(bounds, nbytes)]["algorithm"]
    if name == "shm" and nodes > 1:
        name = "hierarchical"
    return name


# Decisions live on the communicator (MPI attribute), so they go with it.
_DECISIONS_KEYVAL = MPI.Comm.Create_keyval()
_decisions_generation = 0


def _allreduce_auto(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    decisions = comm.Get_attr(_DECISIONS_KEYVAL)
    if decisions is None or decisions.get("generation") != _decisions_generation:
        decisions = {"generation": _decisions_generation}
        comm.Set_attr(_DECISIONS_KEYVAL, decisions)
    key = flat.nbytes
    fn = decisions.get(key)
    if fn is None:
        from ..topology import detect_private

        topo = decisions.get("topology")
        if topo is None:  # the layout, read once per communicator (and set_tuning)
            topo = decisions["topology"] = detect_private(comm)
        name = choose(flat.nbytes, comm.Get_size(), topo.num_nodes)
        if name == "shm" and not is_single_node(comm):
            name = "hierarchical"
        fn = _INTERNAL[name]
        decisions[key] = fn
    fn(flat, op, comm)


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
    fn = _allreduce_auto if algorithm == "auto" else flat_algorithm(algorithm)
    return run(buf, op, comm, fn)
