"""``compressed_allreduce``: each compressor on the collective it needs.

1. With ``memory`` (error feedback), add this tensor's residual.
   With checks on, every rank first agrees on shape, dtype, compressor,
   name, step and algorithm (:mod:`hpcjobs.collectives.agreement`): a
   mismatch would otherwise hang the allgather or add up unrelated values.
2. Compress, and move the payload:
   - summable payloads (fp16, bf16, random-k, the identity) are averaged
     by our allreduce and decompressed once;
   - PowerSGD runs its two allreduces (``reduce_mean``);
   - the others (top-k, QSGD, sign) travel by our ring allgather of
     variable-size payloads (sizes first), and every rank decompresses the
     P payloads and adds them, in rank order, so all ranks get the same
     bits.
3. Average once (the allreduce's ``avg``, or the sum divided by P).
4. With ``memory``, keep what this rank's compression dropped.

On a GPU every compressor runs with torch ops on the device and the
error-feedback residuals stay there; the payloads, small by design, are
copied to the host for the message-passing step and back.

Wire bytes are counted as they are sent (:mod:`hpcjobs.collectives.counting`).
Compression exists to cut those bytes, so payloads always take a
message-passing algorithm: ``auto`` picks among them, and the shared-memory
ones are refused.
"""

from __future__ import annotations

import math
import numbers
import sys

import numpy as np
import torch
from mpi4py import MPI

from ..collectives import ring
from ..collectives._buffers import as_flat
from ..collectives.agreement import agree_or_raise
from ..collectives.counting import CountingComm, message_algorithm, send_counted
from ..collectives.watchdog import guard
from ..comm import private
from .base import Compressor, NoneCompressor
from .error_feedback import ErrorFeedback

__all__ = ["compressed_allreduce"]


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().reshape(-1).cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()


