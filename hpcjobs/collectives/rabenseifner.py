"""Rabenseifner's allreduce: recursive halving, then recursive doubling.

Bandwidth-optimal like the ring, but in log2 P rounds per phase instead of
P-1 (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005). Steps, for P
ranks and N bytes, with the buffer cut into p2 chunks:

1. Fold when P is not a power of two (see ``_fold``): p2 ranks remain.
2. Reduce-scatter by recursive halving, log2(p2) rounds. In the round with
   distance d = 1, 2, ..., p2/2, rank i pairs with i XOR d; the one with
   that bit clear keeps the lower half of its current chunk range, the other
   the upper half; each sends the half it gives up and reduces the half it
   keeps. Afterwards each rank holds one chunk reduced over all ranks (rank
   i the chunk whose index is i's bits reversed; for avg it then divides
   that chunk, once).
3. Allgather by recursive doubling, the same pairs in reverse, d = p2/2,
   ..., 2, 1: partners swap the ranges they hold, which are adjacent and of
   one size, and the range doubles each round.
4. Unfold: the odd ranks return the result to their partners.

The near distances come first, as in MPICH: the biggest halves go to the
nearest ranks, which mpirun's default placement puts on the same node, and
only the rounds at d >= L (L ranks per node) cross the network, with
N/2L, ..., N/P. Each node then sends 2(M-1)/M·N to the others, the
two-level minimum that ``hierarchical`` also sends, where halving at the
far distances first sent L times that (docs/results/multinode.md).

Cost: 2·log2(p2) rounds (+2 when folding); each rank sends
2(p2-1)/p2·N bytes and reduces (p2-1)/p2·N. Model
(``costs.COSTS["rabenseifner"]``; f = 1 when folding):
2log2(p2)·α + 2(p2-1)/p2·Nβ + (p2-1)/p2·Nγ + f·(2α + 2Nβ + Nγ).

Step: :func:`allreduce`.
"""

from __future__ import annotations

from mpi4py import MPI

from ..comm import exchange
from . import _fold
from ._buffers import Flat, chunk_bounds, finish_avg, reducer, scratch
from ._frame import run

__all__ = ["rabenseifner_allreduce", "allreduce"]

_TAG = 13


def allreduce(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    """Rabenseifner's step (module docstring)."""
    p2, rem = _fold.group(comm.Get_size())
    newrank = _fold.fold_in(flat, op, comm, rem)
    if newrank >= 0:
        data, wire = flat.data, flat.wire
        b = chunk_bounds(flat.count, p2)
        reduce = reducer(op, flat.dtype)
        tmp = scratch(b[p2 // 2] if p2 > 1 else 0, data.dtype)
        lo, hi = 0, p2  # the chunk range this rank is responsible for
        dist = 1
        while dist < p2:
            partner = _fold.real_rank(newrank ^ dist, rem)
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if newrank & dist else ((lo, mid), (mid, hi))
            (keep_lo, keep_hi), (give_lo, give_hi) = keep, give
            n = b[keep_hi] - b[keep_lo]
            exchange(comm, wire[b[give_lo]:b[give_hi]], partner, tmp[:n].view(wire.dtype), partner, _TAG)
            reduce(data[b[keep_lo]:b[keep_hi]], tmp[:n])
            lo, hi = keep_lo, keep_hi
            dist <<= 1
        if op == "avg":
            finish_avg(data[b[lo]:b[hi]], flat.dtype, comm.Get_size())
        dist = p2 >> 1
        while dist >= 1:
            partner = _fold.real_rank(newrank ^ dist, rem)
            width = hi - lo
            plo, phi = (lo - width, lo) if newrank & dist else (hi, hi + width)
            exchange(comm, wire[b[lo]:b[hi]], partner, wire[b[plo]:b[phi]], partner, _TAG)
            lo, hi = min(lo, plo), max(hi, phi)
            dist >>= 1
    _fold.fold_out(flat, comm, rem)


def rabenseifner_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place with Rabenseifner's algorithm (module
    docstring); arguments, result and errors as
    :func:`hpcjobs.collectives.recursive_doubling_allreduce`."""
    return run(buf, op, comm, "rabenseifner_allreduce", allreduce)
