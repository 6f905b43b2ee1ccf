"""``hvd.DistributedOptimizer``: Horovod's optimizer wrapper, reducing
gradients with :class:`hpcjobs.training.DistributedOptimizer`.

What it returns. Horovod builds, at run time, a subclass of the wrapped
optimizer's class, so that scripts go on treating the result as that
optimizer: ``isinstance(opt, torch.optim.SGD)``, learning-rate schedulers
(which insist on a ``torch.optim.Optimizer``), ``opt.param_groups``,
``opt.state_dict()``. So do we: the class is
``type(name, (_DistributedOptimizer, optimizer.__class__), {})`` and the
object starts with the wrapped optimizer's attributes -- the same
``param_groups`` and ``state`` objects, so a change made through either
shows in both (what shadows a method on the original, such as a scheduler's
``step`` wrapper, stays behind). Its ``step()`` reduces the gradients, then
runs the original class's ``step``.

How the gradients are reduced:

- parameters on the CPU: :class:`hpcjobs.training.DistributedOptimizer`
  (buckets of ``HOROVOD_FUSION_THRESHOLD`` bytes as in Horovod, 1 MiB
  unless set where Horovod's default is 64 MiB; reduced during backward on its
  communication thread, compressed as ``compression`` says). A step
  starts with a count of the ranks stepping through the controller
  (:meth:`_EngineReducer._stepping`): where some rank is in ``hvd.join()``
  the buckets are ``hvd`` allreduces, to which it adds zeros (hpcjobs'
  compressors with residuals refuse); else they go on the engine's
  communicator (docs/doors.md). It averages;
  Horovod's ``op`` and ``gradient_predivide_factor`` become scale factors
  around the average: Average with factor f is x1/f before and xf after
  (Horovod's split), Sum is the average times P (the sum, up to rounding).
  Its thread needs ``MPI_THREAD_MULTIPLE`` here (the ``hvd`` worker may be
  in a collective at the same time); with less it reduces in ``step()``;
- parameters on a GPU, which that class does not take: ``synchronize()``
  reduces every gradient with ``hvd.grouped_allreduce_`` (one fused
  allreduce per dtype, on the device), after backward rather than during
  it; compression: ``Compression.none``, ``fp16``, ``bf16`` or a user's
  Horovod-style class;
- one rank: nothing is reduced or compressed, as in Horovod.

The rest is Horovod's: ``synchronize()``, ``skip_synchronize()`` (call
``synchronize()``, change the gradients -- clip them, say -- then ``step()``
inside the context), ``zero_grad()`` refused between backward and the
reduction, ``set_backward_passes_per_step``, and default names
``allreduce.noname.<group>.<index>``. ``groups`` and ``num_groups`` are
checked as Horovod checks them and otherwise unused: hpcjobs fuses the
gradients into buckets by size (:mod:`hpcjobs.training.buckets`), not by
groups. Sparse gradients (``nn.Embedding(sparse=True)``): with
``sparse_as_dense=True`` a sparse gradient is reduced dense with the
others and turns sparse again for the update, as in Horovod; without it, it is reduced as Horovod reduces it,
by allgathering its indices and values (``hvd.sparse_allreduce_async``) in
``synchronize()``, and stays sparse (``SparseAdam`` takes it); the dense
reducer's bucket carries zeros in its slot. ``process_set=``: the
gradients are reduced among the set's ranks only; on a rank outside the
set the optimizer reduces nothing, as Horovod's. ``_parameter_names``
maps each parameter to its name, as Horovod's does. Refused: ``op``
Adasum, Min, Max or Product.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
from mpi4py import MPI

from ..comm import private
from ..training.config import DEFAULT_FUSION_BYTES
from ..training.distributed import DistributedOptimizer as _Engine
from ._allreduce import allreduce_, grouped_allreduce_
from ._collectives import scale
from ._compression import Compression, _Ours, engine_compressor
from ._controller import fusion_threshold as _fusion_threshold
from ._process_sets import engine_of, ranks_of, resolve
from ._sparse import sparse_allreduce_async
from ._state import Average, Sum, global_process_set, reduce_op, world

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer:
    """Placed before the wrapped optimizer's class (module docstring)."""

    def synchronize(self) -> None:
        """Reduce the gradients now and leave the result in ``.grad``."""
        reducer, sparse = self._hvd_reducer, {}
        if reducer is not None:
            reducer.synchronize()
            sparse = dict(reducer.sparse)
            reducer.sparse.clear()
        handles = [(p, sparse_allreduce_async(g, f"sparse.{self._parameter_names[p]}", self.op, self.process_set))
                   for p, g in sparse.items()]
        for p, handle in handles:
            p.grad = handle()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside the context does not reduce (after ``synchronize()``)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure=None):
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._hvd_reducer is not None and self._hvd_reducer.pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                                 "cause a race condition.")
        return super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict):
        self._hvd_synchronized = False
        return super().load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        if self._hvd_reducer is not None:
            self._hvd_reducer.backward_passes_per_step = passes


