"""Give every rank the same starting point: rank ``root_rank``'s parameters,
buffers and optimizer state, sent with buffer ``MPI_Bcast``."""

from __future__ import annotations

import io

import numpy as np
import torch
from mpi4py import MPI

from ..collectives._buffers import byte_view
from ..collectives.agreement import raise_if_any
from ..comm import agree, private, signature
from .distributed import DistributedOptimizer

__all__ = ["broadcast_parameters", "broadcast_optimizer_state"]


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if not t.is_contiguous():
        raise ValueError("broadcast needs contiguous tensors")
    return byte_view(t)  # not t.numpy(), which marks the storage as never to be resized


def broadcast_parameters(params, root_rank: int = 0, comm: MPI.Comm | None = None) -> None:
    """Overwrite every tensor in ``params`` with root's, in place.

    Args:
        params: ``model.state_dict()`` (parameters and buffers),
            ``model.named_parameters()``, or an iterable of tensors -- the same
            tensors in the same order on every rank.
        root_rank: whose values win.
        comm: None for COMM_WORLD.
    """
    comm = private(comm)
    if not 0 <= root_rank < comm.Get_size():
        raise ValueError(f"root_rank {root_rank} not in [0, {comm.Get_size()})")
    items = params.items() if isinstance(params, dict) else params
    tensors = [t[1] if isinstance(t, tuple) else t for t in items]
    if not agree(signature([len(tensors), ";".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors)]), comm).all():
        counts = comm.allgather(len(tensors))
        raise ValueError(f"broadcast_parameters: ranks hold different tensors (counts per rank {counts}, "
                         "or different shapes/dtypes)")
    with torch.no_grad():
        for t in tensors:
            data = t.data if isinstance(t, torch.nn.Parameter) else t
            if data.device.type == "cpu":
                comm.Bcast(_as_numpy(data), root=root_rank)
            else:  # a model already on its GPU: through host memory (numpy() refused it on every rank)
                host = data.cpu()
                comm.Bcast(_as_numpy(host), root=root_rank)
                data.copy_(host)


# numpy scalars in an optimizer's settings (a rate from np.linspace): allowed besides weights_only's own types
_NUMPY_SCALARS = [getattr(np, "_core", getattr(np, "core", None)).multiarray.scalar, np.dtype,
                  *(type(np.dtype(t)) for t in (np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_))]


def broadcast_optimizer_state(optimizer, root_rank: int = 0, comm: MPI.Comm | None = None) -> None:
    """Give every rank root's optimizer state (momentum buffers, Adam
    moments, step counts, hyper-parameters).

    The state dict is serialised with ``torch.save`` on root, sent as bytes
    (buffer ``Bcast``) and loaded with ``weights_only=True`` (numpy scalars
    allowed too). A state root cannot save, or one a rank cannot load,
    raises on every rank.
    """
    comm = private(comm)
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    rank, n, error = comm.Get_rank(), 0, None
    if rank == root_rank:
        try:
            raw = io.BytesIO()
            torch.save(inner.state_dict(), raw)
            payload = np.frombuffer(raw.getbuffer(), dtype=np.uint8).copy()
            n = payload.size
        except Exception as e:  # noqa: BLE001 -- every rank raises it: root alone left the others waiting
            error = f"{type(e).__name__}: {e}"
    n, error = comm.bcast((n, error), root=root_rank)
    if error:
        raise RuntimeError(f"broadcast_optimizer_state: rank {root_rank}'s state does not save ({error})")
    if rank != root_rank:
        payload = np.empty(n, dtype=np.uint8)
    comm.Bcast(payload, root=root_rank)
    if rank != root_rank:
        try:
            with torch.serialization.safe_globals(_NUMPY_SCALARS):  # a rate given as np.float64, say
                _load_in_place(inner, torch.load(io.BytesIO(payload.tobytes()), weights_only=True))
        except Exception as e:  # noqa: BLE001 -- as above: root would go on alone into its next collective
            error = f"{type(e).__name__}: {e}"
    raise_if_any(comm, error, f"broadcast_optimizer_state: rank {root_rank}'s state does not load")


def _load_in_place(inner, state_dict: dict) -> None:
    """``inner.load_state_dict(state_dict)``, its values put into the
    optimizer's own ``param_groups`` dicts and ``state`` (torch's installs
    new ones, as Horovod's broadcast does not): a learning-rate scheduler
    made before holds the old groups, and on every rank but root went on
    setting a rate that no step read (StepLR's halving on root alone)."""
    groups, state = inner.param_groups, inner.state
    inner.load_state_dict(state_dict)
    for old, new in zip(groups, inner.param_groups):
        old.update({k: v for k, v in new.items() if k != "params"})
    if inner.state is not state:  # (a subclass's own load may fill it in place)
        state.clear()
        state.update(inner.state)
    inner.param_groups, inner.state = groups, state

