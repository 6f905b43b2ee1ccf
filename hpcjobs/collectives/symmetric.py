"""Symmetric buffers: arrays in MPI-3 shared memory that every rank of a node
can read where they lie, so the shared-memory allreduce needs no staging.

An ordinary array is private to its process: the ``shm`` algorithm must first
copy the pieces its peers will reduce into a shared window, and copy the
reduced pieces back out. :func:`symmetric_empty` puts the array itself in a
shared window (``MPI.Win.Allocate_shared``), one segment per rank, the same
size on every rank. When every rank passes ``shm_allreduce`` (or
``allreduce(algorithm="shm")``, or ``auto`` where it picks shm) a buffer at
the same offset of the same symmetric allocation, each rank reduces its shard
straight out of its peers' buffers and then copies the other shards straight
from their owners' buffers: a "two-shot" allreduce with no stage and no
message, half the stores of the staged path (``hpcjobs.collectives.shm``).
PyTorch's SymmetricMemory (``torch.distributed._symmetric_memory``,
``two_shot_all_reduce_``) and NCCL's registered buffers (``ncclMemAlloc``,
``ncclCommRegister``) do the same on GPUs.

    buf = symmetric_empty(1 << 20, np.float32)   # collective over COMM_WORLD's private dup
    buf[...] = gradients
    shm_allreduce(buf)                           # zero-copy on a node
    symmetric_free(buf)                          # collective; buf must not be used after

``symmetric_empty(n, torch.bfloat16)`` gives a torch tensor instead. Slices
and views of a symmetric array are symmetric too, at their offset.

Any buffer works with every algorithm: the zero-copy path is an optimisation
that every rank takes or none does. ``shm`` opens each call with a small
``MPI_Allreduce`` that asks every rank which allocation and offset it holds
(:func:`locate`); anything but the same answer everywhere, such as one
rank passing a private array or another offset, runs the staged path on
every rank, which is correct for any buffers.

Allocations are freed by :func:`symmetric_free`, or when the communicator they
were made on is freed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..comm import extremes, private, ranks_in, signature
from ._buffers import DTYPES, as_flat, numpy_dtype
from ._shared import free_window, is_single_node, shared_window
from .watchdog import guard

__all__ = ["symmetric_empty", "symmetric_free", "is_symmetric", "spans", "locate", "peer_segments"]


@dataclass
class _Allocation:
    """One symmetric allocation: a shared window and every rank's segment."""

    id: int  # the same on every rank of comm, and never reused by a rank (see _last_id)
    win: MPI.Win
    comm: MPI.Intracomm  # the private communicator it was made on
    base: int  # address of this rank's segment
    nbytes: int
    segments: list  # segments[p]: rank p's segment (uint8 view), rank p of comm
    # call communicator -> its ranks' segments in its rank order, or None where
    # a rank of it is not in comm; looked up on every zero-copy call
    peers: list = field(default_factory=list)
    # the array or tensor symmetric_empty returned: an empty torch tensor has
    # no address to find it by, so symmetric_free also looks for it by identity
    handed_out: weakref.ref | None = None

    def free(self) -> None:
        if self in _ALLOCATIONS:
            _ALLOCATIONS.remove(self)
        self.segments, self.peers = [], []
        free_window(self.win)


# Every live allocation of this process, searched by address. Usually one or two.
_ALLOCATIONS: list[_Allocation] = []
_last_id = 0


def _free_all(comm, keyval, allocations):
    if not MPI.Is_finalized():
        for a in list(allocations):
            a.free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_all)


def _dtype(dtype):
    """(numpy dtype of the segment's elements, torch dtype or None)."""
    if type(dtype).__module__ == "torch":
        import torch

        if dtype == torch.bfloat16:
            return np.dtype(np.uint16), dtype
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise TypeError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
        return np.dtype(name), dtype
    np_dtype = numpy_dtype(dtype)
    if np_dtype is None:
        try:
            shown = np.dtype(dtype)
        except TypeError:
            shown = repr(dtype)
        raise TypeError(f"unsupported dtype {shown}; supported: {', '.join(DTYPES)} (bfloat16 as torch.bfloat16)")
    return np_dtype, None


