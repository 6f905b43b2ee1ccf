"""The two doors measured as baselines: torch.distributed's ``all_reduce``
through the hpcjobs backend (``ddp-hpcjobs``: what DDP calls per bucket) and
``hvd.allreduce_`` of the Horovod-compatible API (``hvd-hpcjobs``), each on
the benchmark's own memory. Beside ``gloo`` and ``horovod`` they show what
the doors cost on top of our collectives."""

from __future__ import annotations

import sys

from mpi4py import MPI

from ..collectives._buffers import OP_TABLE, as_flat, check_op, torch_view
from ..comm import private

__all__ = ["backend_allreduce", "hvd_api_allreduce", "stop"]

_groups: dict = {}  # the private communicator (its Fortran handle) -> its hpcjobs process group


def backend_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """``ProcessGroup.allreduce`` of the hpcjobs backend, waited for, in
    place (``avg`` is torch's ``ReduceOp.AVG``)."""
    import torch.distributed as dist

    from ..torch_backend import new_process_group

    check_op(op)
    flat = as_flat(buf)
    comm = private(comm)
    group = _groups.get(comm.py2f())
    if group is None:
        group = _groups[comm.py2f()] = new_process_group(comm)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG if op == "avg" else getattr(dist.ReduceOp, OP_TABLE[op].dist)
    group.allreduce([torch_view(flat)], opts).wait()
    return buf


def hvd_api_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """``hpcjobs.horovod.torch.allreduce_``, in place (``avg``: Average)."""
    from ..horovod import torch as hvd

    check_op(op)
    flat = as_flat(buf)
    hvd.init(private(comm))
    red = hvd.Average if op == "avg" else getattr(hvd, OP_TABLE[op].horovod)
    hvd.allreduce_(torch_view(flat), op=red)
    return buf


def stop() -> None:
    """Stop the groups' workers and the Horovod API (at the benchmark's end)."""
    for group in _groups.values():
        group.shutdown()
    _groups.clear()
    hvd = sys.modules.get("hpcjobs.horovod.torch")
    if hvd is not None:
        hvd.shutdown()
