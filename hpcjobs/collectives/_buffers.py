"""Zero-copy views of user buffers, the one op and dtype table, and chunk bounds.

Every collective turns its buffer into a :class:`Flat`: two 1-D numpy views
of the *same memory* as the user's numpy array or torch CPU tensor, one typed
for reductions (``data``) and one as same-width unsigned integers for the wire
(``wire``). Moving unsigned integers keeps MPI out of the business of knowing
float16 or bfloat16, which classic MPI has no datatype for; reductions happen
here, with numpy ufuncs, or torch for bfloat16, which numpy lacks, and for
float16 sums, which numpy does without SIMD.

:data:`OP_TABLE` is the one place a reduction is spelled for every library the
suite talks to (numpy, torch, MPI, torch.distributed, Horovod), so the
baselines and the soak's reference use the op the collectives use.

This module imports numpy alone (torch only when a torch tensor, bfloat16
or a float16 sum shows up), so the command line can read :data:`OPS` and
:data:`DTYPES` without starting MPI.
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Op:
    """One reduction, as each library spells it. ``avg`` reduces as a sum;
    the division by the group size comes once, after (:func:`finish_avg`)."""

    name: str
    ufunc: np.ufunc  # numpy, in place: ufunc(dst, src, out=dst)
    torch: str  # the torch function (bfloat16, which numpy lacks)
    mpi: str  # mpi4py's MPI.<mpi>
    dist: str  # torch.distributed.ReduceOp.<dist>
    horovod: str  # horovod.torch.<horovod>


OP_TABLE = {op.name: op for op in (
    Op("sum", np.add, "add", "SUM", "SUM", "Sum"),
    Op("avg", np.add, "add", "SUM", "SUM", "Sum"),
    Op("min", np.minimum, "minimum", "MIN", "MIN", "Min"),
    Op("max", np.maximum, "maximum", "MAX", "MAX", "Max"),
    Op("prod", np.multiply, "mul", "PROD", "PRODUCT", "Product"),
)}
OPS = tuple(OP_TABLE)

# numpy dtype name -> wire dtype of the same width
_NUMPY_DTYPES = {
    "float16": np.uint16, "float32": np.uint32, "float64": np.uint64,
    "int8": np.uint8, "int16": np.uint16, "int32": np.uint32, "int64": np.uint64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
}
DTYPES = tuple(_NUMPY_DTYPES) + ("bfloat16",)
_NUMPY_OF = {name: np.dtype(name) for name in _NUMPY_DTYPES}
# Keyed by the dtype object: numpy computes dtype.name in Python, slowly, and
# this lookup runs on every collective call. Native byte order only.
_BY_DTYPE = {np.dtype(name): name for name in _NUMPY_DTYPES}
_WIRE = {name: np.dtype(wire) for name, wire in _NUMPY_DTYPES.items()} | {"bfloat16": np.dtype(np.uint16)}


def numpy_dtype(dtype) -> np.dtype | None:
    """``dtype`` as a numpy dtype the collectives reduce, or None."""
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        return None
    return np_dtype if np_dtype in _BY_DTYPE else None


class Flat:
    """A user buffer seen as flat arrays sharing its memory.

    Attributes:
        data: typed view for reductions (uint16 bits for bfloat16).
        wire: same memory as unsigned integers of the element width, for MPI
            (made on first use: the shared-memory steps never need it, and
            on a small message the view costs as much as their copy).
        dtype: the element type's name, e.g. "float32" or "bfloat16".
    """

    __slots__ = ("data", "dtype", "_wire")

    def __init__(self, data: np.ndarray, wire: np.ndarray | None, dtype: str):
        self.data, self._wire, self.dtype = data, wire, dtype

    @property
    def wire(self) -> np.ndarray:
        wire = self._wire
        if wire is None:
            wire = self._wire = self.data.view(_WIRE[self.dtype])
        return wire

    @property
    def count(self) -> int:
        return self.data.size

    @property
    def itemsize(self) -> int:
        return self.data.itemsize

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def slice(self, lo: int, hi: int) -> "Flat":
        """Elements ``[lo, hi)`` as a Flat over the same memory."""
        return Flat(self.data[lo:hi], self.wire[lo:hi], self.dtype)


def _is_torch_tensor(buf) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(buf, torch.Tensor)


_UNALIGNED = ("buffer is not aligned to its element size (a view at an odd byte offset); MPI cannot send it: "
              "pass a copy (np.require(buf, requirements='A'), or t.clone()) and copy the result back")


def as_flat(buf) -> Flat:
    """View ``buf`` as a :class:`Flat` without copying it.

    Args:
        buf: a numpy array or a torch CPU tensor, contiguous and writable.

    Raises:
        TypeError: not a numpy array / torch tensor, or an unsupported dtype.
        ValueError: non-contiguous, read-only, unaligned (np.frombuffer at
            an odd offset: mpi4py maps no MPI type to its memory), sparse,
            or not on the CPU.
    """
    if isinstance(buf, np.ndarray):
        arr = buf if type(buf) is np.ndarray else buf.view(np.ndarray)  # np.matrix stays 2-D when reshaped
        flags = arr.flags
        if not flags.writeable:
            raise ValueError("buffer is read-only: collectives work in place and need a writable array")
        if not flags.aligned:
            raise ValueError(_UNALIGNED)
        if flags.c_contiguous:
            data = arr if arr.ndim == 1 else arr.reshape(-1)
        elif flags.f_contiguous:
            data = arr.ravel(order="K")
        else:
            raise ValueError(
                f"buffer must be contiguous (shape {arr.shape}, strides {arr.strides}); "
                "pass np.ascontiguousarray(buf) and copy the result back"
            )
        name = _BY_DTYPE.get(arr.dtype)
        if name is None:
            raise TypeError(f"unsupported dtype {arr.dtype!s}; supported: {', '.join(DTYPES)} (bfloat16 via torch)")
        return Flat(data, None, name)
    if _is_torch_tensor(buf):
        return _flat_from_torch(buf)
    raise TypeError(f"buffer must be a numpy.ndarray or torch.Tensor, got {type(buf).__name__}")


def _flat_from_torch(t) -> Flat:
    import torch

    if t.layout != torch.strided:
        raise ValueError(f"sparse tensors are not supported (layout {t.layout})")
    if t.device.type != "cpu":
        raise ValueError(
            f"tensor is on {t.device}; hpcjobs collectives take CPU tensors "
            "(copy with .cpu(), reduce, then copy back)"
        )
    if not t.is_contiguous():
        raise ValueError(f"tensor must be contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass "
                         "t.contiguous() and copy the result back (t.copy_(...)): a copy is reduced, not t")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        data = numpy_view(t, _NUMPY_OF["uint16"])
        if not data.flags.aligned:
            raise ValueError(_UNALIGNED)
        return Flat(data, data, "bfloat16")
    name = str(t.dtype).removeprefix("torch.")
    if name not in _NUMPY_DTYPES:
        raise TypeError(f"unsupported dtype {t.dtype}; supported: {', '.join(DTYPES)}")
    data = numpy_view(t, _NUMPY_OF[name])
    if not data.flags.aligned:
        raise ValueError(_UNALIGNED)
    return Flat(data, None, name)


class _Memory:
    """A contiguous CPU tensor's memory as numpy sees it (``__array_interface__``),
    holding the tensor while a view of it lives."""

    __slots__ = ("__array_interface__", "tensor")


def numpy_view(t, dtype) -> np.ndarray:
    """A 1-D numpy view of contiguous CPU tensor ``t``'s memory as numpy
    ``dtype`` (its width). Not ``t.numpy()``: torch marks the storage of a
    tensor it gives numpy as never to be resized again, and a tensor that had
    been through one collective could no longer be ``resize_``d, nor its
    storage freed with ``untyped_storage().resize_(0)`` as sharded training
    does. ValueError (which the agreement says on every rank) where ``t`` has
    no memory of its own to give."""
    torch = sys.modules["torch"]
    if t.is_neg() or t.is_conj():
        raise ValueError("the tensor is a negative or conjugate view, whose memory holds other values; pass "
                         "t.resolve_neg() or t.resolve_conj(), or a plain copy")
    if type(t) is not torch.Tensor:  # (detached, a Parameter is one)
        if getattr(type(t), "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
            raise ValueError(f"the tensor is a {type(t).__name__}, whose memory is not its values (a fake or "
                             "wrapped tensor); pass a plain copy")
        t = t.as_subclass(torch.Tensor)  # a plain subclass: its memory is its values
    try:
        address = t.data_ptr()
    except RuntimeError as e:  # functorch's wrapped tensors (grad, vmap): raised on this rank alone
        raise ValueError(f"the tensor does not give its memory ({e}); pass a plain copy") from None
    if not address and t.numel():  # (a ZeroTensor)
        raise ValueError("the tensor has no memory of its own; pass a plain copy")
    memory = _Memory()
    memory.tensor = t
    memory.__array_interface__ = {"data": (address, False), "shape": (t.numel(),), "version": 3,
                                  "typestr": dtype.str}
    return np.asarray(memory)


def byte_view(t) -> np.ndarray:
    """The memory of contiguous CPU tensor ``t`` as a 1-D uint8 array (no
    copy; :func:`numpy_view`'s, so the storage stays resizable): what a
    broadcast or an all-to-all moves as bytes, whatever ``t``'s dtype."""
    torch = sys.modules["torch"]
    return numpy_view(t.detach().reshape(-1).view(torch.uint8), np.dtype(np.uint8))


def check_op(op: str) -> str:
    """Return ``op`` if it is a supported reduction, else raise ValueError."""
    if not isinstance(op, str) or op not in OPS:  # (MPI.SUM: a name is taken, as on every rank the check compares)
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)} (a name)")
    return op


