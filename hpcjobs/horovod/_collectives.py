"""The collectives behind the ``hvd`` calls, as they run on the worker
thread (:mod:`~hpcjobs.horovod._handles`), on the ``hvd`` communicator.

Each first agrees with the other ranks on what it was asked to do
(:func:`~hpcjobs.collectives.agreement.agree_or_raise`): name, shapes (for
allgather and alltoall the dimensions after the first), dtypes, devices,
op, scale factors, root. Horovod checks the same and fails every rank on a
mismatch; so do we, with a MismatchError naming the ranks and their values,
before any data moves. A local error (a 0-d tensor to allgather, splits
that do not add up) travels in the same exchange, so every rank raises it.
Then the data:

- ``allreduce``: hpcjobs' :func:`~hpcjobs.collectives.allreduce` (``auto``
  chooses the algorithm; CUDA tensors reduce on the device) once per
  dtype and device, the group's tensors fused into one buffer;
- ``allgather``: :func:`~hpcjobs.collectives.ring_allgatherv` of each
  tensor's bytes, its first dimension travelling with them;
- ``reducescatter``: :func:`~hpcjobs.collectives.ring_reduce_scatter` on a
  buffer laid out so that the ring's P equal chunks are the ranks' blocks
  of rows, each padded to the largest (Horovod's split: the first
  ``rows % P`` ranks get one row more);
- ``broadcast``, ``alltoall``, ``barrier``, ``join`` and the object
  collectives: MPI's own (``Bcast`` of each tensor's bytes, ``Alltoall`` of
  the splits then ``Alltoallv`` of the rows, ...).

Horovod's arithmetic: scale by ``prescale``, reduce, scale by
``postscale``. Average of floats is our ``avg`` (a sum, then one division
by P on the rank that owns each chunk); Average of integers is the sum
scaled by ``postscale / P`` in double precision and truncated toward zero,
as Horovod's C++ ``ScaleBuffer`` does. The byte-moving collectives copy
CUDA tensors to the host and back.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from mpi4py import MPI

from ..collectives import allreduce as allreduce_, chunk_bounds, ring_allgatherv, ring_reduce_scatter
from ..collectives.agreement import agree_or_raise
from ..collectives.watchdog import guard
from ._state import OPS, Average

__all__ = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join",
           "broadcast_object", "allgather_object", "scale"]


def _watched(fn):
    """Run ``fn`` under the stall watchdog as ``hvd.<name>``."""
    what = f"hvd.{fn.__name__}"

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        with guard(what):
            return fn(*args, **kwargs)

    return watched


def _agree(comm: MPI.Intracomm, what: str, fields: dict, check=None) -> None:
    """Every rank has the same ``fields`` and ``check()`` raised nowhere, or
    MismatchError on every rank."""
    error = None
    if check is not None:
        try:
            check()
        except (TypeError, ValueError) as e:
            error = e
    agree_or_raise(comm, what, fields, error)


def _describe(tensors, shapes: bool = True) -> dict:
    return {"shapes" if shapes else "shapes after dim 0":
            ";".join(str(tuple(t.shape if shapes else t.shape[1:])) for t in tensors),
            "dtypes": ",".join(str(t.dtype) for t in tensors),
            "devices": ",".join(t.device.type for t in tensors)}


def _dense(tensors, contiguous: bool = False, min_dim: int = 0) -> None:
    for t in tensors:
        if t.layout != torch.strided:
            raise ValueError(f"sparse tensors are not supported (layout {t.layout})")
        if contiguous and not t.is_contiguous():
            raise ValueError("Tensor is required to be contiguous.")
        if t.dim() < min_dim:
            raise ValueError(f"tensor of shape {tuple(t.shape)}: this collective splits or joins along the "
                             "first dimension and needs at least one")


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The memory of the contiguous CPU tensor ``t`` as uint8 (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _tensor(raw: np.ndarray, like: torch.Tensor, rows: int) -> torch.Tensor:
    """Bytes back into a tensor of ``like``'s dtype, device and trailing
    dimensions, with ``rows`` rows."""
    out = torch.from_numpy(raw).view(like.dtype).reshape(rows, *like.shape[1:])
    return out.to(like.device)


def scale(t: torch.Tensor, factor: float) -> None:
    """``t *= factor`` in place; integers in double precision, truncated
    back (Horovod's pre- and postscale)."""
    if factor == 1.0:
        return
    if t.is_floating_point():
        t.mul_(factor)
    else:
        t.copy_(t.to(torch.float64).mul_(factor))


def _reduction(op: int, t: torch.Tensor, postscale: float, size: int) -> tuple[str, float]:
    """Our op for Horovod's ``op`` on ``t``, and the postscale to apply after it."""
    if op == Average and not t.is_floating_point():
        return "sum", postscale / size
    return OPS[op], postscale


@_watched
def allreduce(tensors: list, op: int, prescale: float, postscale: float, name, comm: MPI.Intracomm) -> None:
    """Reduce ``tensors`` (contiguous) over the ranks, in place."""
    _agree(comm, "hvd.allreduce", {"name": name, **_describe(tensors), "op": op, "prescale": repr(prescale),
                                   "postscale": repr(postscale)}, lambda: _dense(tensors, contiguous=True))
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t.detach())
    for group in groups.values():
        flat = group[0].view(-1) if len(group) == 1 else torch.cat([t.reshape(-1) for t in group])
        ours, post = _reduction(op, flat, postscale, comm.Get_size())
        scale(flat, prescale)
        allreduce_(flat, op=ours, comm=comm)
        scale(flat, post)
        if len(group) > 1:
            for t, piece in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(piece.view_as(t))