def fusion_threshold() -> int:
    """The bucket size: ``HOROVOD_FUSION_THRESHOLD`` (bytes) as Horovod
    reads it, else hpcjobs' default (1 MiB; Horovod's is 64 MiB); 0 turns
    fusion off, as in Horovod: a bucket per tensor."""
    return max(_fusion_threshold(DEFAULT_FUSION_BYTES), 1)


class _EngineReducer(_Engine):
    """hpcjobs' optimizer as a gradient reducer, with scale factors around
    each bucket's average (its ``step`` is never called)."""

    def __init__(self, optimizer, named, comm, compression, backward_passes_per_step, prescale, postscale,
                 sparse_as_dense, process_set, hvd_compression=Compression.none):
        self.prescale, self.postscale, self.sparse_as_dense = prescale, postscale, sparse_as_dense
        self.hvd_compression = hvd_compression  # as the user gave it: Horovod's compress/decompress
        self.process_set, self._members, self._by_controller = process_set, len(resolve(process_set)[2]), False
        self.held: dict = {}  # parameter -> its sparse gradient, since the last synchronize
        self.sparse: dict = {}  # parameter -> a sparse gradient the door reduces (module docstring)
        multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE  # (agreed: "auto" and "none" meet other collectives)
        overlap = "auto" if private(comm if comm is not None else MPI.COMM_WORLD).allreduce(multiple, op=MPI.LAND) \
            else "none"
        super().__init__(optimizer, named, comm=comm, compression=compression,
                         backward_passes_per_step=backward_passes_per_step, overlap=overlap,
                         fusion_bytes=fusion_threshold())

    def _exchange(self, bucket) -> None:
        if bucket is self._buckets[0]:  # a step's first: who is stepping?
            self._by_controller = self._stepping() < self._members
        if not self._by_controller:
            scale(bucket.buffer, self.prescale)
            super()._exchange(bucket)
            scale(bucket.buffer, self.postscale)
            return
        # A rank is in hvd.join(): compressed as Horovod compresses (none, fp16, bf16, a user's class) and reduced
        # through the controller as Horovod's allreduces are, the joined rank adding zeros of the bucket's shape
        # (on the engine's communicator the others waited for it). hpcjobs' own compressors keep residuals: refused.
        if isinstance(self.hvd_compression, _Ours):
            raise RuntimeError(f"hvd.join(): a rank has joined while the others step, and compression "
                               f"{self.hvd_compression.spec!r} cannot reduce with its zeros (it keeps residuals); "
                               "with it, call hvd.join() on every rank at the end of training only")
        compressed, ctx = self.hvd_compression.compress(bucket.buffer)
        allreduce_(compressed, name=f"DistributedOptimizer.bucket{bucket.index}.{bucket.slots[0].name}",
                   op=Average, prescale_factor=self.prescale, postscale_factor=self.postscale,
                   process_set=self.process_set)
        out = self.hvd_compression.decompress(compressed, ctx)
        if out is not bucket.buffer:
            bucket.buffer.copy_(out.reshape(-1))

    def _any_rank(self, mine: int) -> int:
        if not self._by_controller:
            return super()._any_rank(mine)
        # through the controller, as the step's buckets: a joined rank adds 0; how many ranks saw each level
        flags = torch.tensor([float(mine == level) for level in (1, 2)])
        allreduce_(flags, name=f"DistributedOptimizer.edited.{self._buckets[0].slots[0].name}", op=Sum,
                   process_set=self.process_set)
        return 2 if flags[1] > 0 else 1 if flags[0] > 0 else 0

    def _stepping(self) -> int:
        """How many ranks take this step: a one-element sum through the controller, to which a rank in
        ``hvd.join()`` adds 0 (the same count on every rank, so every rank picks the same path)."""
        token = torch.ones(1)
        allreduce_(token, name=f"DistributedOptimizer.step.{self._buckets[0].slots[0].name}", op=Sum,
                   process_set=self.process_set)
        return round(token.item())

    def _hook(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None or not grad.is_sparse:
            return super()._hook(param)
        # A sparse gradient: the bucket gets it dense (sparse_as_dense) or zeros (the door
        # reduces it by allgather); .grad stays sparse, as in Horovod.
        self.held[param] = grad
        param.grad = grad.to_dense() if self.sparse_as_dense else torch.zeros_like(param)
        try:
            super()._hook(param)
        finally:
            param.grad = grad
            bucket, pos = self._slot_of[id(param)]
            bucket.seen.pop(pos, None)  # (.grad is the sparse one again: not a change of the user's)

    def synchronize(self) -> None:
        held, self.held = self.held, {}
        for p in held:  # the reduced values land in a dense stand-in
            p.grad = torch.zeros_like(p)
        try:
            super().synchronize()
        finally:
            for p, g in held.items():
                if self.sparse_as_dense:
                    p.grad = p.grad.to_sparse()
                else:
                    p.grad = g
                    self.sparse[p] = g

    @property
    def pending(self) -> bool:
        """Some gradient has arrived since the last reduction."""
        return any(self._passes.values())


class _DeviceReducer:
    """Gradients on a GPU: one grouped allreduce of all of them, in
    ``synchronize()``."""

    pending = False

    def __init__(self, params: list, compression, op: int, prescale: float, postscale: float,
                 process_set=global_process_set, sparse_as_dense: bool = False):
        if isinstance(compression, _Ours):
            raise ValueError(f"{compression!r} compresses CPU parameters only (hpcjobs.training.DistributedOptimizer"
                             "); on a GPU use Compression.none, Compression.fp16 or Compression.bf16")
        self.params, self.compression = params, compression
        self.op, self.prescale, self.postscale = op, prescale, postscale
        self.process_set, self.sparse_as_dense = process_set, sparse_as_dense
        self.sparse: dict = {}

    def synchronize(self) -> None:
        for p in self.params:
            if p.grad is None:  # not computed here, maybe elsewhere: contribute zeros
                p.grad = torch.zeros_like(p)
        densified = [p for p in self.params if p.grad.is_sparse and self.sparse_as_dense]
        for p in densified:
            p.grad = p.grad.to_dense()
        dense = [p for p in self.params if not p.grad.is_sparse]
        self.sparse.update((p, p.grad) for p in self.params if p.grad.is_sparse)
        pairs = [self.compression.compress(p.grad) for p in dense]
        reduced = grouped_allreduce_([c for c, _ in pairs], op=self.op, prescale_factor=self.prescale,
                                     postscale_factor=self.postscale, process_set=self.process_set)
        for p, r, (_, ctx) in zip(dense, reduced, pairs):
            out = self.compression.decompress(r, ctx)
            if out is not p.grad:
                p.grad.copy_(out)
        for p in densified:
            p.grad = p.grad.to_sparse()

    def close(self, free: bool = True) -> None:
        """Nothing to release (the engine's counterpart removes its hooks)."""


def _named(optimizer: torch.optim.Optimizer, named_parameters) -> list:
    """``named_parameters`` checked as Horovod checks it (None: Horovod's default names)."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])]
    named = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                         "by model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    unnamed = {id(p) for g in optimizer.param_groups for p in g["params"]} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(map(str, unnamed))}")
    return named


def _check_groups(groups) -> None:
    if groups is None:
        return
    if not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))


def _reducer(optimizer, named: list, compression, backward_passes_per_step: int, op: int, predivide: float,
             process_set, sparse_as_dense: bool):
    set_id, _, ranks = resolve(process_set)
    if len(ranks) == 1:
        return None
    base = world().comm if set_id == 0 else engine_of(set_id)  # not the controller's (_process_sets._Entry)
    updated = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = [(n, p) for n, p in named if id(p) in updated]  # the engine skips those without gradients
    if all(p.device.type == "cpu" for _, p in params):
        prescale, postscale = (1.0 / predivide, predivide) if op == Average else (1.0, float(len(ranks)))
        return _EngineReducer(optimizer, params, base, engine_compressor(compression), backward_passes_per_step,
                              prescale, postscale, sparse_as_dense, process_set, compression)
    prescale, postscale = (1.0 / predivide, predivide) if op == Average else (1.0, 1.0)
    return _DeviceReducer([p for _, p in params if p.requires_grad], compression, op, prescale, postscale,
                          process_set, sparse_as_dense)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """``optimizer``, now reducing gradients over the ranks before each step
    (module docstring); an instance of ``optimizer``'s class.

    Raises:
        ValueError: Horovod's argument errors; op Adasum, Min, Max or Product.
        ValueError: ``process_set`` is not registered.
    """
    ranks_of(process_set)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, _Engine):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (not hpcjobs' DistributedOptimizer), "
                        f"got {type(optimizer).__name__}")
    op = reduce_op(op, None)
    if op not in (Average, Sum):
        raise ValueError("hvd.DistributedOptimizer reduces gradients with op=hvd.Average or op=hvd.Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    _check_groups(groups)
    named = _named(optimizer, named_parameters)
    included = world().rank in ranks_of(process_set)
    reducer = (_reducer(optimizer, named, compression, backward_passes_per_step, op, gradient_predivide_factor,
                        process_set, sparse_as_dense) if included else None)

    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    opt = cls.__new__(cls)
    opt.__dict__.update({k: v for k, v in vars(optimizer).items() if not callable(getattr(type(optimizer), k, None))})
    opt.backward_passes_per_step = backward_passes_per_step
    opt.op, opt.gradient_predivide_factor = op, gradient_predivide_factor
    opt.sparse_as_dense, opt.process_set = sparse_as_dense, process_set
    opt._hvd_reducer, opt._hvd_synchronized, opt._hvd_should_synchronize = reducer, False, True
    opt._parameter_names = {p: n for n, p in sorted(named, key=lambda item: item[0])}
    # The engine's hooks live on the parameters: remove them with the optimizer.
    weakref.finalize(opt, _release, reducer)
    return opt


def _release(reducer) -> None:
    if reducer is not None:
        reducer.close(free=False)  # (collected at different times on different ranks: no collective here)
