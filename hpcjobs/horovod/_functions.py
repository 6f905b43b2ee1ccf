"""Horovod's helpers (``horovod/torch/functions.py``): start every rank
from the same model and optimizer, and move Python objects.

- ``broadcast_parameters(params, root_rank)``: every tensor in one grouped
  broadcast (:func:`~hpcjobs.horovod._ops.submit_broadcast`: one agreement
  on all the shapes, then an ``MPI_Bcast`` per tensor), in place; CPU or
  CUDA tensors. A dict (``model.state_dict()``) goes in sorted name order,
  as Horovod's does; lists of tensors or of ``(name, tensor)`` pairs, and
  the generators ``model.parameters()`` and ``model.named_parameters()``,
  in their order.
- ``broadcast_optimizer_state(optimizer, root_rank)``: root's
  ``state_dict()`` -- state tensors, step counts and hyper-parameters such
  as the learning rate -- loaded on every other rank, with
  :func:`hpcjobs.training.broadcast_optimizer_state`. Any optimizer (L-BFGS
  too, which Horovod refuses), an ``hvd.DistributedOptimizer``, or an
  :class:`hpcjobs.training.DistributedOptimizer`. Like Horovod, an
  optimizer with no state yet first takes one local step on zero gradients
  to create it (momentum buffers, Adam's moments): with weight decay that
  step moves the parameters, and a script gets Horovod's numbers only if
  it happens here too.
- ``broadcast_object`` / ``allgather_object``: pickled with ``cloudpickle``
  where it is installed (the ``torch`` extra brings it), as Horovod does:
  lambdas and local classes travel; else with ``pickle``.

Each is one request to the controller (:mod:`~hpcjobs.horovod._controller`),
matched across ranks by name like every other call: an unnamed object
collective is named after the object's type, as in Horovod.
"""

from __future__ import annotations

import torch

from . import _collectives as C
from ._handles import run, synchronize
from ._ops import set_rank, submit_broadcast
from ._process_sets import resolve
from ._state import global_process_set, world

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite every tensor in ``params`` with root's, in place (module
    docstring); the same tensors, in the same order, on every rank."""
    items = sorted(params.items()) if isinstance(params, dict) else params
    tensors = [p[1] if isinstance(p, tuple) else p for p in items]
    if tensors:
        synchronize(submit_broadcast(tensors, root_rank, None))


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Load root's optimizer state on every rank (module docstring).
    ``model`` is accepted for Horovod's signature; sparse parameters need no
    special care here."""
    from ..training.broadcast import broadcast_optimizer_state as broadcast_state

    w = world()
    if not 0 <= root_rank < w.size:
        raise ValueError(f"root_rank {root_rank} is not one of the {w.size} ranks")
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer)
    run("broadcast_optimizer_state", None, lambda: broadcast_state(optimizer, root_rank, comm=w.ops),
        meta={"root": root_rank})


def _initialize_state(optimizer) -> None:
    """Horovod's state initialization: every gradient set to zeros (sparse
    ones for ``SparseAdam``, which takes no other), and one step of the
    wrapped optimizer alone (no reduction, so no rank waits on another).
    Zeros everywhere, as Horovod does: a gradient left from a backward would
    step each rank by its own, and the ranks would part."""
    from ..training.distributed import DistributedOptimizer as Engine
    from ._optimizer import _DistributedOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, Engine) else optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(inner, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    if isinstance(inner, _DistributedOptimizer):
        super(_DistributedOptimizer, inner).step()
    else:
        inner.step()


def broadcast_object(obj, root_rank: int = 0, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` on every rank of the set (pickled).
    Unnamed, it is the n-th unnamed broadcast_object (Horovod names it by the
    object's type, so ``broadcast_object(cfg if rank == 0 else None)`` waited
    for good there, and here until the watchdog)."""
    comm, ranks = resolve(process_set)[1:]
    root = [None]

    def check():
        root[0] = set_rank(process_set, root_rank)

    return run("broadcast_object", name,
               lambda: C.broadcast_object(obj, root[0], comm), process_set=process_set, meta={"root": root_rank},
               check=check)


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's ``obj`` (pickled), as a list in rank order (unnamed: the
    n-th unnamed one, as :func:`broadcast_object`; objects of other types on
    other ranks are gathered)."""
    comm = resolve(process_set)[1]
    return run("allgather_object", name,
               lambda: C.allgather_object(obj, comm), process_set=process_set)
