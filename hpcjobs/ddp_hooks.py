"""hpcjobs' compressors as DDP communication hooks.

DDP hands a comm hook each gradient bucket (a flat tensor) and waits on the
future it returns. :func:`register` installs one that sends the bucket
through :func:`hpcjobs.compression.compressed_allreduce` -- each compressor
on the collective it needs (fp16/bf16 and random-k on an allreduce, top-k,
QSGD and 1-bit sign on an allgather, PowerSGD on two allreduces of its
factors), with error feedback if asked::

    import hpcjobs.torch_backend  # noqa: F401
    from hpcjobs import ddp_hooks

    dist.init_process_group("hpcjobs")          # or gloo: the hook brings its own communicator
    model = DistributedDataParallel(model)
    ddp_hooks.register(model, "topk:0.01", error_feedback=True)

How it works:

- The casts (``fp16``, ``bf16``) compress a bucket whole; the others work
  per tensor (top-k per layer, PowerSGD's matrices), so the hook cuts the
  bucket into its parameters' gradients and reduces each under its
  parameter's name (error-feedback residuals, shared random draws; DDP
  rebuilds its buckets after the first step, names do not change).
- The hook queues the bucket to one worker thread per hook and returns at
  once, so the exchange overlaps the rest of backward, as DDP's own
  allreduce does; buckets run in the order DDP hands them over, which is
  the same on every rank.
- The hook reduces on a duplicate of ``comm`` made when it is registered
  (default: the communicator of DDP's process group where it is one of
  ``hpcjobs.torch_backend``'s, else ``COMM_WORLD``); its ranks must be DDP's
  ranks in the same order, and where DDP's group has another size or gives
  a rank another number, every rank raises (a hook averaging over other
  ranks than DDP's would train each group, or each process, apart), at
  once where the sizes differ (a subgroup's other ranks never call it).
- The step count (random-k's and PowerSGD's shared seed) advances after the
  last bucket of each backward.
"""

# No ``from __future__ import annotations``: DDP reads the hook's return
# annotation and wants the object torch.futures.Future[torch.Tensor].
import queue
import threading
import weakref

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.futures import Future

from ._torch_mpi import future_value
from .collectives.watchdog import guard
from .comm import closed_at_exit, private
from .compression import ErrorFeedback, compressed_allreduce, make_compressor

__all__ = ["HookState", "register", "compression_hook"]