def torch_view(flat: Flat):
    """The Flat's memory as a torch CPU tensor of its dtype (no copy), for
    libraries that take torch tensors (torch.distributed, Horovod)."""
    import torch

    if flat.dtype == "bfloat16":
        return _bf16(flat.data)
    return torch.from_numpy(flat.data)


def _bf16(bits: np.ndarray):
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def reducer(op: str, dtype: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """Return ``reduce(dst, src)`` computing ``dst = dst op src`` in place.

    ``avg`` reduces as ``sum``; the division by the group size happens once,
    in :func:`finish_avg`, on the rank that owns the reduced chunk.
    """
    if dtype == "bfloat16":
        import torch

        fn = getattr(torch, OP_TABLE[op].torch)

        def reduce_bf16(dst: np.ndarray, src: np.ndarray) -> None:
            d = _bf16(dst)
            fn(d, _bf16(src), out=d)

        return reduce_bf16
    ufunc = OP_TABLE[op].ufunc
    if dtype == "float16" and ufunc is np.add:
        return _float16_add

    def reduce(dst: np.ndarray, src: np.ndarray) -> None:
        ufunc(dst, src, out=dst)

    return reduce


@functools.cache  # looked up once: the float16 paths below run on every collective call
def _optional_torch():
    """torch, or None where it is not installed (it is an optional extra)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _float16_add(dst: np.ndarray, src: np.ndarray) -> None:
    """float16 ``dst += src`` through torch's vectorised CPU kernel.

    numpy has no float16 SIMD: its add converts element by element, 0.9 ms
    per 256 K elements on the CI kind, 18 times torch's. Both round each
    sum once to float16 (a float32 sum of two float16s rounds it exactly as
    float16 arithmetic would), so the result is the same to the bit;
    tests/collectives/test_buffers.py checks it on 4 M random bit patterns.
    Without torch, or for a read-only buffer (torch will not wrap one),
    numpy's add."""
    torch = _optional_torch()
    if torch is None or not src.flags.writeable or not dst.flags.writeable:
        np.add(dst, src, out=dst)
    else:
        torch.from_numpy(dst).add_(torch.from_numpy(src))


def _float16_div(data: np.ndarray, size: int) -> None:
    """float16 ``data /= size`` through torch, for the reason of
    :func:`_float16_add`: numpy divides float16 at 3.5 ns an element on the
    CI kind, 21 times torch. Both divide in float32 and round once to
    float16, and double rounding through float32 is exact for division too,
    so the bits are the same (checked on every float16 and divisors 2 to
    64). Without torch, numpy's divide."""
    torch = _optional_torch()
    if torch is None:  # by a float32 divisor: as float16, 2049 ranks were 2048, and 65520 or more inf
        np.true_divide(data, np.float32(size), out=data, casting="unsafe")
    else:
        torch.from_numpy(data).div_(size)


def finish_avg(data: np.ndarray, dtype: str, size: int) -> None:
    """Divide a summed slice by the group size, in place.

    Floats are divided (correctly rounded in their own precision); integers
    use floor division, as Python's ``//`` does, so every rank gets the same
    integer.
    """
    if size == 1:
        return
    if dtype == "bfloat16":
        b = _bf16(data)
        b.div_(size)
    elif dtype == "float16":
        _float16_div(data, size)
    elif dtype.startswith("float"):
        np.true_divide(data, data.dtype.type(size), out=data)
    elif size <= np.iinfo(data.dtype).max:
        np.floor_divide(data, data.dtype.type(size), out=data)
    else:  # more ranks than the dtype counts to (int8 from 128: numpy refuses the cast): |v| < size
        np.copyto(data, np.where(data < 0, -1, 0), casting="unsafe")


def chunk_bounds(count: int, parts: int) -> list[int]:
    """Split ``count`` elements into ``parts`` nearly equal chunks.

    Returns ``parts + 1`` offsets: chunk ``i`` is ``[b[i], b[i+1])``. The first
    ``count % parts`` chunks hold one element more; with ``count < parts`` the
    trailing chunks are empty.
    """
    q, r = divmod(count, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)


_scratch = _Scratch()


def scratch(count: int, dtype) -> np.ndarray:
    """A reusable per-thread work array of ``count`` elements of ``dtype``.

    Reused across calls so a 64 MB allreduce does not page-fault a fresh
    temporary every time; the contents are garbage. Callers must not hold it
    across another collective call on the same thread.
    """
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    if _scratch.buf.nbytes < nbytes:
        _scratch.buf = np.empty(nbytes, dtype=np.uint8)
    return _scratch.buf[:nbytes].view(dtype)
