"""The collectives behind the ``hvd`` calls, as the controller runs them
(:mod:`~hpcjobs.horovod._controller`) on a process set's communicator,
and the checks and descriptions each call submits with its request.

What every rank must agree on (:func:`describe`: shapes -- for allgather
and alltoall the dimensions after the first -- dtypes, devices; and the
op, scale factors, root) is compared by the controller's coordinator
before any data moves; a mismatch fails every rank, naming the ranks and
their values, as Horovod does. Then the data:

- ``allreduce``: hpcjobs' :func:`~hpcjobs.collectives.allreduce` (``auto``
  chooses the algorithm; CUDA tensors reduce on the device) once per
  dtype and device, the tensors (of one request, or fused from several)
  in one buffer;
- ``allgather``: :func:`~hpcjobs.collectives.ring_allgatherv` of each
  tensor's bytes, its first dimension travelling with them;
- ``reducescatter``: :func:`~hpcjobs.collectives.ring_reduce_scatter` on a
  buffer laid out so that the ring's P equal chunks are the ranks' blocks
  of rows, each padded to the largest (Horovod's split: the first
  ``rows % P`` ranks get one row more);
- ``broadcast``, ``alltoall`` and the object collectives: MPI's own
  (``Bcast`` of each tensor's bytes, ``Alltoall`` of the splits then
  ``Alltoallv`` of the rows, ...).

Horovod's arithmetic: scale by ``prescale``, reduce, scale by
``postscale``. Average of floats is our ``avg`` (a sum, then one division
by P on the rank that owns each chunk); Average of integers is the sum
scaled by ``postscale / P`` in double precision and truncated toward zero,
as Horovod's C++ ``ScaleBuffer`` does. A rank that has joined
(``hvd.join``) reduces zeros of the agreed shapes (:func:`zeros`). The
byte-moving collectives copy CUDA tensors to the host and back.
"""

from __future__ import annotations

import functools
import inspect
import math
import pickle

import numpy as np
import torch
from mpi4py import MPI

from ..collectives import allreduce as allreduce_, chunk_bounds, ring_allgatherv, ring_reduce_scatter
from ..collectives._buffers import byte_view
from ..collectives.agreement import raise_if_any
from ..collectives.watchdog import guard
from ._state import OPS, Average

__all__ = ["allreduce", "allgather", "broadcast", "alltoall", "alltoall_counts", "reducescatter",
           "broadcast_object", "allgather_object", "scale", "describe", "dense", "spec", "zeros"]


def _watched(fn):
    """Run ``fn`` under the stall watchdog as ``hvd.<name>``, on its ``comm``
    (the process set's communicator)."""
    what = f"hvd.{fn.__name__}"
    at = list(inspect.signature(fn).parameters).index("comm")

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        with guard(what, args[at] if len(args) > at else kwargs.get("comm")):
            return fn(*args, **kwargs)

    return watched


def describe(tensors, shapes: bool = True) -> dict:
    return {"shapes" if shapes else "shapes after dim 0":
            ";".join(str(tuple(t.shape if shapes else t.shape[1:])) for t in tensors),
            "dtypes": ",".join(str(t.dtype) for t in tensors),
            "devices": ",".join(t.device.type for t in tensors)}


def dense(tensors, contiguous: bool = False, min_dim: int = 0) -> None:
    for t in tensors:
        if t.layout != torch.strided:
            raise ValueError(f"sparse tensors are not supported (layout {t.layout})")
        if contiguous and not t.is_contiguous():
            raise ValueError("Tensor is required to be contiguous.")
        if t.dim() < min_dim:
            raise ValueError(f"tensor of shape {tuple(t.shape)}: this collective splits or joins along the "
                             "first dimension and needs at least one")


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


def spec(tensors) -> list:
    """Each tensor's ``(shape, dtype)``: what a joined rank's zeros need."""
    return [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]


def zeros(specs: list, devices: str, join_device: int) -> list:
    """Zeros for a joined rank: ``specs`` as :func:`spec` gives them, on the
    GPU ``join(device)`` named where the others' tensors are on GPUs."""
    on_gpu = "cuda" in devices and join_device >= 0
    device = torch.device("cuda", join_device) if on_gpu else torch.device("cpu")
    return [torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in specs]


@_watched
def allreduce(tensors: list, op: int, prescale: float, postscale: float, comm: MPI.Intracomm) -> None:
    """Reduce ``tensors`` (contiguous) over the ranks of ``comm``, in place."""
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
def allgather(tensors: list, comm: MPI.Intracomm) -> tuple[list, np.ndarray]:
    """Each tensor's rows from every rank, in rank order.

    Returns:
        ``(outputs, dims)``: the gathered tensors, and ``dims[q, i]``, the
        first dimension of rank q's tensor i.
    """
    host = [t.detach().contiguous().cpu() for t in tensors]
    dims = np.array([t.shape[0] for t in tensors], dtype=np.int64)
    rows = ring_allgatherv([dims, *(byte_view(h) for h in host)], comm)
    dims = np.stack([row[0] for row in rows])
    outputs = [_tensor(np.concatenate([row[i + 1] for row in rows]), t, int(dims[:, i].sum()))
               for i, t in enumerate(tensors)]
    return outputs, dims


