"""``hvd.allgather``, ``broadcast``, ``alltoall``, ``reducescatter``,
``barrier`` and ``join``, with Horovod 0.28's signatures and results.

As for allreduce (:mod:`~hpcjobs.horovod._allreduce`), the plain calls
return new tensors and are differentiable, with Horovod's backward passes:

- ``allgather``: the gradient averaged over the ranks, then this rank's
  rows of it;
- ``broadcast``: the gradient averaged over the ranks on the root, zero
  elsewhere;
- ``alltoall``: the gradient sent back with the received splits;
- ``reducescatter``: the gradient (times P for Sum, times the scale
  factors) allgathered.

The ``_async`` calls return handles; ``broadcast_`` works in place. What
each returns is Horovod's: ``alltoall(tensor)`` the received rows, and
with ``splits`` given ``(rows, received_splits)``; ``synchronize`` of an
``alltoall_async`` handle always the pair. ``reducescatter`` takes Average
or Sum, as Horovod's does, and splits the first dimension as Horovod does:
the first ``rows % P`` ranks get one row more.

``join()``: a rank that has run out of data calls it and the others'
collectives go on without it -- it contributes zeros to their allreduces
(of the agreed shapes and dtypes, on the GPU ``device`` names if the
others' tensors are on GPUs), and their allgathers, broadcasts, alltoalls
and reducescatters fail with HorovodInternalError, as in Horovod -- until
every rank has joined; then it returns, on every rank, the rank that
joined last.

Every call here takes ``process_set=`` (:mod:`~hpcjobs.horovod._process_sets`);
``root_rank`` is the root's ``hvd.rank()``, which must be in the set.
"""

from __future__ import annotations


import numpy as np
import torch

from . import _collectives as C
from ._allreduce import allreduce, copy
from ._compression import Compression
from ._handles import restart_unnamed, run, submit, synchronize
from ._process_sets import resolve
from ._state import Adasum, Average, Sum, global_process_set, reduce_op, world

__all__ = ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
           "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join",
           "submit_broadcast", "set_rank"]


def set_rank(process_set, root_rank: int) -> int:
    """``root_rank`` (an ``hvd.rank()``) as a rank of ``process_set``'s communicator.

    Raises:
        ValueError: ``root_rank`` is not in the set.
    """
    ranks = resolve(process_set)[2]
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not one of the ranks {list(ranks)} of the process set")
    return ranks.index(root_rank)


def _submit_allgather(tensors: list, name, process_set, grouped: bool, with_dims: bool = False) -> int:
    comm = resolve(process_set)[1]

    def job():
        outputs, dims = C.allgather(tensors, comm)
        result = tuple(outputs) if grouped else outputs[0]
        return (result, dims) if with_dims else result

    return submit("allgather", name, job, tensors, process_set=process_set,
                  meta=C.describe(tensors, shapes=False), check=lambda: C.dense(tensors, min_dim=1))


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating ``tensor`` from every rank along dimension 0 (the
    first dimension may differ between ranks, the others may not)."""
    return _submit_allgather([tensor], name, process_set, False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start allgathering each of ``tensors``; ``synchronize`` returns a tuple."""
    return _submit_allgather(list(tensors), name, process_set, True)