class HookState:
    """What one registered hook keeps: the compressor, the residuals, the
    step, the communicator and the worker thread.

    ``names`` (``id(parameter)`` -> its name; :func:`register` passes the
    model's) keys the residuals and random draws; a parameter it lacks is
    named ``param<N>`` in the order the hook first meets it, the same on
    every rank, and keeps that name when DDP rebuilds its buckets.

    Raises:
        ValueError: an unknown compression, or ``"none"``.
    """

    def __init__(self, compression: str, error_feedback: bool = False, comm: "MPI.Comm | None" = None,
                 algorithm: str = "auto", seed: int = 0, names: dict[int, str] | None = None,
                 timeout: float | None = None):
        self.compressor = make_compressor(compression, seed=seed)
        if self.compressor is None:
            raise ValueError("compression 'none' needs no hook: DDP's own allreduce (on the hpcjobs backend, "
                             "ours) does that")
        self.memory = ErrorFeedback() if error_feedback else None
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()  # collective, here; freed by close
        private(self.comm, free_if_refused=True)  # its duplicate here too, on this thread, not first on the worker
        self.algorithm = algorithm
        self.timeout = timeout  # seconds a bucket may wait for the other ranks (None: HPCJOBS_TIMEOUT)
        self.step = 0
        self.sent_bytes = 0
        self.names = dict(names or {})  # id(parameter) -> its name in the model
        self._closed = False
        self._used: set = set()  # the residuals' names this step
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._serve, name="hpcjobs-ddp-hook", daemon=True)
        self._worker.start()
        _live.append(weakref.ref(self))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker: buckets still queued fail (their collectives
        would wait for peers that may be gone), the one in progress
        finishes, within ``timeout`` seconds; then the communicator is freed
        (collective: every rank closes; at exit, every hook in the order
        registered). Interpreter exit calls it: a daemon worker still inside
        torch's ``set_result`` (DDP's callbacks run there after backward has
        returned) would be killed at finalization, and that aborts the
        process."""
        self._closed = True  # a bucket handed over after this fails at once (nothing would run it)
        if self._worker.is_alive():
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].set_exception(RuntimeError("the hpcjobs DDP hook was closed before this bucket ran"))
            self._queue.put(None)
            if threading.current_thread() is self._worker:
                return
            self._worker.join(timeout)
            if self._worker.is_alive():  # still in its bucket: its communicator stays
                return
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()  # the windows made on its duplicate go with it

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            bucket, fut, written = item
            try:
                if written is not None:  # this thread's stream waits for backward's writes into the bucket
                    torch.cuda.current_stream(bucket.buffer().device).wait_event(written)
                with guard("hpcjobs DDP hook", self.comm, self.timeout):  # the collectives inside inherit it
                    result = self._reduce(bucket)
                fut.set_result(result)
            except BaseException as e:  # noqa: BLE001 -- DDP's wait raises it
                fut.set_exception(e)

    def _reduce(self, bucket) -> torch.Tensor:
        buf = bucket.buffer()
        if buf.is_cuda:  # this thread started on device 0
            torch.cuda.set_device(buf.device)
        names = [self.names.setdefault(id(p), f"param{len(self.names)}") for p in bucket.parameters()]
        if self.compressor.fusable:
            # DDP rebuilds its buckets after the first step: a bucket's
            # residual is keyed by what it holds, not by its index
            pieces = [("+".join(names), buf)]
        else:
            pieces, offset = [], 0
            for name, g in zip(names, bucket.gradients()):
                pieces.append((name, buf[offset:offset + g.numel()].view_as(g)))
                offset += g.numel()
        for name, grad in pieces:
            avg, sent = compressed_allreduce(grad, self.compressor, self.memory, name=name, comm=self.comm,
                                             algorithm=self.algorithm, step=self.step)
            grad.copy_(avg)
            self.sent_bytes += sent
            self._used.add(name)
        if bucket.is_last():
            self.step += 1
            if self.memory is not None:  # a fused bucket's residual under the layout DDP has since rebuilt
                for stale in set(self.memory.residuals) - self._used:
                    del self.memory.residuals[stale]
            self._used = set()
        return buf


def compression_hook(state: HookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """The DDP comm hook (``model.register_comm_hook(state,
    compression_hook)``): the bucket's average through ``state``'s
    compressor, on a future the worker completes."""
    buf = bucket.buffer()
    fut: Future = Future(devices=[buf.device]) if buf.is_cuda else Future()  # (CUDA: DDP's stream waits)
    if state._closed:
        fut.set_exception(RuntimeError("the hpcjobs DDP hook was closed (HookState.close()): it reduces no more "
                                       "buckets; register a new one"))
    else:
        written = None
        if buf.is_cuda:  # backward wrote the bucket on this thread's stream; the worker's waits for it
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(buf.device))
        state._queue.put((bucket, fut, written))
    # chained: DDP reads an error set on a Python future as a tensor ("Unable to cast ... to Tensor"), and a
    # callback's error as itself
    return fut.then(future_value)


def register(model, compression: str, error_feedback: bool = False, comm: "MPI.Comm | None" = None,
             algorithm: str = "auto", seed: int = 0) -> HookState:
    """Install the hook on a ``DistributedDataParallel`` ``model`` (before its
    first backward); returns its state (``sent_bytes``, ``step``). Collective
    over ``comm``."""
    from ._torch_group import HpcjobsProcessGroup

    group = getattr(model, "process_group", None)
    ours = isinstance(group, HpcjobsProcessGroup)
    if comm is None and ours:
        comm = group._own
    _check_group(group, comm if comm is not None else MPI.COMM_WORLD)
    state = HookState(compression, error_feedback, comm, algorithm, seed,
                      names={id(p): n for n, p in model.module.named_parameters()},
                      timeout=group._limit if ours else None)  # as long as the group's own calls wait
    model.register_comm_hook(state, compression_hook)
    return state


def _check_group(group, comm: "MPI.Intracomm") -> None:
    """Raise on every rank of ``comm`` where DDP's process group ``group``
    does not give each rank the number ``comm`` gives it, out of as many.

    Where the sizes differ every one of DDP's ranks sees it and raises, with
    no collective: only DDP's ranks call ``register``, and one over ``comm``
    (a subgroup's DDP, the hook on COMM_WORLD) waited for ranks that never
    came. Otherwise an allgather over ``comm``, watched."""
    if group is None:
        return
    mine = None
    if (group.rank(), group.size()) != (comm.Get_rank(), comm.Get_size()):
        mine = (f"rank {comm.Get_rank()} of {comm.Get_size()} here is rank {group.rank()} of {group.size()} in "
                "DDP's process group")
    if group.size() != comm.Get_size():  # every one of DDP's ranks sees it: no collective
        errors = [mine]
    else:  # as many: with COMM_WORLD (the default) every rank is DDP's and here; a comm= of others waits, watched
        with guard("ddp_hooks.register", comm):
            errors = [e for e in comm.allgather(mine) if e]
    if errors:
        raise ValueError("the hook averages over its communicator (comm=, default COMM_WORLD or an hpcjobs "
                         "group's), which must hold DDP's ranks in the same order: " + "; ".join(errors))


_live = closed_at_exit("close")  # weak references to every hook's state, in the order registered