@_watched
def allgather(tensors: list, name, comm: MPI.Intracomm) -> tuple[list, np.ndarray]:
    """Each tensor's rows from every rank, in rank order.

    Returns:
        ``(outputs, dims)``: the gathered tensors, and ``dims[q, i]``, the
        first dimension of rank q's tensor i.
    """
    _agree(comm, "hvd.allgather", {"name": name, **_describe(tensors, shapes=False)},
           lambda: _dense(tensors, min_dim=1))
    host = [t.detach().contiguous().cpu() for t in tensors]
    dims = np.array([t.shape[0] for t in tensors], dtype=np.int64)
    rows = ring_allgatherv([dims, *(_bytes(h) for h in host)], comm)
    dims = np.stack([row[0] for row in rows])
    outputs = [_tensor(np.concatenate([row[i + 1] for row in rows]), t, int(dims[:, i].sum()))
               for i, t in enumerate(tensors)]
    return outputs, dims


@_watched
def broadcast(tensors: list, root: int, name, comm: MPI.Intracomm) -> None:
    """Overwrite ``tensors`` (contiguous) with rank ``root``'s, in place: one
    agreement on them all, then an ``MPI_Bcast`` of each one's bytes."""
    size = comm.Get_size()

    def check():
        if not 0 <= root < size:
            raise ValueError(f"root_rank {root} is not one of the {size} ranks")
        _dense(tensors, contiguous=True)

    _agree(comm, "hvd.broadcast", {"name": name, "root": root, **_describe(tensors)}, check)
    for t in tensors:
        t = t.detach()
        host = t if t.device.type == "cpu" else t.cpu()
        comm.Bcast(_bytes(host), root=root)
        if host is not t:
            t.copy_(host)


