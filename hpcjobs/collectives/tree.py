"""Binomial-tree allreduce: reduce to rank 0 along a binomial tree, then
broadcast back along the same tree.

Steps, for P ranks and N bytes:

1. Reduce, ⌈log2 P⌉ rounds. In round k (mask = 2^k), a rank whose bit k is
   set sends its partial result to rank - 2^k and is done; a rank with bit k
   clear receives from rank + 2^k (if it exists) and reduces. Rank 0 ends
   with the full reduction (and divides it, for avg).
2. Broadcast, ⌈log2 P⌉ rounds: each rank receives the result from the parent
   it sent to, then forwards it to its own children, largest subtree first.

Cost: 2⌈log2 P⌉ rounds; every rank but 0 sends N bytes in the reduce, and a
rank with c children sends c·N in the broadcast (rank 0: ⌈log2 P⌉·N). Its
latency term equals recursive doubling's twice over, and rank 0's link
carries log2 P full buffers, so it suits small messages and is here as the
classic reference. Model (``costs.COSTS["tree"]``; every hop one way):
2⌈log2(P)⌉·(α + Nβ) + ⌈log2(P)⌉·Nγ.

Steps: :func:`reduce`, :func:`bcast` (``hierarchical`` composes them) and
:func:`allreduce`.
"""

from __future__ import annotations

from mpi4py import MPI

from ._buffers import Flat, finish_avg, reducer, scratch
from ._frame import run

__all__ = ["tree_allreduce", "reduce", "bcast", "allreduce"]

_TAG = 14


def reduce(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    """Step 1: binomial reduce; rank 0 ends with the reduction (not divided)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    reduce_into = reducer(op, flat.dtype)
    tmp = scratch(flat.count, flat.data.dtype)
    mask = 1
    while mask < size:
        if rank & mask:
            comm.Send(flat.wire, rank - mask, _TAG)
            return
        if rank + mask < size:
            comm.Recv(tmp.view(flat.wire.dtype), rank + mask, _TAG)
            reduce_into(flat.data, tmp)
        mask <<= 1


def bcast(flat: Flat, comm: MPI.Intracomm) -> None:
    """Step 2: binomial broadcast of rank 0's buffer."""
    size, rank = comm.Get_size(), comm.Get_rank()
    mask = 1
    while mask < size and not rank & mask:
        mask <<= 1
    if rank != 0:
        comm.Recv(flat.wire, rank - mask, _TAG)  # mask is this rank's lowest set bit
    mask >>= 1
    while mask >= 1:
        if rank + mask < size:
            comm.Send(flat.wire, rank + mask, _TAG)
        mask >>= 1


def allreduce(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    """The tree's step: :func:`reduce`, divide on rank 0 for avg, :func:`bcast`."""
    reduce(flat, op, comm)
    if op == "avg" and comm.Get_rank() == 0:
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    bcast(flat, comm)


def tree_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place: binomial-tree reduce to rank 0, then
    binomial broadcast (module docstring); arguments, result and errors as
    :func:`hpcjobs.collectives.recursive_doubling_allreduce`."""
    return run(buf, op, comm, "tree_allreduce", allreduce)
