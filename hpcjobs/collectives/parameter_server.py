"""Parameter-server allreduce: everyone sends to one server, which reduces
and sends the result back.

The centralised design of the first large-scale training systems (Dean et
al., "Large Scale Distributed Deep Networks", 2012; Li et al., "Scaling
Distributed Machine Learning with the Parameter Server", 2014), here with
rank 0 as the single server. Steps, for P ranks and N bytes:

1. Every rank but 0 sends its whole buffer to rank 0, which receives them in
   rank order and reduces each into its own (rank order makes the float
   result deterministic).
2. Rank 0 (after dividing, for avg) sends the result to every other rank.

Cost: 2 rounds for a worker, 2(P-1) messages at the server. A worker sends N
bytes; the server receives N(P-1) and sends N(P-1): 2N(P-1) bytes through one
link, versus 2(P-1)/P·N on every link of a ring. This is the bottleneck the
ring allreduce was adopted to remove, and why it is here: to measure it.
Model (``costs.COSTS["parameter_server"]``, server-bound, every message one
way): 2(P-1)·(α + Nβ) + (P-1)·Nγ.

Step: :func:`allreduce`.
"""

from __future__ import annotations

from mpi4py import MPI

from ._buffers import Flat, finish_avg, reducer, scratch
from ._frame import run

__all__ = ["parameter_server_allreduce", "allreduce"]

_TAG = 15


def allreduce(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    """The parameter server's step (module docstring)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if rank != 0:
        comm.Send(flat.wire, 0, _TAG)
        comm.Recv(flat.wire, 0, _TAG)
        return
    reduce = reducer(op, flat.dtype)
    tmp = scratch(flat.count, flat.data.dtype)
    for src in range(1, size):
        comm.Recv(tmp.view(flat.wire.dtype), src, _TAG)
        reduce(flat.data, tmp)
    if op == "avg":
        finish_avg(flat.data, flat.dtype, size)
    MPI.Request.Waitall([comm.Isend(flat.wire, dst, _TAG) for dst in range(1, size)])


def parameter_server_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place through rank 0 as a parameter server
    (module docstring); arguments, result and errors as
    :func:`hpcjobs.collectives.recursive_doubling_allreduce`."""
    return run(buf, op, comm, "parameter_server_allreduce", allreduce)
