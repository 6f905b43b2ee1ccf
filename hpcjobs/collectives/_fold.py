"""The non-power-of-two fold shared by recursive doubling and Rabenseifner.

As MPICH does it (Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", 2005): with P = p2 + rem ranks, p2 the
largest power of two <= P, the first 2·rem ranks pair up; each even one sends
its whole buffer to the odd one above it and sits out. The odd ones, and every
rank from 2·rem on, form a power-of-two group of p2 "new ranks". Afterwards
each odd rank sends the finished result back to its even partner.
"""

from __future__ import annotations

from mpi4py import MPI

from ._buffers import Flat, reducer, scratch

_TAG = 11


def group(size: int) -> tuple[int, int]:
    """(p2, rem) for a group of ``size`` ranks."""
    p2 = 1 << (size.bit_length() - 1)
    return p2, size - p2


def new_rank(rank: int, rem: int) -> int:
    """This rank's index in the power-of-two group, or -1 if it sits out."""
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else -1
    return rank - rem


def real_rank(newrank: int, rem: int) -> int:
    """The communicator rank of power-of-two group member ``newrank``."""
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def fold_in(flat: Flat, op: str, comm: MPI.Intracomm, rem: int) -> int:
    """Step 1: the even ranks below 2·rem hand their data to their odd partner.
    Returns this rank's new rank (-1: it sits out until :func:`fold_out`)."""
    rank = comm.Get_rank()
    if rank < 2 * rem:
        if rank % 2 == 0:
            comm.Send(flat.wire, rank + 1, _TAG)
        else:
            tmp = scratch(flat.count, flat.data.dtype)
            comm.Recv(tmp.view(flat.wire.dtype), rank - 1, _TAG)
            reducer(op, flat.dtype)(flat.data, tmp)
    return new_rank(rank, rem)


def fold_out(flat: Flat, comm: MPI.Intracomm, rem: int) -> None:
    """Last step: each odd rank below 2·rem returns the result to its partner."""
    rank = comm.Get_rank()
    if rank < 2 * rem:
        if rank % 2 == 0:
            comm.Recv(flat.wire, rank + 1, _TAG)
        else:
            comm.Send(flat.wire, rank - 1, _TAG)