@_watched
def broadcast(tensors: list, root: int, comm: MPI.Intracomm) -> None:
    """Overwrite ``tensors`` (contiguous) with those of ``root`` (a rank of
    ``comm``), in place: an ``MPI_Bcast`` of each one's bytes."""
    for t in tensors:
        t = t.detach()
        host = t if t.device.type == "cpu" else t.cpu()
        comm.Bcast(byte_view(host), root=root)
        if host is not t:
            t.copy_(host)


def alltoall_counts(tensor: torch.Tensor, splits, size: int) -> np.ndarray:
    """The rows to send to each of ``size`` ranks (``splits`` None: equal
    parts), checked as Horovod checks them.

    Raises:
        ValueError: Horovod's messages, or splits that do not fit the tensor.
    """
    dense([tensor], min_dim=1)
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            raise ValueError("splits not provided, but first dimension of tensor is not an even multiple "
                             "of the number of workers.")
        return np.full(size, rows // size, dtype=np.int64)
    given = np.asarray(splits, dtype=np.int64).reshape(-1)
    if given.size != size:
        raise ValueError("Number of entries in splits does not equal number of workers.")
    if (given < 0).any() or given.sum() > rows:
        raise ValueError(f"splits {given.tolist()} must be non-negative and add up to at most the first "
                         f"dimension of the tensor ({rows})")
    return given


@_watched
def alltoall(tensor: torch.Tensor, send: np.ndarray, comm: MPI.Intracomm) -> tuple[torch.Tensor, np.ndarray]:
    """Send rows ``send[q]`` (consecutive, from the first row) to rank q.

    Returns:
        ``(rows received, in rank order; how many from each rank)``.
    """
    size = comm.Get_size()
    received = np.empty(size, dtype=np.int64)
    comm.Alltoall(send, received)
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    out = np.empty(int(received.sum()) * row_bytes, dtype=np.uint8)
    comm.Alltoallv([byte_view(tensor.detach().contiguous().cpu()), _counts(send * row_bytes), MPI.BYTE],
                   [out, _counts(received * row_bytes), MPI.BYTE])
    return _tensor(out, tensor, int(received.sum())), received


def _counts(nbytes: np.ndarray) -> tuple[list, list]:
    """(counts, displacements) of consecutive blocks, for ``Alltoallv``."""
    return nbytes.tolist(), np.concatenate([[0], np.cumsum(nbytes)[:-1]]).tolist()


@_watched
def reducescatter(tensors: list, op: int, prescale: float, postscale: float, comm: MPI.Intracomm) -> list:
    """This rank's block of rows of each tensor's reduction: rows
    ``chunk_bounds(rows, P)[rank:rank + 2]``."""
    size, rank = comm.Get_size(), comm.Get_rank()
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
def broadcast_object(obj, root: int, comm: MPI.Intracomm):
    """Rank ``root``'s ``obj`` on every rank of ``comm`` (root keeps its
    own), pickled as Horovod does (:func:`_dumps`). An object root cannot
    pickle, or one a rank cannot load, raises on every rank: root raising
    alone left the others waiting in the broadcast."""
    rank, payload, error = comm.Get_rank(), None, None
    if rank == root:
        try:
            payload = _dumps(obj)
        except Exception as e:  # noqa: BLE001 -- every rank raises it, below
            error = f"{type(e).__name__}: {e}"
    payload, error = comm.bcast((payload, error), root=root)
    if error:
        raise TypeError(f"broadcast_object: rank {root}'s object does not pickle ({error})")
    loaded, error = _loads(payload) if rank != root else (obj, None)
    raise_if_any(comm, error, "broadcast_object: the object does not load", TypeError)
    return loaded


@_watched
def allgather_object(obj, comm: MPI.Intracomm) -> list:
    """Every rank's ``obj``, in rank order, pickled as :func:`broadcast_object`
    pickles; an object some rank cannot pickle or load raises on every rank."""
    try:
        mine = (_dumps(obj), None)
    except Exception as e:  # noqa: BLE001 -- every rank raises it, below
        mine = (None, f"{type(e).__name__}: {e}")
    gathered = comm.allgather(mine)
    errors = [f"rank {r} ({e})" for r, (_, e) in enumerate(gathered) if e]
    if errors:
        raise TypeError("allgather_object: the object does not pickle on " + "; ".join(errors))
    objects, error = [], None
    for payload, _ in gathered:
        loaded, error = _loads(payload)
        if error:
            break
        objects.append(loaded)
    raise_if_any(comm, error, "allgather_object: an object does not load", TypeError)
    return objects


def _dumps(obj) -> bytes:
    """``obj`` pickled with cloudpickle where it is installed (Horovod's:
    lambdas, local classes), else with pickle."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def _loads(payload: bytes) -> tuple:
    """(the object, None), or (None, why it does not load)."""
    try:
        return pickle.loads(payload), None
    except Exception as e:  # noqa: BLE001 -- every rank raises it (raise_if_any)
        return None, f"{type(e).__name__}: {e}"

