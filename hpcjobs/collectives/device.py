"""Device buffers: CUDA tensors seen by the collectives, and the few torch
calls every GPU transport shares.

A host buffer becomes a :class:`~hpcjobs.collectives._buffers.Flat` (numpy
views of its memory). A CUDA tensor becomes a :class:`DeviceFlat`: a 1-D
view of the same memory as a torch tensor, which the transports move and
reduce with torch on the device (:mod:`~hpcjobs.collectives.cuda_ipc`) or
stage through pinned host memory for the host algorithms
(:mod:`~hpcjobs.collectives.staged`). Which one runs is decided in
:mod:`~hpcjobs.collectives.select`.

Ordering. Every transport does its device work on one internal stream per
device, which first waits for the caller's current stream (so it sees the
tensor as the caller's queued kernels leave it) and which the caller's
stream then waits for (so the caller's next kernels see the result). The
call returns when the host's part is done; like NCCL's, the device's part
may still be running, ordered before anything the caller queues next on
that stream. ``torch.cuda.synchronize()`` waits for it.

A :class:`DeviceFlat` may also hold a CPU tensor: the transports' chunking,
pipelining and rank-order reduction then run with CPU memory standing in for
the device (every stream and event call below is a no-op on the CPU), which
is how CI, without a GPU, tests them.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

from ._buffers import DTYPES

__all__ = ["DeviceFlat", "is_device_buffer", "as_device_flat", "divide", "Stream",
           "DEVICE_REDUCE_DTYPES"]

# The dtypes torch reduces on a CUDA device (add/min/max/mul). torch's
# uint16/32/64 move and copy but have no CUDA arithmetic: those go through
# the staged transport, whose host algorithms reduce every dtype.
DEVICE_REDUCE_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8")


@dataclass(frozen=True)
class DeviceFlat:
    """A device buffer seen as a flat tensor sharing its memory.

    Attributes:
        tensor: 1-D contiguous view of the user's tensor (same memory).
        dtype: the element type's name, e.g. "float32" or "bfloat16".
    """

    tensor: object
    dtype: str

    @property
    def count(self) -> int:
        return self.tensor.numel()

    @property
    def itemsize(self) -> int:
        return self.tensor.element_size()

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    @property
    def device(self) -> str:
        """The device type every rank must agree on: "cuda" (or "cpu" for
        a stand-in)."""
        return self.tensor.device.type

    def slice(self, lo: int, hi: int) -> "DeviceFlat":
        """Elements ``[lo, hi)`` as a DeviceFlat over the same memory."""
        return DeviceFlat(self.tensor[lo:hi], self.dtype)


def is_device_buffer(buf) -> bool:
    """Whether ``buf`` is a torch tensor that is not in host memory."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(buf, torch.Tensor) and buf.device.type != "cpu"


def as_device_flat(t) -> DeviceFlat:
    """View the CUDA tensor ``t`` as a :class:`DeviceFlat` without copying.

    Raises:
        ValueError: not a CUDA tensor, on a GPU other than this rank's
            current one, non-contiguous or sparse.
        TypeError: an unsupported dtype.
    """
    import torch

    if t.device.type != "cuda":
        raise ValueError(f"tensor is on {t.device}; hpcjobs collectives take CPU or CUDA tensors")
    if t.layout != torch.strided:
        raise ValueError(f"sparse tensors are not supported (layout {t.layout})")
    current = torch.cuda.current_device()
    if t.device.index != current:
        raise ValueError(f"tensor is on {t.device} but this rank's GPU is cuda:{current}: each rank reduces on "
                         "its own GPU (torch.cuda.set_device(local_rank), or HPCJOBS_BIND_GPU=1)")
    if not t.is_contiguous():
        raise ValueError(f"tensor must be contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass "
                         "t.contiguous() and copy the result back (t.copy_(...)): a copy is reduced, not t")
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"unsupported dtype {t.dtype}; supported: {', '.join(DTYPES)}")
    return DeviceFlat(t.detach().view(-1), name)


def divide(t, dtype: str, size: int) -> None:
    """``avg``'s one division by the group size, in place: true division for
    floats, floor division for integers (as the host path's ``finish_avg``)."""
    if size == 1:
        return
    import torch

    if dtype == "bfloat16" or dtype.startswith("float"):
        t.div_(size)
    elif size <= torch.iinfo(t.dtype).max:
        t.div_(size, rounding_mode="floor")
    else:  # more ranks than the dtype counts to (torch casts size to it: int8 128 is -128): |v| < size
        t.copy_((t < 0).to(t.dtype).neg_())


class Stream:
    """The transports' internal stream on one device, and events on it.

    ``with Stream.of(tensor) as s:`` makes ``s`` the current stream after it
    has waited for the caller's, and on exit makes the caller's stream wait
    for ``s``. On a CPU tensor (the CI stand-in) it does nothing and its
    events are already complete.
    """

    _by_device: dict = {}

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    @classmethod
    @contextlib.contextmanager
    def of(cls, tensor):
        device = tensor.device
        s = cls._by_device.get(device)
        if s is None:
            s = cls._by_device[device] = cls(device)
        if not s.cuda:
            yield s
            return
        import torch

        caller = torch.cuda.current_stream(device)
        s.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(s.stream):
                yield s
        finally:
            caller.wait_stream(s.stream)

    def event(self):
        """A recorded event of the work queued on this stream so far."""
        if not self.cuda:
            return _DONE
        import torch

        e = torch.cuda.Event()
        e.record(self.stream)
        return e

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()


class _Done:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DONE = _Done()
