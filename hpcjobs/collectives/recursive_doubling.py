"""Recursive-doubling allreduce: the latency-optimal algorithm.

Steps, for P ranks and a buffer of N bytes (Thakur, Rabenseifner & Gropp 2005):

1. Fold (only when P is not a power of two): with P = p2 + rem, the even
   ranks below 2·rem send their whole buffer to the odd rank above and sit
   out; p2 ranks remain (see ``_fold``).
2. log2(p2) rounds. In round k, rank i exchanges its *whole* current buffer
   with rank i XOR 2^k and reduces the two. After round k each rank holds the
   reduction over a group of 2^(k+1) ranks; after the last, over all.
   Both partners compute lower ⊕ upper, in that order: min and max of +0
   and -0, and a sum of two NaNs, keep the first operand's bits, and with
   a⊕b on one and b⊕a on the other the ranks ended with different bits.
3. Unfold: the odd ranks return the result to their partners.

Cost: log2(p2) rounds (+2 when folding); each rank sends N·log2(p2) bytes
and reduces as many. Best for small messages, where the α·rounds term
dominates; the ring sends only 2(P-1)/P·N but takes 2(P-1) rounds. Model
(``costs.COSTS["recursive_doubling"]``; f = 1 when folding):
log2(p2)·(α + Nβ + Nγ) + f·(2α + 2Nβ + Nγ).

Step: :func:`allreduce`.
"""

from __future__ import annotations

from mpi4py import MPI

from ..comm import exchange
from . import _fold
from ._buffers import Flat, finish_avg, reducer, scratch
from ._frame import run

__all__ = ["recursive_doubling_allreduce", "allreduce"]

_TAG = 12


def allreduce(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    """The recursive-doubling step (module docstring)."""
    p2, rem = _fold.group(comm.Get_size())
    newrank = _fold.fold_in(flat, op, comm, rem)
    if newrank >= 0:
        reduce = reducer(op, flat.dtype)
        tmp = scratch(flat.count, flat.data.dtype)
        tmp_wire = tmp.view(flat.wire.dtype)
        mask = 1
        while mask < p2:
            partner = _fold.real_rank(newrank ^ mask, rem)
            exchange(comm, flat.wire, partner, tmp_wire, partner, _TAG)
            if newrank & mask:  # the upper partner: lower ⊕ upper, as the lower one computes it
                reduce(tmp, flat.data)
                flat.data[...] = tmp
            else:
                reduce(flat.data, tmp)
            mask <<= 1
        if op == "avg":
            finish_avg(flat.data, flat.dtype, comm.Get_size())
    _fold.fold_out(flat, comm, rem)


def recursive_doubling_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place by recursive doubling (module docstring).

    Same arguments and result as :func:`hpcjobs.collectives.ring_allreduce`
    without the pipelining: a numpy array or torch CPU tensor, the same
    count and dtype on every rank, reduced in place and bitwise identical
    on every rank; TypeError or ValueError for an unsupported buffer,
    dtype or op.
    """
    return run(buf, op, comm, "recursive_doubling_allreduce", allreduce)