@_watched
def alltoall(tensor: torch.Tensor, splits, name, comm: MPI.Intracomm) -> tuple[torch.Tensor, np.ndarray]:
    """Send rows ``splits[q]`` (consecutive, from the first row) to rank q;
    ``splits`` None splits the first dimension evenly.

    Returns:
        ``(rows received, in rank order; how many from each rank)``.
    """
    size = comm.Get_size()
    send = np.zeros(size, dtype=np.int64)

    def check():
        _dense([tensor], min_dim=1)
        rows = tensor.shape[0]
        if splits is None:
            if rows % size:
                raise ValueError("splits not provided, but first dimension of tensor is not an even multiple "
                                 "of the number of workers.")
            send[:] = rows // size
            return
        given = np.asarray(splits, dtype=np.int64).reshape(-1)
        if given.size != size:
            raise ValueError("Number of entries in splits does not equal number of workers.")
        if (given < 0).any() or given.sum() > rows:
            raise ValueError(f"splits {given.tolist()} must be non-negative and add up to at most the first "
                             f"dimension of the tensor ({rows})")
        send[:] = given

    _agree(comm, "hvd.alltoall", {"name": name, **_describe([tensor], shapes=False)}, check)
    received = np.empty(size, dtype=np.int64)
    comm.Alltoall(send, received)
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    out = np.empty(int(received.sum()) * row_bytes, dtype=np.uint8)
    comm.Alltoallv([_bytes(tensor.detach().contiguous().cpu()), _counts(send * row_bytes), MPI.BYTE],
                   [out, _counts(received * row_bytes), MPI.BYTE])
    return _tensor(out, tensor, int(received.sum())), received


def _counts(nbytes: np.ndarray) -> tuple[list, list]:
    """(counts, displacements) of consecutive blocks, for ``Alltoallv``."""
    return nbytes.tolist(), np.concatenate([[0], np.cumsum(nbytes)[:-1]]).tolist()


@_watched
def reducescatter(tensors: list, op: int, prescale: float, postscale: float, name,
                  comm: MPI.Intracomm) -> list:
    """This rank's block of rows of each tensor's reduction: rows
    ``chunk_bounds(rows, P)[rank:rank + 2]``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    _agree(comm, "hvd.reducescatter", {"name": name, **_describe(tensors), "op": op, "prescale": repr(prescale),
                                       "postscale": repr(postscale)}, lambda: _dense(tensors, min_dim=1))
    outputs = []
    for t in tensors:
        t = t.detach()
        bounds, row = chunk_bounds(t.shape[0], size), math.prod(t.shape[1:])
        block = (bounds[1] - bounds[0]) * row  # the largest block: the ring's chunk
        buf = t.new_zeros(size * block)
        for q in range(size):
            buf[q * block:q * block + (bounds[q + 1] - bounds[q]) * row] = t[bounds[q]:bounds[q + 1]].reshape(-1)
        ours, post = _reduction(op, buf, postscale, size)
        scale(buf, prescale)
        ring_reduce_scatter(buf, op=ours, comm=comm)
        mine = bounds[rank + 1] - bounds[rank]
        out = buf[rank * block:rank * block + mine * row].view(mine, *t.shape[1:]).clone()
        scale(out, post)
        outputs.append(out)
    return outputs


@_watched
def barrier(comm: MPI.Intracomm) -> None:
    comm.Barrier()


@_watched
def join(arrived: float, comm: MPI.Intracomm) -> int:
    """The rank with the latest ``arrived`` time (the highest such rank on a tie)."""
    times = np.empty(comm.Get_size(), dtype=np.float64)
    comm.Allgather(np.array([arrived], dtype=np.float64), times)
    return int(np.flatnonzero(times == times.max())[-1])


@_watched
def broadcast_object(obj, root: int, name, comm: MPI.Intracomm):
    """Rank ``root``'s ``obj`` (pickled) on every rank."""
    size = comm.Get_size()

    def check():
        if not 0 <= root < size:
            raise ValueError(f"root_rank {root} is not one of the {size} ranks")

    _agree(comm, "hvd.broadcast_object", {"name": name, "root": root}, check)
    return comm.bcast(obj, root=root)


@_watched
def allgather_object(obj, name, comm: MPI.Intracomm) -> list:
    """Every rank's ``obj`` (pickled), in rank order."""
    _agree(comm, "hvd.allgather_object", {"name": name})
    return comm.allgather(obj)
