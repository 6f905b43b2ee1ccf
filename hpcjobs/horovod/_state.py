"""``hvd.init()`` and what it sets up: the communicators, this rank's
place on the nodes, the controller, the reduction ops.

``init(comm, process_sets)`` takes what Horovod's takes -- nothing
(COMM_WORLD), an mpi4py communicator, or a list of COMM_WORLD ranks; and
process sets to register (:mod:`~hpcjobs.horovod._process_sets`) -- and
builds a :class:`World`:

- ``comm``: Horovod's communicator. ``DistributedOptimizer`` reduces
  gradients on the suite's private duplicate of it
  (:func:`hpcjobs.comm.private`), as :mod:`hpcjobs.training` always does
  (through the controller while a rank is in ``hvd.join()``).
- ``ops``: a duplicate on which the global process set's ``hvd.*``
  collectives run (through the collectives' own private duplicate of it).
  The optimizer's communication thread and the controller's thread may be
  inside a collective at the same time -- SyncBatchNorm's backward during
  the optimizer's bucket reductions -- and separate communicators keep
  their messages apart; the user's own traffic on COMM_WORLD never meets
  them.
- ``controller``: :mod:`~hpcjobs.horovod._controller`, on a duplicate of
  its own: the ranks agree by name on what runs, in one order.
- ``admin``: a duplicate on which the calling thread registers process sets.
- ``topology``: which ranks share a node (:func:`hpcjobs.topology.detect`),
  for ``local_rank``, ``local_size``, ``cross_rank`` and ``cross_size``.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass

from mpi4py import MPI

from ..comm import private
from ..topology import Topology, detect
from . import _process_sets
from ._controller import Controller
from ._process_sets import (ProcessSet, add_process_set, global_process_set, remove_process_set,  # noqa: F401
                            resolve)

__all__ = ["World", "world", "init", "shutdown", "is_initialized", "NOT_INITIALIZED", "OPS", "Average", "Sum",
           "Adasum", "Min", "Max", "Product", "HorovodInternalError", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set", "resolve", "reduce_op"]

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."

# Horovod's reduce-op values (horovod/common/message.h), and ours for each.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OPS = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}


class HorovodInternalError(RuntimeError):
    """A collective failed: Horovod's exception, which its users catch as
    RuntimeError. Arguments that disagree across ranks raise
    :class:`HorovodMismatchError`, which is also hpcjobs' MismatchError."""


@dataclass
class World:
    """What ``init`` set up (module docstring)."""

    comm: MPI.Intracomm
    ops: MPI.Intracomm
    admin: MPI.Intracomm
    owned: bool  # comm was built here (from a rank list) and is freed at shutdown
    spec: object  # init's argument, to tell a repeated init from a new one
    topology: Topology
    controller: Controller

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()


_world: World | None = None
_forked = False  # this process is a fork's child (a DataLoader worker, say): hvd.rank() still answers


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)
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
    in the list raises ValueError); then register ``process_sets`` (a list
    of :class:`ProcessSet`). Collective over the communicator.

    Calling it again with the same argument (and no process sets) does
    nothing, as in Horovod; otherwise it shuts down and starts over.

    Raises:
        ValueError: ``comm`` is neither a communicator nor a list of ranks.
    """
    global _atexit_registered, _world
    spec = _spec(comm)
    same = _world is not None and (_world.spec is spec or (isinstance(spec, list) and _world.spec == spec))
    if same and not process_sets:
        return
    base, owned = _communicator(spec)
    shutdown()
    private(base, free_if_refused=owned)  # collective: here, on the main thread, not first on a thread; can raise
    ops, ctrl, admin = base.Dup(), base.Dup(), base.Dup()
    private(ops)
    _process_sets.setup(ops, admin)
    controller = Controller(ctrl, _process_sets.members, _process_sets.comm_of,
                            threaded=MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    _world = World(base, ops, admin, owned, spec, detect(base), controller)
    if process_sets:
        _process_sets.register_at_init(list(process_sets))
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)  # before MPI finalizes: mpi4py registered its own earlier
        _chain_excepthook()
        _atexit_registered = True


_died: BaseException | None = None  # the exception this process is ending on, uncaught


def _chain_excepthook() -> None:
    """Note an uncaught exception before the interpreter exits on it (the
    traceback is printed as before)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        global _died
        if not sys.flags.interactive:  # (an interactive session survives it)
            _died = value
        previous(kind, value, tb)

    sys.excepthook = hook


def _shutdown_at_exit() -> None:
    """At exit: the agreed shutdown (every rank asks, as MPI_Finalize waits
    for all), unless this rank is ending on an uncaught exception. Then the
    others, waiting in a collective for it, would wait for the watchdog
    (HPCJOBS_TIMEOUT, 300 s) and this rank in the shutdown for them: the job
    ends now, as Horovod shuts every rank down when one does."""
    if (_died is not None and _world is not None and not _forked and MPI.COMM_WORLD.Get_size() > 1
            and not MPI.Is_finalized()):
        print(f"hpcjobs.horovod: rank {MPI.COMM_WORLD.Get_rank()} is ending on {type(_died).__name__}; ending the "
              "job (Horovod shuts every rank down when one does)", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
    shutdown()


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
    """Stop the controller (operations not yet run fail with
    HorovodInternalError), then free what ``init`` made. Nothing to do when
    not initialized."""
    global _world
    w, _world = _world, None
    if w is None or _forked:  # a fork's child: the controller thread and the communicators are its parent's
        return
    w.controller.stop()
    from . import _handles

    _handles.clear()
    _process_sets.clear()
    if not MPI.Is_finalized():
        for c in (w.ops, w.controller.comm, w.admin):
            c.Free()
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
