"""MPI-3 shared memory: the one allocator of shared windows (shm's stages,
symmetric buffers, oneshot's segments), and whether a communicator's ranks
can share memory.

Every window made here and still live at exit is freed then, in one order
that every rank agrees on. MPI_Finalize would free them itself, but in the
order of its own table, which fills freed slots first: ranks whose histories
of windows differ (one made on ranks 0 and 1 and freed, then one on all
three, then one on ranks 1 and 2) hold the same windows in different slots,
each waits in another window's barrier, and the job hangs at exit (a 3-rank
run of the test suite did). The order is by a key that the communicator's
rank 0 gives each window as it is made (its process's random tag and its
count), not by when this rank made it: two threads making windows at once
on two communicators may make them in one order here and the other there,
but every rank frees what it holds in the one global order, and the window
first in it always has all its ranks there.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading

import numpy as np
from mpi4py import MPI

__all__ = ["shared_window", "allocate_shared", "free_window", "is_single_node"]

_NODE_KEYVAL = MPI.Comm.Create_keyval()


def is_single_node(comm: MPI.Intracomm) -> bool:
    """Whether every rank of ``comm`` can share memory with every other
    (collective on first call per communicator; cached)."""
    cached = comm.Get_attr(_NODE_KEYVAL)
    if cached is None:
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
        cached = shared.Get_size() == comm.Get_size()
        shared.Free()
        comm.Set_attr(_NODE_KEYVAL, cached)
    return cached


def shared_window(nbytes: int, comm: MPI.Intracomm) -> tuple[MPI.Win, list[np.ndarray]]:
    """Allocate ``nbytes`` of shared memory on every rank of ``comm``
    (collective; the ranks must share one node).

    Each rank's segment is page-aligned on its own (``alloc_shared_noncontig``)
    rather than packed after its neighbour's, and the window is locked for
    passive access at once, as the load/store idiom needs (``Win.Sync`` and a
    barrier order the stores).

    Returns:
        ``(win, segments)``: ``segments[p]`` is rank p's segment as ``nbytes``
        uint8s, this rank's own and its peers' alike. Free with
        :func:`free_window`.
    """
    win = allocate_shared(max(nbytes, 1), comm, noncontig=True)
    segments = []
    for p in range(comm.Get_size()):
        mem, _ = win.Shared_query(p)
        segments.append(np.frombuffer(mem, dtype=np.uint8, count=nbytes))
    return win, segments


def allocate_shared(nbytes: int, comm: MPI.Intracomm, noncontig: bool = False) -> MPI.Win:
    """``MPI.Win.Allocate_shared`` of ``nbytes`` bytes on this rank, locked
    for passive access, and kept to be freed at exit if it is not before
    (collective). Free with :func:`free_window`."""
    info = MPI.Info.Create()
    if noncontig:
        info.Set("alloc_shared_noncontig", "true")
    try:
        win = MPI.Win.Allocate_shared(nbytes, 1, info, comm=comm)
    finally:
        info.Free()
    win.Lock_all(MPI.MODE_NOCHECK)
    key = np.zeros(2, dtype=np.int64)
    if comm.Get_rank() == 0:
        with _lock:
            key[:] = _TAG, next(_made)
    comm.Bcast(key, root=0)  # the window's key, the same on every rank of it
    with _lock:
        _live[(int(key[0]), int(key[1]))] = win
    return win


def free_window(win: MPI.Win) -> None:
    """Unlock and free a window from :func:`allocate_shared` or
    :func:`shared_window` (collective). A rank whose unlock fails (its
    window already unlocked) still frees, then raises: its peers wait for
    it in the free."""
    if win != MPI.WIN_NULL:
        with _lock:
            for key, live in list(_live.items()):
                if live is win:
                    del _live[key]
        try:
            win.Unlock_all()
        finally:
            win.Free()


_lock = threading.Lock()
_TAG = int.from_bytes(os.urandom(8), "little") >> 1  # this process's, for the windows it is rank 0 of
_made = itertools.count()  # windows this process was rank 0 of
_live: dict = {}  # key (module docstring) -> window not yet freed


@atexit.register
def _free_left() -> None:
    # atexit runs before mpi4py's MPI_Finalize (a C-level exit function, after every atexit hook). A window that
    # will not free is said and passed: left behind, the rest would go back to MPI_Finalize's order.
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    with _lock:
        left = sorted(_live.items())
    for _, win in left:
        try:
            free_window(win)
        except Exception as e:  # noqa: BLE001
            print(f"hpcjobs: could not free a shared window at exit: {e}", file=sys.stderr, flush=True)


def _forget_after_fork() -> None:  # a forked child holds no window of its own to free
    global _lock
    _lock = threading.Lock()  # held by another thread at the fork, it would be held for good here
    _live.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