def _torch(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    t = torch.from_numpy(a)
    t = t.view(torch.bfloat16) if like.dtype == torch.bfloat16 else t
    return t.to(like.device)


def compressed_allreduce(tensor: torch.Tensor, compressor: Compressor, memory: ErrorFeedback | None = None,
                         name: str | None = None, comm: MPI.Comm | None = None, algorithm: str = "auto",
                         step: int = 0) -> tuple[torch.Tensor, int]:
    """Average ``tensor`` over the ranks of ``comm`` through ``compressor``
    (under the stall watchdog, :mod:`hpcjobs.collectives.watchdog`).

    Args:
        tensor: a floating-point tensor, on the CPU or a GPU (the
            compressor runs there, residuals stay there, payloads cross
            through host memory); the same shape and dtype on every rank.
            Not modified.
        compressor: the same compressor on every rank; None sends the
            tensor whole (:class:`NoneCompressor`: ``make_compressor("none")``).
        memory: an :class:`ErrorFeedback` for this rank, or None.
        name: the tensor's name (parameter name), needed with ``memory`` and
            by random-k and PowerSGD to tell tensors apart.
        comm: intracommunicator; None for COMM_WORLD.
        algorithm: for summable payloads, "auto" or one of
            :data:`hpcjobs.collectives.counting.MESSAGE_ALGORITHMS`.
        step: the iteration, the same on every rank (random-k's indices,
            PowerSGD's ``start_iter``).

    Returns:
        ``(average, sent_bytes)``: the decompressed average (a new tensor,
        bitwise the same on every rank) and the bytes this rank sent.
    """
    with guard("compressed_allreduce", comm):
        return _compressed_allreduce(tensor, compressor, memory, name, comm, algorithm, step)


def _step_ok(step) -> bool:
    """Whether ``step`` is a whole number >= 0 (infinity, whose int() raises, is not)."""
    return (isinstance(step, numbers.Real) and not isinstance(step, bool) and math.isfinite(step)
            and int(step) == step and step >= 0)


def _compressed_allreduce(tensor, compressor, memory, name, comm, algorithm, step):
    comm = private(comm)
    size = comm.Get_size()
    error, compressor = None, NoneCompressor() if compressor is None else compressor
    try:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be an hpcjobs.compression.Compressor or None, got "
                            f"{type(compressor).__name__}")
        if memory is not None and name is None:
            raise ValueError("error feedback keeps residuals by name: pass name= with memory=")
        if memory is not None and getattr(compressor, "unbiased", False):  # (random-k's n/k scaling)
            raise ValueError(f"{compressor!r} is no contraction: error feedback's residual grows without bound "
                             "with it (700,000 times the gradient's norm after 30 steps at 1%); use unbiased=False "
                             "with error feedback")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"compressed_allreduce takes a torch.Tensor, got {type(tensor).__name__}")
        if memory is not None and not isinstance(memory, ErrorFeedback):
            raise TypeError(f"memory must be an hpcjobs.compression.ErrorFeedback or None, got "
                            f"{type(memory).__name__}")
        if memory is not None:  # a residual of another tensor (a stale checkpoint on one rank): refused everywhere
            memory.check(name, tensor)
        message_algorithm(algorithm, 0, size)  # refuses shm/hierarchical before anything moves
        if not _step_ok(step):  # (random-k's and PowerSGD's seeds: numpy's bare words, at the first draw)
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
    except (TypeError, ValueError) as e:
        error = e
    is_tensor = isinstance(tensor, torch.Tensor)
    agree_or_raise(comm, "compressed_allreduce", {
        "shape": str(tuple(tensor.shape)) if is_tensor else None,
        "dtype": str(tensor.dtype) if is_tensor else None, "device": tensor.device.type if is_tensor else None,
        "compressor": repr(compressor), "name": name,
        "step": int(step) if error is None else None, "algorithm": algorithm, "error feedback": memory is not None},
        error)
    if memory is not None and comm.Get_rank() == 0:
        _warn_no_contraction(compressor, tensor.numel())
    x = memory.compensate(name, tensor) if memory is not None else tensor
    sent = 0

    def allreduce_mean(buf: torch.Tensor) -> None:
        # the ranks agreed above: the payload's own allreduces go unchecked
        nonlocal sent
        if buf.is_cpu:
            sent += send_counted(as_flat(buf), "avg", algorithm, comm)
        else:  # a device payload crosses through host memory, whole (payloads are small)
            host = buf.cpu()
            sent += send_counted(as_flat(host), "avg", algorithm, comm)
            buf.copy_(host)

    reduce_mean = getattr(compressor, "reduce_mean", None)
    if reduce_mean is not None:
        mean, local = reduce_mean(x, allreduce_mean, name=name, step=step)
    else:
        payload, ctx = compressor.compress(x, name=name, step=step)
        local = compressor.decompress(payload, ctx) if memory is not None else None
        parts = payload if isinstance(payload, tuple) else (payload,)
        if compressor.summable:
            # our allreduce works in place: never on the caller's memory
            parts = tuple(p.clone(memory_format=torch.contiguous_format)
                          if p.data_ptr() in (x.data_ptr(), tensor.data_ptr()) else p.contiguous() for p in parts)
            for p in parts:
                allreduce_mean(p)
            mean = compressor.decompress(parts if isinstance(payload, tuple) else parts[0], ctx)
        else:
            proxy = CountingComm(comm)
            rows = ring.allgatherv([_numpy(p) for p in parts], proxy) if size > 1 else [[_numpy(p) for p in parts]]
            sent += proxy.sent
            mean = None
            for row in rows:  # rank order: the same sum on every rank, in float32 at least (fp16 sums overflow)
                got = tuple(_torch(a, p) for a, p in zip(row, parts))
                d = compressor.decompress(got if isinstance(payload, tuple) else got[0], ctx)
                mean = d.to(torch.promote_types(d.dtype, torch.float32), copy=True) if mean is None else mean.add_(d)
            mean = (mean.div_(size) if size > 1 else mean).to(x.dtype)
    if memory is not None:  # a step counts where the average, the same on every rank, is finite
        memory.update(name, x, local, applied=bool(torch.isfinite(mean).all()))
    return mean, sent


_warned: set = set()


def _warn_no_contraction(compressor, n: int) -> None:
    """Once per compressor (its first tensor where it is none): error
    feedback needs a contraction (Stich et al. 2018; Karimireddy et al.
    2019), and a compressor that says where it is none (QSGD above levels²
    entries) gets its words said, for a residual that can grow without
    bound."""
    note = getattr(compressor, "feedback_note", None)
    said = note(n) if note is not None and repr(compressor) not in _warned else None
    if said:
        _warned.add(repr(compressor))
        print(f"hpcjobs: warning: {said}", file=sys.stderr, flush=True)
