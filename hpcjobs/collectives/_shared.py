"""MPI-3 shared memory: the one allocator of shared windows (shm's stages and
symmetric buffers), and whether a communicator's ranks can share memory."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

__all__ = ["shared_window", "free_window", "is_single_node"]

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
    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")
    win = MPI.Win.Allocate_shared(max(nbytes, 1), 1, info, comm=comm)
    info.Free()
    win.Lock_all(MPI.MODE_NOCHECK)
    segments = []
    for p in range(comm.Get_size()):
        mem, _ = win.Shared_query(p)
        segments.append(np.frombuffer(mem, dtype=np.uint8, count=nbytes))
    return win, segments


def free_window(win: MPI.Win) -> None:
    """Unlock and free a window from :func:`shared_window` (collective)."""
    if win != MPI.WIN_NULL:
        win.Unlock_all()
        win.Free()
