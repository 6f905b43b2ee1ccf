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

``join`` differs from Horovod's. There, a rank that has run out of data
calls ``join()`` and the others' collectives go on without it (it
contributes zeros) until every rank has joined. Here collectives run in the
order each rank calls them and cannot go on without a rank, so ``join()``
is a collective every rank calls once it is done: it returns the rank that
called it last (by each rank's wall clock at the call; the highest such
rank on a tie) and ignores ``device``. Uneven numbers of batches per rank
are not supported; give every rank the same number of steps.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from . import _collectives as C
from ._allreduce import allreduce, copy
from ._compression import Compression
from ._handles import run, submit, synchronize
from ._state import Average, Sum, check_process_set, global_process_set, reduce_op, world

__all__ = ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
           "broadcast_", "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join",
           "submit_broadcast"]


def _submit_allgather(tensors: list, name, process_set, grouped: bool, with_dims: bool = False) -> int:
    check_process_set(process_set)
    comm = world().ops

    def job():
        outputs, dims = C.allgather(tensors, name, comm)
        result = tuple(outputs) if grouped else outputs[0]
        return (result, dims) if with_dims else result

    return submit("allgather", name, job, tensors)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating ``tensor`` from every rank along dimension 0 (the
    first dimension may differ between ranks, the others may not)."""
    return _submit_allgather([tensor], name, process_set, False)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start allgathering each of ``tensors``; ``synchronize`` returns a tuple."""
    return _submit_allgather(list(tensors), name, process_set, True)


def _rows(grad: torch.Tensor, dims: np.ndarray) -> torch.Tensor:
    """This rank's rows of a gathered gradient, averaged over the ranks first."""
    rank = world().rank
    return allreduce(grad, op=Average).narrow(0, int(dims[:rank].sum()), int(dims[rank]))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        output, dims = synchronize(_submit_allgather([tensor], name, global_process_set, False, with_dims=True))
        ctx.dims = dims[:, 0]
        return output

    @staticmethod
    def backward(ctx, grad):
        return _rows(grad, ctx.dims), None


def allgather(tensor, name=None, process_set=global_process_set):
    """``tensor`` from every rank, concatenated along dimension 0 (differentiable)."""
    check_process_set(process_set)
    return _Allgather.apply(tensor, name)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *tensors):
        outputs, ctx.dims = synchronize(_submit_allgather(list(tensors), name, global_process_set, True,
                                                          with_dims=True))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(_rows(g, ctx.dims[:, i]) for i, g in enumerate(grads)))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """:func:`allgather` of each of ``tensors``, as a tuple (differentiable)."""
    check_process_set(process_set)
    return _GroupedAllgather.apply(name, *tensors)


def submit_broadcast(tensors: list, root_rank: int, name, process_set=global_process_set) -> int:
    """Start overwriting ``tensors`` with root's, in place (one agreement on
    them all); ``synchronize`` returns the first."""
    check_process_set(process_set)
    comm = world().ops

    def job():
        C.broadcast(tensors, root_rank, name, comm)
        return tensors[0]

    return submit("broadcast", name, job, tensors)


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
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average)
        return (reduced if world().rank == ctx.root_rank else reduced * 0), None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Root's ``tensor``, as a new tensor on every rank (differentiable)."""
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, name)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending rows ``splits[q]`` of ``tensor`` to rank q (``splits``
    None: equal parts); ``synchronize`` returns ``(rows received,
    received_splits)``."""
    check_process_set(process_set)
    comm = world().ops
    like = splits if isinstance(splits, torch.Tensor) else None
    given = splits.tolist() if like is not None else splits

    def job():
        output, received = C.alltoall(tensor, given, name, comm)
        if like is None:
            return output, torch.from_numpy(received.astype(np.int32))
        return output, torch.tensor(received.tolist(), dtype=like.dtype, device=like.device)

    return submit("alltoall", name, job, [tensor])


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        output, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *_):
        return alltoall(grad, splits=ctx.received)[0], None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows ``splits[q]`` of ``tensor`` to rank q, and this rank's rows from
    every rank, in rank order (differentiable): the rows, or with
    ``splits`` given, ``(rows, received_splits)``."""
    check_process_set(process_set)
    return _Alltoall.apply(tensor, splits, name)


def _submit_reducescatter(tensors: list, name, op, prescale: float, postscale: float, process_set,
                          grouped: bool) -> int:
    check_process_set(process_set)
    op = reduce_op(op, None)
    if op not in (Average, Sum):
        raise ValueError("Reducescatter currently only supports AVERAGE and SUM.")
    comm = world().ops

    def job():
        outputs = C.reducescatter(tensors, op, prescale, postscale, name, comm)
        return tuple(outputs) if grouped else outputs[0]

    return submit("reducescatter", name, job, tensors)


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
    def forward(ctx, name, op, prescale, postscale, *tensors):
        ctx.args = op, prescale, postscale
        return synchronize(grouped_reducescatter_async(list(tensors), name, op, global_process_set, prescale,
                                                       postscale))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale = ctx.args
        factor = (world().size if op == Sum else 1) * prescale * postscale
        return (None, None, None, None, *(allgather(g * factor if factor != 1 else g) for g in grads))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's block of rows of the reduction of ``tensor`` (differentiable)."""
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor)[0]


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    """:func:`reducescatter` of each of ``tensors``, as a list (differentiable)."""
    check_process_set(process_set)
    op = reduce_op(op, None)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _Reducescatter.apply(name, op, prescale_factor, postscale_factor, *(p for p, _ in pairs))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank has called ``barrier`` (and every collective
    called before it has finished)."""
    check_process_set(process_set)
    comm = world().ops
    run("barrier", None, lambda: C.barrier(comm))


def join(device=-1) -> int:
    """A collective every rank calls when it is done; returns the rank that
    called it last (module docstring: how it differs from Horovod's)."""
    arrived = time.time()
    comm = world().ops
    return run("join", None, lambda: C.join(arrived, comm))
