"""``hvd.allreduce`` and its family, with Horovod 0.28's signatures,
defaults and return values (``horovod/torch/mpi_ops.py``).

Three forms of each operation, as in Horovod:

- ``allreduce(tensor)`` returns a new tensor and is differentiable: an
  autograd Function whose backward allreduces the gradient with the same
  op and scale factors (Horovod's ``HorovodAllreduce``);
- ``allreduce_(tensor)`` reduces in place and returns ``tensor``;
- ``allreduce_async(tensor)`` / ``allreduce_async_(tensor)`` return a
  handle for ``poll`` and ``synchronize`` (:mod:`~hpcjobs.horovod._handles`);
  the out-of-place one copies ``tensor`` at the call.

``op`` is Average (the default), Sum, Min, Max or Product; Adasum raises
ValueError. The deprecated ``average=True/False`` still means Average/Sum.
``prescale_factor`` multiplies before the reduction, ``postscale_factor``
after. ``compression`` (the plain and grouped forms) compresses before and
decompresses after, as Horovod does: ``Compression.fp16`` reduces in half
precision. ``grouped_allreduce`` reduces a list in one collective per dtype
(the tensors fused into one buffer). Integer Average: the sum times 1/P,
truncated toward zero (:mod:`~hpcjobs.horovod._collectives`).
"""

from __future__ import annotations

import torch

from . import _collectives as C
from ._compression import Compression
from ._handles import submit, synchronize
from ._state import global_process_set, reduce_op

__all__ = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "copy"]


def copy(t: torch.Tensor) -> torch.Tensor:
    """The output of an out-of-place call: a contiguous copy, made at the call."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def _submit(outputs: list, name, op: int, prescale: float, postscale: float, process_set, grouped: bool) -> int:
    meta = {**C.describe(outputs), "op": op, "prescale": repr(float(prescale)), "postscale": repr(float(postscale))}

    def job():
        return tuple(outputs) if grouped else outputs[0]

    return submit("allreduce", name, job, outputs, process_set=process_set, meta=meta, buffers=outputs,
                  check=lambda: C.dense(outputs, contiguous=True), spec=C.spec(outputs))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start reducing a copy of ``tensor``; ``synchronize`` returns the result."""
    return _submit([copy(tensor)], name, reduce_op(op, average), prescale_factor, postscale_factor, process_set,
                   False)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """Start reducing ``tensor`` in place; ``synchronize`` returns it."""
    return _submit([tensor], name, reduce_op(op, average), prescale_factor, postscale_factor, process_set, False)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = op, prescale, postscale, process_set
        return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale, process_set=process_set))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return (allreduce(grad, op=op, prescale_factor=prescale, postscale_factor=postscale,
                          process_set=process_set), None, None, None, None, None)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """The reduction of ``tensor`` over the ranks, as a new tensor
    (differentiable); ``tensor`` is not modified."""
    op = reduce_op(op, average)
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(_Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor,
                                                   process_set), ctx)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    """Start reducing copies of ``tensors``; ``synchronize`` returns a tuple."""
    return _submit([copy(t) for t in tensors], name, reduce_op(op, average), prescale_factor, postscale_factor,
                   process_set, True)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing ``tensors`` in place; ``synchronize`` returns them as a tuple."""
    return _submit(list(tensors), name, reduce_op(op, average), prescale_factor, postscale_factor, process_set,
                   True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduce ``tensors`` in place; returns them as a tuple."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = op, prescale, postscale, process_set
        return synchronize(grouped_allreduce_async(list(tensors), name=name, op=op, prescale_factor=prescale,
                                                   postscale_factor=postscale, process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        reduced = grouped_allreduce(list(grads), op=op, prescale_factor=prescale, postscale_factor=postscale,
                                    process_set=process_set)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> list:
    """The reductions of ``tensors``, as a list of new tensors (differentiable)."""
    op = reduce_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *(p for p, _ in pairs))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]
