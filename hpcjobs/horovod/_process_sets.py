"""Horovod's process sets: collectives on a subset of the ranks.

``hvd.add_process_set([0, 2])`` (every rank calls it, with the same ranks)
makes a communicator of those ranks and returns a :class:`ProcessSet` with
its id; ``process_set=`` on any collective, ``DistributedOptimizer``,
``broadcast_parameters``, ``broadcast_object`` or ``barrier`` then runs it
among those ranks only. Ranks are ``hvd.rank()`` numbers; a root
(``broadcast(..., root_rank)``) is too, as in Horovod, not a rank within
the set. ``hvd.init(process_sets=[...])`` registers sets at start, given
by ranks or by an mpi4py communicator; ``remove_process_set`` frees one.

Every process set's operations go through the one controller
(:mod:`~hpcjobs.horovod._controller`), whose single order over all sets is
what keeps a rank in two sets from waiting on one while the other set's
ranks wait on it.

Errors, the same on every rank: the ranks asked for different sets, a
duplicate of a registered set, ranks out of range (ValueError); a set not
registered, or used on a rank it does not include (ValueError at the call).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from ..comm import by_value, private, ranks_in

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "setup", "clear",
           "members", "comm_of", "ranks_of", "resolve", "register_at_init"]


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's class). Give
    it the ranks, or an mpi4py communicator (at ``hvd.init`` only), then
    register it with ``hvd.add_process_set`` or ``hvd.init(process_sets=)``."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py "
                             "Comm object") from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py "
                             "Comm object")
        self.ranks = ranks

    def size(self) -> int | None:
        """The number of ranks in the set; None if not registered."""
        entry = _sets.get(self.process_set_id)
        return None if entry is None else len(entry.ranks)

    def rank(self) -> int | None:
        """This rank's place in the set; None if not registered or not included."""
        entry = _sets.get(self.process_set_id)
        if entry is None or _me() not in entry.ranks:
            return None
        return entry.ranks.index(_me())

    def included(self) -> bool | None:
        """Whether this rank is in the set; None before the ranks are known."""
        return None if self.ranks is None else _me() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class _Entry:
    ranks: tuple
    comm: MPI.Intracomm | None  # the set's communicator for the controller's collectives (None off the set)
    owned: bool
    # the DistributedOptimizer's, apart: its overlap thread reduces while the controller's thread runs the
    # set's collectives, and two threads' collectives on one communicator could match across ranks crossed
    engine: MPI.Intracomm | None = None


_sets: dict[int, _Entry] = {}
_next_id = 1
_admin: MPI.Intracomm | None = None  # the world's duplicate for registration, on the calling thread


def _me() -> int:
    from ._state import world

    return world().rank


def setup(ops: MPI.Intracomm, admin: MPI.Intracomm) -> None:
    """At ``init``: the global set (id 0) on ``ops``; ``admin`` registers the others."""
    global _admin, _next_id
    _admin, _next_id = admin, 1
    _sets.clear()
    _sets[0] = _Entry(tuple(range(ops.Get_size())), ops, False)
    global_process_set.ranks = list(range(ops.Get_size()))


def clear() -> None:
    """At ``shutdown``: free the sets' communicators and forget the sets."""
    global _admin
    for entry in _sets.values():
        if entry.owned and entry.comm is not None and not MPI.Is_finalized():
            _free(entry)
    _sets.clear()
    _admin = None


def members(set_id: int):
    """The set's ranks, or None for an id not registered here (yet)."""
    entry = _sets.get(set_id)
    return None if entry is None else entry.ranks


def comm_of(set_id: int) -> MPI.Intracomm:
    return _sets[set_id].comm


def engine_of(set_id: int) -> MPI.Intracomm | None:
    """The DistributedOptimizer's communicator for set ``set_id`` (not the
    global set's: the optimizer reduces on the world's base there)."""
    return _sets[set_id].engine


def watched_comm(set_id: int) -> MPI.Intracomm | None:
    """The communicator a stall on set ``set_id`` is reported on: its own,
    or None (COMM_WORLD) where the set is gone or this rank is not in it."""
    entry = _sets.get(set_id)
    return None if entry is None else entry.comm


def ranks_of(process_set) -> tuple:
    """The ranks of a registered ``process_set`` (this rank in it or not).

    Raises:
        ValueError: not initialized, or not a registered process set.
    """
    set_id = 0 if process_set is None else getattr(process_set, "process_set_id", None)
    entry = _sets.get(set_id)
    if entry is None:
        if not _sets:
            from ._state import NOT_INITIALIZED

            raise ValueError(NOT_INITIALIZED)
        raise ValueError(f"{process_set} is not a registered process set: pass it to hvd.add_process_set() "
                         "or hvd.init(process_sets=...) first")
    return entry.ranks


