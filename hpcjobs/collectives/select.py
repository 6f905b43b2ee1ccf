"""``allreduce(buf, algorithm=...)``: one entry point over every algorithm,
and ``algorithm="auto"``, which picks one from a measured tuning table and
keeps measuring.

The tuning table (written by ``hpcjobs tune``) lists, for a number of ranks
and nodes, the fastest algorithm up to each message size, and the
contenders that came close there::

    {"version": 1, "tables": [{"ranks": 2, "nodes": 1,
        "rows": [{"max_bytes": 4096, "algorithm": "recursive_doubling",
                  "candidates": ["recursive_doubling", "tree"]},
                 {"max_bytes": null, "algorithm": "shm"}]}]}

``auto`` reads the file named by ``HPCJOBS_TUNING`` (or :func:`set_tuning`),
takes the table with the same ranks and nodes, else the same nodes and the
nearest ranks, else the nearest overall, and falls back on
:data:`DEFAULT_TABLE` when there is no file. It reads the node layout
(``hpcjobs.topology``, ``HPCJOBS_RANKS_PER_NODE``) once per communicator and
caches each decision on it per size, so a call costs a dictionary lookup.

Where a row lists several candidates, ``auto`` also times them in place: on
a shared node the fastest algorithm at a size changes with the load beside
it (the shared-memory one most: it relies on the last-level cache, which
neighbours share), so a table measured a minute ago can be wrong by 3x now.
The first calls at a size run each candidate in turn: twice untimed (the
first calls on a buffer pay for allocation and cold caches), then
:func:`timed_rounds` times (5, or 15 for small messages), each call timed
from a barrier, in a fresh order each round, as ``hpcjobs bench`` times
(what ran just before a call changes its time); then one small
``MPI_Allreduce`` (maximum over ranks) of those times gives every rank the
same numbers, and every rank keeps the candidate with the lowest median
time. It measures again every :data:`REMEASURE_EVERY` calls at that size.
Horovod's autotuner times its own settings online the same way.
Only candidates that give bitwise the same result are compared (every
algorithm does for min and max, for integers, and at two ranks), so which
one wins never changes a run's numbers; floating-point sums over three or
more ranks follow the table alone.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import random
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..comm import private
from ._buffers import Flat, as_flat, run
from .hierarchical import _hierarchical
from .parameter_server import _parameter_server
from .rabenseifner import _rabenseifner
from .recursive_doubling import _recursive_doubling
from .ring import DEFAULT_SEGMENT_BYTES, _ring_allreduce
from .shm import _shm_allreduce, is_single_node
from .tree import _tree

__all__ = ["ALGORITHMS", "DEFAULT_TABLE", "REMEASURE_EVERY", "UNTIMED_TURNS", "allreduce", "candidates", "choose",
           "flat_algorithm", "kept", "load_tuning", "remeasure", "same_bits", "set_tuning", "settled",
           "shuffled_rounds", "timed_rounds"]

# name -> internal fn(flat, op, private_comm); "auto" is resolved by _allreduce_auto.
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
# The candidates are the algorithms that won or came second in that range
# across several `hpcjobs tune` runs here, in the host's calm and busy spells.
DEFAULT_TABLE = {
    "version": 1,
    "tables": [
        {"ranks": 2, "nodes": 1, "rows": [
            {"max_bytes": 16 << 10, "algorithm": "recursive_doubling",
             "candidates": ["recursive_doubling", "parameter_server", "tree"]},
            # Where latency gives way to bandwidth: here each of the three won some runs.
            {"max_bytes": 64 << 10, "algorithm": "shm",
             "candidates": ["shm", "recursive_doubling", "parameter_server"]},
            {"max_bytes": 4 << 20, "algorithm": "shm", "candidates": ["shm", "ring", "rabenseifner"]},
            {"max_bytes": None, "algorithm": "shm", "candidates": ["shm", "ring_pipelined", "rabenseifner"]}]},
        {"ranks": 16, "nodes": 2, "rows": [
            {"max_bytes": 16 << 10, "algorithm": "recursive_doubling",
             "candidates": ["recursive_doubling", "tree"]},
            {"max_bytes": None, "algorithm": "hierarchical", "candidates": ["hierarchical", "ring_pipelined"]}]},
    ],
}
# Calls at one message size between two measurements of its candidates.
REMEASURE_EVERY = 1000
# Untimed turns of every candidate before a measurement's timed rounds. On a
# fresh buffer the shared-memory algorithm's first two calls here took 1.5-2x
# its steady time (the others' about 1.3x); one turn left its first timed
# round in that, enough to lose a 1 MB measurement it wins by 1.3x.
UNTIMED_TURNS = 2
# Timed calls of each candidate per measurement, of which the median counts:
# in a busy spell here one call in three or four of the shared-memory
# algorithm's is 2-3x slow, which a median of five rides over. A measurement
# is then (2 + 5) calls per candidate, 2% of the calls between measurements.
TIMED_ROUNDS = 5
# Up to SMALL_BYTES a call takes ~10 us here, and one call's noise (about
# 1 us) is larger than the gaps between the latency-bound algorithms; the
# median of 15 halves the error of a median of 5, for half a millisecond.
SMALL_TIMED_ROUNDS, SMALL_BYTES = 15, 16 << 10


def timed_rounds(nbytes: int) -> int:
    """Timed calls of each candidate in one measurement at ``nbytes``."""
    return SMALL_TIMED_ROUNDS if nbytes <= SMALL_BYTES else TIMED_ROUNDS


def shuffled_rounds(n: int, rounds: int) -> list[list[int]]:
    """``rounds`` orders of ``range(n)``, each shuffled afresh by one
    generator with a fixed seed, so every rank gets the same ones: the order
    in which ``auto`` and the benchmarks time several implementations, round
    after round. In a fixed order each one would always follow the same
    other, and what ran just before changes a call's time: here the
    shared-memory algorithm lost measurements at 4 and 64 MB in a fixed
    order that it won in a shuffled one (README, "auto")."""
    shuffle, orders = random.Random(n).shuffle, []
    for _ in range(rounds):
        turn = list(range(n))
        shuffle(turn)
        orders.append(turn)
    return orders


def _turn_order(n: int, rounds: int) -> list[int]:
    """Which of ``n`` candidates each call of a measurement runs:
    :data:`UNTIMED_TURNS` + ``rounds`` rounds of :func:`shuffled_rounds`."""
    return [j for turn in shuffled_rounds(n, UNTIMED_TURNS + rounds) for j in turn]


def flat_algorithm(name: str) -> Callable:
    """The internal ``fn(flat, op, private_comm)`` of an algorithm name."""
    try:
        return _INTERNAL[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(['auto', *ALGORITHMS])}") from None


_tuning_path: str | None = None


def set_tuning(path: str | None) -> None:
    """Use this tuning file for ``auto`` from now on (None: ``HPCJOBS_TUNING``
    or the built-in default). Clears cached decisions (:func:`remeasure`)."""
    global _tuning_path
    _tuning_path = path
    load_tuning.cache_clear()
    remeasure()


def remeasure() -> None:
    """Forget what ``auto`` measured, on every communicator: its next call at
    each size times the candidates again, as it does every
    :data:`REMEASURE_EVERY` calls. Call it on every rank, between
    collectives; ``hpcjobs bench --passes`` does before each pass, so that
    each pass measures as a fresh job would."""
    global _decisions_generation, _last
    _decisions_generation += 1
    _last = (None, None)


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
            for name in [row.get("algorithm"), *row.get("candidates", [])]:
                if name not in _INTERNAL:
                    raise ValueError(f"tuning table {path}: unknown algorithm {name!r}")
        if not t.get("rows") or t["rows"][-1].get("max_bytes") is not None:
            raise ValueError(f"tuning table {path}: each table's last row needs max_bytes null (no upper bound)")
    return data


def _pick_table(data: dict, ranks: int, nodes: int) -> dict:
    def distance(t):
        return (t["nodes"] != nodes, abs(t["nodes"] - nodes), abs(t["ranks"] - ranks))

    return min(data["tables"], key=distance)


def _row(nbytes: int, ranks: int, nodes: int, tuning: dict | None) -> dict:
    table = _pick_table(tuning or load_tuning(_tuning_path or os.environ.get("HPCJOBS_TUNING") or None), ranks, nodes)
    rows = table["rows"]
    bounds = [r["max_bytes"] for r in rows[:-1]]
    return rows[bisect.bisect_left(bounds, nbytes)]


def _placed(name: str, one_node: bool) -> str:
    return name if name != "shm" or one_node else "hierarchical"


def choose(nbytes: int, ranks: int, nodes: int = 1, tuning: dict | None = None) -> str:
    """The algorithm the table gives ``auto`` for ``nbytes`` over ``ranks``
    ranks on ``nodes`` nodes (what it runs until it has timed the others)."""
    return _placed(_row(nbytes, ranks, nodes, tuning)["algorithm"], nodes == 1)


def candidates(nbytes: int, ranks: int, nodes: int = 1, tuning: dict | None = None) -> list[str]:
    """The table's choice first, then the row's other contenders: its
    ``candidates``, or for a table without them (an older ``hpcjobs tune``)
    the runner-ups it measured."""
    row = _row(nbytes, ranks, nodes, tuning)
    names = row.get("candidates") or [row["algorithm"], *(m.get("runner_up") for m in row.get("measured", []))]
    names = [n for n in names if n in _INTERNAL]  # a hand-edited table's "measured" may name anything
    return list(dict.fromkeys(_placed(n, nodes == 1) for n in [row["algorithm"], *names]))


def same_bits(dtype: str, op: str, ranks: int) -> bool:
    """Whether every algorithm gives bitwise the same result: min and max,
    integers (wrap-around sums and products do not depend on order), and any
    op at two ranks (a + b, once). Floating-point sums over three or more
    ranks round differently in different orders."""
    return op in ("min", "max") or ranks <= 2 or not (dtype == "bfloat16" or dtype.startswith("float"))


class _Timing:
    """``auto``'s decision at one message size, and its measurement.

    A measurement is :data:`UNTIMED_TURNS` untimed turns of every candidate
    (the first calls on a buffer are slow: allocation, cold caches, and on
    this VM fresh pages stay slow for a few passes), then
    :func:`timed_rounds` rounds of one timed call each, every call started
    together (barrier) so that a rank still finishing the previous call does
    not count against the next; each round in its own order
    (:func:`_turn_order`). After the last one the times are maxed over
    ranks and the candidate with the lowest median kept, until
    :data:`REMEASURE_EVERY` calls after the measurement began (at least one
    call: :func:`settled` must become true). ``left`` counts the calls to go
    before the next measurement.
    """

    __slots__ = ("names", "fns", "fn", "rounds", "order", "times", "left", "turn")

    def __init__(self, names: list[str], nbytes: int):
        self.names = names
        self.fns = [_INTERNAL[n] for n in names]
        self.fn = self.fns[0]
        self.rounds = timed_rounds(nbytes)
        self.order = _turn_order(len(names), self.rounds) if len(names) > 1 else []
        self.times = np.zeros((self.rounds, len(names)))
        self.left = 0 if len(names) > 1 else float("inf")
        self.turn = 0

    @property
    def measure_calls(self) -> int:
        """Calls one measurement takes (0: a single candidate, nothing to time)."""
        return (self.rounds + UNTIMED_TURNS) * len(self.names) if len(self.names) > 1 else 0

    def measure(self, flat: Flat, op: str, comm: MPI.Intracomm) -> None:
        """One call of the measurement, in the candidates' turn order."""
        n, k = len(self.fns), self.turn
        self.turn += 1
        j = self.order[k]
        if k < UNTIMED_TURNS * n:
            self.fns[j](flat, op, comm)
            return
        comm.Barrier()
        t0 = MPI.Wtime()
        self.fns[j](flat, op, comm)
        self.times[k // n - UNTIMED_TURNS, j] = MPI.Wtime() - t0
        if k == len(self.order) - 1:  # the last turn: agree on the fastest
            comm.Allreduce(MPI.IN_PLACE, self.times, op=MPI.MAX)
            # The median, not the best round: the shared-memory algorithm
            # swings between fast and 3x slower calls in a busy spell, and
            # its best call would hide that.
            self.fn = self.fns[int(np.argmin(np.median(self.times, axis=0)))]
            self.turn = 0
            self.left = max(1, REMEASURE_EVERY - self.measure_calls)


# Decisions live on the communicator (MPI attribute), so they go with it;
# the latest communicator's are also kept here, which skips MPI_Comm_get_attr
# (half a microsecond) on the usual run of calls on one communicator.
_DECISIONS_KEYVAL = MPI.Comm.Create_keyval()
_decisions_generation = 0
_last: tuple = (None, None)


def _decisions(comm: MPI.Intracomm) -> dict:
    decisions = comm.Get_attr(_DECISIONS_KEYVAL)
    if decisions is None or decisions.get("generation") != _decisions_generation:
        decisions = {"generation": _decisions_generation}
        comm.Set_attr(_DECISIONS_KEYVAL, decisions)
    return decisions


def _timing(flat: Flat, op: str, comm: MPI.Intracomm, decisions: dict) -> _Timing:
    from ..topology import detect_private

    topo = decisions.get("topology")
    if topo is None:  # the layout, read once per communicator (and set_tuning)
        topo = decisions["topology"] = detect_private(comm)
    names = candidates(flat.nbytes, comm.Get_size(), topo.num_nodes)
    # One simulated node may still span hosts: shm needs real shared memory.
    names = list(dict.fromkeys(_placed(n, is_single_node(comm)) for n in names))
    if not same_bits(flat.dtype, op, comm.Get_size()):
        names = names[:1]
    timing = decisions[(flat.nbytes, flat.dtype, op)] = _Timing(names, flat.nbytes)
    return timing


def _allreduce_auto(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    global _last
    last_comm, decisions = _last
    if last_comm is not comm:  # (set_tuning clears _last)
        decisions = _decisions(comm)
        _last = (comm, decisions)
    timing = decisions.get((flat.data.nbytes, flat.dtype, op)) or _timing(flat, op, comm, decisions)
    if timing.left:  # the usual call: the kept algorithm, no method call in between
        timing.left -= 1
        timing.fn(flat, op, comm)
    else:
        timing.measure(flat, op, comm)


def _decision(nbytes: int, dtype: str, op: str, comm: MPI.Comm | None) -> _Timing | None:
    return _decisions(private(comm)).get((nbytes, dtype, op))


def settled(buf, op: str = "sum", comm: MPI.Comm | None = None) -> bool:
    """Whether ``auto`` has done measuring for ``buf``'s size and dtype and
    ``op`` on ``comm``: its next such call runs the algorithm it kept (until
    the next measurement, :data:`REMEASURE_EVERY` calls on). False before the
    first call. The same on every rank, so ranks may loop on it, as
    ``hpcjobs bench`` does to time what ``auto`` settles on."""
    flat = as_flat(buf)
    timing = _decision(flat.data.nbytes, flat.dtype, op, comm)
    return timing is not None and timing.left > 0


def kept(nbytes: int, dtype: str, op: str = "sum", comm: MPI.Comm | None = None) -> str | None:
    """The algorithm ``auto`` runs now for ``nbytes`` of ``dtype`` (its name,
    e.g. "float32" or "bfloat16") and ``op`` on ``comm``: the table's choice
    until its contenders are timed, then the fastest. None before its first
    call there."""
    timing = _decision(nbytes, dtype, op, comm)
    return None if timing is None else timing.names[timing.fns.index(timing.fn)]


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
