"""``hvd.init()`` and what it sets up: the communicator, this rank's place
on the nodes, the reduction ops and the (global) process set.

``init(comm)`` takes what Horovod's takes -- nothing (COMM_WORLD), an
mpi4py communicator, or a list of COMM_WORLD ranks -- and builds a
:class:`World`:

- ``comm``: Horovod's communicator. ``DistributedOptimizer`` reduces
  gradients on the suite's private duplicate of it
  (:func:`hpcjobs.comm.private`), as :mod:`hpcjobs.training` always does.
- ``ops``: a second duplicate, on which every ``hvd.*`` collective runs
  (through the collectives' own private duplicate of it). The optimizer's
  communication thread and the ``hvd`` worker thread
  (:mod:`~hpcjobs.horovod._handles`) may be inside a collective at the same
  time -- SyncBatchNorm's backward during the optimizer's bucket reductions
  -- and two communicators keep their messages apart; the user's own
  traffic on COMM_WORLD never meets either.
- ``topology``: which ranks share a node (:func:`hpcjobs.topology.detect`),
  for ``local_rank``, ``local_size``, ``cross_rank`` and ``cross_size``.
- ``executor``: the one worker thread the collectives run on, in the order
  they were called; None where MPI gives less than ``MPI_THREAD_MULTIPLE``
  (two threads may then not call MPI at once), and the collectives run at
  once on the calling thread.

Only the global process set exists: ``ProcessSet`` objects may be built,
but passing one to a collective, or to ``init``, raises NotImplementedError.
"""

from __future__ import annotations

import atexit
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mpi4py import MPI

from ..comm import private
from ..topology import Topology, detect

__all__ = ["World", "world", "init", "shutdown", "is_initialized", "NOT_INITIALIZED", "OPS", "Average", "Sum",
           "Adasum", "Min", "Max", "Product", "HorovodInternalError", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set", "check_process_set", "reduce_op"]

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."

# Horovod's reduce-op values (horovod/common/message.h), and ours for each.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OPS = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}


class HorovodInternalError(RuntimeError):
    """A collective failed for a reason other than its arguments (an MPI
    error, say); arguments that disagree across ranks raise
    :class:`~hpcjobs.collectives.agreement.MismatchError` instead."""


@dataclass
class World:
    """What ``init`` set up (module docstring)."""

    comm: MPI.Intracomm
    ops: MPI.Intracomm
    owned: bool  # comm was built here (from a rank list) and is freed at shutdown
    spec: object  # init's argument, to tell a repeated init from a new one
    topology: Topology
    executor: ThreadPoolExecutor | None

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()


_world: World | None = None
_atexit_registered = False


def world() -> World:
    """The initialized world.

    Raises:
        ValueError: before ``init()`` (Horovod's message).
    """
    if _world is None:
        raise ValueError(NOT_INITIALIZED)
    return _world


def is_initialized() -> bool:
    return _world is not None


def init(comm=None, process_sets=None) -> None:
    """Initialize on ``comm``: None for COMM_WORLD, an mpi4py intracommunicator,
    or a list of COMM_WORLD ranks (collective over those ranks; a rank not
    in the list raises ValueError). Collective over the communicator.

    Calling it again with the same argument does nothing, as in Horovod;
    with another, it shuts down and starts over on the new communicator.

    Raises:
        NotImplementedError: ``process_sets`` other than None or empty.
        ValueError: ``comm`` is neither a communicator nor a list of ranks.
    """
    global _atexit_registered, _world
    if process_sets:
        raise NotImplementedError("hpcjobs.horovod supports only the global process set; "
                                  f"init(process_sets={process_sets!r}) is not implemented")
    spec = _spec(comm)
    if _world is not None and (_world.spec is spec or (isinstance(spec, list) and _world.spec == spec)):
        return
    base, owned = _communicator(spec)
    shutdown()
    ops = base.Dup()
    private(base)  # collective: made here, on the main thread, not first on a thread
    private(ops)
    executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcjobs-hvd")
                if MPI.Query_thread() == MPI.THREAD_MULTIPLE else None)
    _world = World(base, ops, owned, spec, detect(base), executor)
    global_process_set.ranks = list(range(base.Get_size()))
    if not _atexit_registered:
        atexit.register(shutdown)  # before MPI finalizes: mpi4py registered its own earlier
        _atexit_registered = True


_BAD_COMM = "Invalid type of argument comm. Expected list of rank integers or mpi4py.MPI.Comm object."


def _spec(comm):
    """``init``'s argument: None, a communicator, or a list of ranks."""
    if comm is None or isinstance(comm, MPI.Comm):
        return comm
    try:
        ranks = list(comm)
    except TypeError:
        raise ValueError(_BAD_COMM) from None
    if not all(isinstance(r, int) for r in ranks):
        raise ValueError(_BAD_COMM)
    return ranks


def _communicator(spec) -> tuple[MPI.Intracomm, bool]:
    """The communicator ``spec`` names, and whether it was built here."""
    if isinstance(spec, MPI.Comm):
        if not isinstance(spec, MPI.Intracomm) or spec == MPI.COMM_NULL:
            raise ValueError("hvd.init(comm): comm must be an mpi4py intracommunicator")
        return spec, False
    if not spec:  # None or []: Horovod's default
        return MPI.COMM_WORLD, False
    me = MPI.COMM_WORLD.Get_rank()
    if me not in spec:
        raise ValueError(f"hvd.init(comm={spec}): COMM_WORLD rank {me} is not in the list; "
                         "only the listed ranks may call init")
    everyone = MPI.COMM_WORLD.Get_group()
    group = everyone.Incl(spec)
    comm = MPI.COMM_WORLD.Create_group(group)  # collective over the listed ranks only
    group.Free()
    everyone.Free()
    return comm, True


def shutdown() -> None:
    """Finish the collectives in flight, then free what ``init`` made.
    Nothing to do when not initialized."""
    global _world
    w, _world = _world, None
    if w is None:
        return
    if w.executor is not None:
        w.executor.shutdown(wait=True)
    from . import _handles

    _handles.clear()
    if not MPI.Is_finalized():
        w.ops.Free()
        if w.owned:
            w.comm.Free()


def reduce_op(op, average) -> int:
    """Horovod's op from ``op`` and the deprecated ``average`` (Average when
    both are None).

    Raises:
        ValueError: both given, Adasum (not implemented here), or an
            unknown op.
    """
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None and average is None:
        op = Average
    elif op is None:
        import warnings

        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        op = Average if average else Sum
    if op == Adasum:
        raise ValueError("op=Adasum is not implemented in hpcjobs (hpcjobs.horovod reduces with "
                         "Average, Sum, Min, Max or Product)")
    if op not in OPS:
        raise ValueError(f"unknown reduce op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


class ProcessSet:
    """Horovod's process set, as an object scripts can build and inspect.
    Only :data:`global_process_set` can be used."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
        else:
            self.ranks = sorted(ranks_or_comm)

    def size(self) -> int | None:
        return world().size if self is global_process_set else None

    def rank(self) -> int | None:
        return world().rank if self is global_process_set else None

    def included(self) -> bool | None:
        return None if self.ranks is None else world().rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_NO_SETS = ("hpcjobs.horovod runs every collective on the global process set; "
            "other process sets are not implemented")


def check_process_set(process_set) -> None:
    """Raises NotImplementedError for any process set but the global one."""
    if process_set is not global_process_set:
        raise NotImplementedError(f"{_NO_SETS} (got {process_set})")


def add_process_set(process_set):
    raise NotImplementedError(_NO_SETS)


def remove_process_set(process_set):
    raise NotImplementedError(_NO_SETS)