def resolve(process_set) -> tuple[int, MPI.Intracomm, tuple]:
    """``(id, communicator, ranks)`` of ``process_set`` for a call on this rank.

    Raises:
        ValueError: not a registered process set, or this rank is not in it.
    """
    ranks = ranks_of(process_set)
    set_id = 0 if process_set is None else process_set.process_set_id
    entry = _sets[set_id]
    if entry.comm is None:
        raise ValueError(f"rank {_me()} is not in {process_set}: only its ranks may call collectives on it")
    return set_id, entry.comm, ranks


def _register(ranks: tuple) -> int:
    """Make the communicator of ``ranks`` (collective over every rank) and
    give it the next id."""
    global _next_id
    me = _admin.Get_rank()
    sub = _admin.Split(0 if me in ranks else MPI.UNDEFINED, me)
    entry, error = _Entry(ranks, None, True), None
    if sub != MPI.COMM_NULL:
        entry = _Entry(ranks, sub, True, sub.Dup())
        try:  # their duplicates made here, on the calling thread, rather than first on the two threads
            private(entry.comm), private(entry.engine)
        except Exception as e:  # noqa: BLE001 -- raised below on every rank, not on the set's alone
            _free(entry)
            error = e
    if _admin.allreduce(error is not None, op=MPI.LOR):  # else the other ranks went on to number the next set
        said = next((m for m in _admin.allgather(None if error is None else str(error)) if m), "(no message)")
        raise error if error is not None else ValueError(f"process set {list(ranks)}: refused on its ranks: {said}")
    set_id, _next_id = _next_id, _next_id + 1
    _sets[set_id] = entry
    return set_id


def _free(entry: _Entry) -> None:
    for c in (entry.comm, entry.engine):
        if c is not None:
            c.Free()


def _agreed(what: str, mine) -> list:
    """Every rank's ``mine``; ValueError on every rank if not all the same."""
    everyone = _admin.allgather(mine)
    if any(x != everyone[0] for x in everyone):
        raise ValueError(f"{what}: every rank must pass the same process set; "
                         + by_value([repr(x) for x in everyone]))
    return everyone


def add_process_set(process_set) -> ProcessSet:
    """Register ``process_set`` (a ProcessSet or a list of ranks) and return
    it with its id. Collective: every rank calls it with the same ranks.

    Raises:
        ValueError: the ranks differ across ranks, are out of range, or
            the set is registered already (Horovod's message).
        NotImplementedError: a set given by a communicator (as in Horovod).
    """
    if _admin is None:
        from ._state import NOT_INITIALIZED

        raise ValueError(NOT_INITIALIZED)
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator is not "
                                  "implemented. Please build the process set via a list of ranks.")
    ranks = tuple(process_set.ranks)
    _agreed("hvd.add_process_set", ranks)
    size = _admin.Get_size()
    if not ranks or ranks[0] < 0 or ranks[-1] >= size or len(set(ranks)) != len(ranks):
        raise ValueError(f"hvd.add_process_set: {process_set} must list distinct ranks in 0..{size - 1}")
    if any(e.ranks == ranks for e in _sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    process_set.process_set_id = _register(ranks)
    return process_set


def remove_process_set(process_set) -> bool:
    """Unregister ``process_set`` (collective); False for the global set or
    one not registered, as in Horovod."""
    set_id = getattr(process_set, "process_set_id", None)
    if set_id is None or set_id == 0 or _admin is None:
        return False
    _agreed("hvd.remove_process_set", set_id)
    entry = _sets.pop(set_id, None)
    process_set._invalidate()
    if entry is None:
        return False
    _free(entry)
    return True


def register_at_init(process_sets: list) -> None:
    """``hvd.init(process_sets=...)``: every rank's sets, by ranks or by a
    communicator of its own (each rank's communicator may differ, as after a
    Split), registered in the order of the first rank that names each; a
    set listed twice keeps its first object (the others are invalidated)."""
    mine = []
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"hvd.init(process_sets=...) takes ProcessSet objects, got {ps!r}")
        if ps.ranks is None:
            ps.ranks = sorted(ranks_in(ps.mpi_comm, _admin))
        mine.append(tuple(ps.ranks))
    order = list(dict.fromkeys(t for theirs in _admin.allgather(mine) for t in theirs))
    ids = {}
    for ranks in order:
        if not ranks or ranks == _sets[0].ranks:
            ids[ranks] = 0
        else:
            ids[ranks] = _register(ranks)
    seen = {0}
    for ps in process_sets:
        ps.process_set_id = ids[tuple(ps.ranks)]
        if ps.process_set_id in seen:
            ps._invalidate()
        seen.add(ps.process_set_id)