def _rows(grad: torch.Tensor, dims: np.ndarray, process_set) -> torch.Tensor:
    """This rank's rows of a gathered gradient, averaged over the set first."""
    rank = resolve(process_set)[2].index(world().rank)
    return allreduce(grad, op=Average, process_set=process_set).narrow(0, int(dims[:rank].sum()), int(dims[rank]))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        output, dims = synchronize(_submit_allgather([tensor], name, process_set, False, with_dims=True))
        ctx.dims, ctx.process_set = dims[:, 0], process_set
        return output

    @staticmethod
    def backward(ctx, grad):
        return _rows(grad, ctx.dims, ctx.process_set), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """``tensor`` from every rank, concatenated along dimension 0 (differentiable)."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        outputs, ctx.dims = synchronize(_submit_allgather(list(tensors), name, process_set, True, with_dims=True))
        ctx.process_set = process_set
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(_rows(g, ctx.dims[:, i], ctx.process_set) for i, g in enumerate(grads)))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """:func:`allgather` of each of ``tensors``, as a tuple (differentiable)."""
    return _GroupedAllgather.apply(name, process_set, *tensors)


def submit_broadcast(tensors: list, root_rank: int, name, process_set=global_process_set) -> int:
    """Start overwriting ``tensors`` with root's, in place (one request for
    them all); ``synchronize`` returns the first."""
    comm, ranks = resolve(process_set)[1:]

    def check():
        if root_rank not in ranks:
            raise ValueError(f"root_rank {root_rank} is not one of the ranks {list(ranks)} of the process set")
        C.dense(tensors, contiguous=True)

    def job():
        C.broadcast(tensors, ranks.index(root_rank), comm)
        return tensors[0]

    return submit("broadcast", name, job, tensors, process_set=process_set,
                  meta={"root": root_rank, **C.describe(tensors)}, check=check)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start broadcasting root's ``tensor`` into a new tensor."""
    return submit_broadcast([copy(tensor)], root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start overwriting ``tensor`` with root's, in place."""
    return submit_broadcast([tensor], root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with root's, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        return (reduced if world().rank == ctx.root_rank else reduced * 0), None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Root's ``tensor``, as a new tensor on every rank (differentiable)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending rows ``splits[q]`` of ``tensor`` to the set's q-th rank
    (``splits`` None: equal parts); ``synchronize`` returns ``(rows
    received, received_splits)``."""
    comm, ranks = resolve(process_set)[1:]
    like = splits if isinstance(splits, torch.Tensor) else None
    given = splits.tolist() if like is not None else splits
    send = []

    def check():
        if like is not None and (like.is_floating_point() or like.is_complex() or like.dtype == torch.bool):
            raise ValueError(f"splits must hold integers (Horovod takes torch.int32), got {like.dtype}")
        send.append(C.alltoall_counts(tensor, given, len(ranks)))

    def job():
        output, received = C.alltoall(tensor, send[0], comm)
        if like is None:
            return output, torch.from_numpy(received.astype(np.int32))
        return output, torch.tensor(received.tolist(), dtype=like.dtype, device=like.device)

    return submit("alltoall", name, job, [tensor], process_set=process_set,
                  meta=C.describe([tensor], shapes=False), check=check)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *_):
        return alltoall(grad, splits=ctx.received, process_set=ctx.process_set)[0], None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows ``splits[q]`` of ``tensor`` to the set's q-th rank, and this
    rank's rows from every rank, in rank order (differentiable): the rows,
    or with ``splits`` given, ``(rows, received_splits)``."""
    return _Alltoall.apply(tensor, splits, name, process_set)


def _reducescatter_op(op) -> int:
    if op == Adasum or op not in (Average, Sum, None):
        raise NotImplementedError("Reducescatter currently only supports AVERAGE and SUM.")
    return reduce_op(op, None)


def _submit_reducescatter(tensors: list, name, op, prescale: float, postscale: float, process_set,
                          grouped: bool) -> int:
    op = _reducescatter_op(op)
    comm = resolve(process_set)[1]

    def job():
        outputs = C.reducescatter(tensors, op, prescale, postscale, comm)
        return tuple(outputs) if grouped else outputs[0]

    return submit("reducescatter", name, job, tensors, process_set=process_set,
                  meta={**C.describe(tensors), "op": op, "prescale": repr(float(prescale)),
                        "postscale": repr(float(postscale))}, check=lambda: C.dense(tensors, min_dim=1))
def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start reducing ``tensor`` and keeping this rank's block of rows."""
    return _submit_reducescatter([tensor], name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start :func:`reducescatter_async` of each of ``tensors``; ``synchronize`` returns a tuple."""
    return _submit_reducescatter(list(tensors), name, op, prescale_factor, postscale_factor, process_set, True)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = op, prescale, postscale, process_set
        return synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set, prescale,
                                                       postscale))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        factor = (len(resolve(process_set)[2]) if op == Sum else 1) * prescale * postscale
        return (None, None, None, None, None,
                *(allgather(g * factor if factor != 1 else g, process_set=process_set) for g in grads))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's block of rows of the reduction of ``tensor`` (differentiable)."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor)[0]


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    """:func:`reducescatter` of each of ``tensors``, as a list (differentiable)."""
    op = _reducescatter_op(op)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _Reducescatter.apply(name, op, prescale_factor, postscale_factor, process_set, *(p for p, _ in pairs))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the set has called ``barrier``."""
    run("barrier", None, lambda: None, process_set=process_set)


def join(device=-1) -> int:
    """This rank is out of data: the others' collectives go on without it
    until every rank has joined (module docstring). Returns the rank that
    joined last, on every rank."""
    w = world()
    w.controller.join_device = device
    last = run("join", None, lambda: None)
    restart_unnamed()  # every rank is here: unnamed calls skipped while joined no longer count
    return last
