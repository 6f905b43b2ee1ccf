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
Model (server-bound): 2(P-1)(α + Nβ) + (P-1)·Nγ.
"""

from __future__ import annotations

from mpi4py import MPI

from ._buffers import Flat, finish_avg, reducer, run, scratch

__all__ = ["parameter_server_allreduce"]

_TAG = 15


def _parameter_server(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
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
    (module docstring).

    Args:
        buf: numpy array or torch CPU tensor, contiguous and writable; same
            count and dtype on every rank.
        op: "sum", "avg", "min", "max" or "prod".
        comm: intracommunicator; None for COMM_WORLD (a private Dup is used).

    Returns:
        ``buf``, reduced in place, bitwise identical on every rank.
    """
    return run(buf, op, comm, _parameter_server)
