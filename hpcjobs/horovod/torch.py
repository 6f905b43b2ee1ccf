"""``import hpcjobs.horovod.torch as hvd``: Horovod's torch API (0.28) on
hpcjobs' collectives, for scripts written for ``horovod.torch``::

    import hpcjobs.horovod.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in shard:          # loss.backward(), opt.step() as usual

Horovod itself is not used: this is Python on mpi4py, numpy and torch.
Where each part lives:

- ``init``, ``shutdown``, ``size``/``rank`` and the rest:
  :mod:`~hpcjobs.horovod._state`; process sets:
  :mod:`~hpcjobs.horovod._process_sets`;
- the collectives: :mod:`~hpcjobs.horovod._allreduce` (allreduce family),
  :mod:`~hpcjobs.horovod._ops` (allgather, broadcast, alltoall,
  reducescatter, barrier, join), :mod:`~hpcjobs.horovod._sparse`
  (``sparse_allreduce_async``): each a request
  (:mod:`~hpcjobs.horovod._handles`: handles, names, ``poll``,
  ``synchronize``) that the controller (:mod:`~hpcjobs.horovod._controller`)
  matches across ranks by name, fuses and runs with
  :mod:`~hpcjobs.horovod._collectives`;
- ``broadcast_parameters``, ``broadcast_optimizer_state``,
  ``broadcast_object``, ``allgather_object``:
  :mod:`~hpcjobs.horovod._functions`;
- ``DistributedOptimizer``: :mod:`~hpcjobs.horovod._optimizer`, on
  :class:`hpcjobs.training.DistributedOptimizer`;
- ``Compression``: :mod:`~hpcjobs.horovod._compression`;
- ``SyncBatchNorm``: :mod:`~hpcjobs.horovod._sync_batch_norm`.

What differs from Horovod, all said where it is done: Adasum, elastic
training and the timeline are not provided (using them raises, naming what
is missing); a mismatch across ranks raises :class:`HorovodMismatchError`,
a ``HorovodInternalError`` (RuntimeError) that is also hpcjobs'
MismatchError, with hpcjobs' message naming the ranks and their values. The ``*_built()`` functions describe this
implementation: MPI yes, Gloo, NCCL, DDL, oneCCL and ROCm no, CUDA tensors
yes when torch has CUDA.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ._allreduce import (allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce,
                         grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_)
from ._compression import Compression
from ._functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ._handles import HorovodMismatchError, poll, synchronize
from ._ops import (allgather, allgather_async, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                   broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async,
                   grouped_reducescatter, grouped_reducescatter_async, join, reducescatter, reducescatter_async)
from ._optimizer import DistributedOptimizer
from ._sparse import sparse_allreduce_async
from ._state import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum, add_process_set,
                     global_process_set, init, is_initialized, remove_process_set, shutdown, world)
from ._sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "HorovodMismatchError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "barrier", "join", "poll", "synchronize", "sparse_allreduce_async",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "DistributedOptimizer", "Compression", "SyncBatchNorm",
]


def size() -> int:
    """The number of ranks."""
    return world().size


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return world().rank


def local_size() -> int:
    """The number of ranks on this rank's node."""
    return world().topology.local_size


def local_rank() -> int:
    """This rank's place among the ranks on its node."""
    return world().topology.local_rank


def cross_size() -> int:
    """The number of nodes with a rank of this rank's local rank."""
    return world().topology.cross_comm.Get_size()


def cross_rank() -> int:
    """This rank's node, among those with a rank of its local rank."""
    return world().topology.cross_comm.Get_rank()


def is_homogeneous() -> bool:
    """Whether every node has the same number of ranks."""
    return world().topology.uniform


def mpi_threads_supported() -> bool:
    """Whether MPI gives ``MPI_THREAD_MULTIPLE``: user MPI calls may then run
    beside the collectives' worker thread."""
    world()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """0: no NCCL (Horovod returns NCCL's version code when built with it)."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors can be reduced: torch was built with CUDA
    (hpcjobs' collectives take CUDA tensors, :mod:`hpcjobs.collectives.device`)."""
    return torch.version.cuda is not None


_MISSING = {
    "elastic": "hvd.elastic is not provided by hpcjobs (no elastic training: a job runs on a fixed set of ranks)",
    "start_timeline": "hvd.start_timeline is not provided by hpcjobs (no Horovod timeline)",
    "stop_timeline": "hvd.stop_timeline is not provided by hpcjobs (no Horovod timeline)",
}


def __getattr__(name: str):
    """Horovod names this module does not provide raise NotImplementedError
    saying so, rather than AttributeError."""
    if name in _MISSING:
        raise NotImplementedError(_MISSING[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
