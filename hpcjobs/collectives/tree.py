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
classic reference. Model: 2⌈log2 P⌉(α + Nβ) + ⌈log2 P⌉·Nγ.
"""

from __future__ import annotations

from mpi4py import MPI

from ._buffers import Flat, finish_avg, reducer, run, scratch

__all__ = ["tree_allreduce"]

_TAG = 14


def _tree_reduce(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    """Step 1: binomial reduce; rank 0 ends with the reduction (not divided)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    reduce = reducer(op, flat.dtype)
    tmp = scratch(flat.count, flat.data.dtype)
    mask = 1
    while mask < size:
        if rank & mask:
            comm.Send(flat.wire, rank - mask, _TAG)
            return
        if rank + mask < size:
            comm.Recv(tmp.view(flat.wire.dtype), rank + mask, _TAG)
            reduce(flat.data, tmp)
        mask <<= 1


def _tree_bcast(flat: Flat, comm: MPI.Intracomm) -> None:
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


def _tree(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    _tree_reduce(flat, op, comm)
    if op == "avg" and comm.Get_rank() == 0:
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    _tree_bcast(flat, comm)


def tree_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place: binomial-tree reduce to rank 0, then
    binomial broadcast (module docstring).

    Args:
        buf: numpy array or torch CPU tensor, contiguous and writable; same
            count and dtype on every rank.
        op: "sum", "avg", "min", "max" or "prod".
        comm: intracommunicator; None for COMM_WORLD (a private Dup is used).

    Returns:
        ``buf``, reduced in place, bitwise identical on every rank.
    """
    return run(buf, op, comm, _tree)