def symmetric_empty(shape, dtype=np.float32, comm: MPI.Comm | None = None):
    """Allocate an uninitialised array in shared memory, symmetric over the
    ranks of ``comm`` (collective: every rank of ``comm`` calls it, with the
    same shape and dtype).

    Args:
        shape: int or tuple of ints, the same on every rank.
        dtype: a numpy dtype (a numpy array is returned) or a torch dtype
            (a CPU torch tensor over the same memory); bfloat16 as
            ``torch.bfloat16``.
        comm: intracommunicator whose ranks all share one node; None for
            COMM_WORLD. Collectives on it, or on a communicator made of some
            of its ranks, take the zero-copy path.

    Returns:
        A C-contiguous numpy array or torch tensor of ``shape``, valid until
        :func:`symmetric_free` or until ``comm`` is freed.

    Raises:
        ValueError: the ranks of ``comm`` are not all on one node, a negative
            shape, or the ranks asked for different shapes or dtypes (on
            every rank).
        TypeError: an unsupported dtype.
    """
    global _last_id
    comm = private(comm)
    error = None
    try:  # a refusal on one rank is told to all below: alone, it left the others waiting
        np_dtype, torch_dtype = _dtype(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape {shape} has a negative dimension")
    except (TypeError, ValueError) as e:
        error, np_dtype, torch_dtype, shape = e, np.dtype(np.uint8), None, (0,)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    if not is_single_node(comm):
        raise ValueError("symmetric buffers live in shared memory: every rank of the communicator must be on one "
                         "node (allocate on the node's communicator, hpcjobs.topology.detect().node_comm)")
    lo, hi = extremes(signature([error is not None, nbytes, f"{shape} {np_dtype} {torch_dtype}", _last_id + 1]),
                      comm)
    if error is not None:
        raise error
    if hi[0]:
        raise ValueError("symmetric_empty: another rank's shape or dtype was refused (its error says which)")
    if lo[1] != hi[1] or lo[2] != hi[2]:
        raise ValueError(f"symmetric_empty: the ranks asked for different shapes or dtypes (this rank: shape "
                         f"{shape}, {torch_dtype or np_dtype}; bytes range {lo[1]}-{hi[1]} over the ranks)")
    # The largest next id of any rank: a rank in two allocations sees two ids,
    # so ranks of one communicator that report the same id hold the same
    # allocation (shm's placement exchange relies on it).
    _last_id = int(hi[3])
    win, segments = shared_window(nbytes, comm)
    own = segments[comm.Get_rank()]
    alloc = _Allocation(_last_id, win, comm, own.__array_interface__["data"][0], nbytes, segments)
    _ALLOCATIONS.append(alloc)
    on_comm = comm.Get_attr(_KEYVAL)
    if on_comm is None:
        on_comm = []
        comm.Set_attr(_KEYVAL, on_comm)
    on_comm.append(alloc)
    out = own.view(np_dtype).reshape(shape)
    if torch_dtype is not None:
        import torch

        out = torch.from_numpy(out)
        out = out.view(torch_dtype) if torch_dtype == torch.bfloat16 else out
    alloc.handed_out = weakref.ref(out)
    return out


def _find(data: np.ndarray) -> tuple[_Allocation, int] | None:
    """The allocation holding all of ``data`` and its byte offset, or None."""
    if not _ALLOCATIONS:
        return None
    addr = data.__array_interface__["data"][0]
    for a in _ALLOCATIONS:
        if a.base <= addr and addr + data.nbytes <= a.base + a.nbytes:
            return a, addr - a.base
    return None


def is_symmetric(buf) -> bool:
    """Whether ``buf`` (numpy array or torch tensor) lies in a live
    symmetric allocation of this rank (local; no communication)."""
    return _find(as_flat(buf).data) is not None


def spans(comm: MPI.Intracomm) -> bool:
    """Whether a live symmetric allocation of this rank spans every rank of
    ``comm``. The same on every rank of ``comm`` (allocation and free are
    collective), so ranks may skip the placement exchange on False."""
    return any(peer_segments(a, comm) is not None for a in _ALLOCATIONS)


def locate(data: np.ndarray, comm: MPI.Intracomm) -> tuple[_Allocation, int] | None:
    """The symmetric allocation holding ``data`` and its byte offset there,
    if that allocation spans every rank of ``comm``; else None (local: the
    caller agrees across ranks, as ``shm`` does)."""
    found = _find(data)
    if found is None or peer_segments(found[0], comm) is None:
        return None
    return found


def peer_segments(alloc: _Allocation, comm: MPI.Intracomm) -> list | None:
    """``alloc``'s segments in the rank order of ``comm``, or None if some
    rank of ``comm`` is not in the allocation's communicator (cached)."""
    for c, segs in alloc.peers:
        if c is comm:
            return segs
    if comm is alloc.comm:
        segs = alloc.segments
    else:
        ranks = ranks_in(comm, alloc.comm)
        segs = None if MPI.UNDEFINED in ranks else [alloc.segments[r] for r in ranks]
    alloc.peers.append((comm, segs))
    return segs


def symmetric_free(buf) -> None:
    """Free the symmetric allocation that holds ``buf`` (collective over the
    communicator it was allocated on). ``buf`` and every view of that
    allocation must not be used afterwards: their memory is gone.

    Raises:
        ValueError: ``buf`` is not in a live symmetric allocation.
    """
    found = next(((a, 0) for a in _ALLOCATIONS if a.handed_out is not None and a.handed_out() is buf), None)
    found = found or _find(as_flat(buf).data)
    if found is None:
        raise ValueError("symmetric_free: this buffer is not in a live symmetric allocation "
                         "(already freed, or not from symmetric_empty)")
    alloc = found[0]
    on_comm = alloc.comm.Get_attr(_KEYVAL)
    if on_comm is not None and alloc in on_comm:
        on_comm.remove(alloc)
    with guard("symmetric_free", alloc.comm):  # a rank that never frees it (its buffer refused above): a timeout
        alloc.free()
