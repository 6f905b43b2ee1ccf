"""Data-parallel training on hpcjobs' own allreduce.

``DistributedOptimizer`` wraps any ``torch.optim`` optimizer so that
``step()`` applies gradients averaged over the ranks of ``comm``::

    model = build_model(...)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(opt, model.named_parameters(), algorithm="auto")
    broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_optimizer_state(opt, root_rank=0)
    for x, y in batches:                 # this rank's shard, b samples
        opt.zero_grad()
        loss_fn(model(x), y).backward()  # buckets are reduced during backward
        opt.step()                       # waits for the last bucket, then steps

How it works, per step:
1. **Buckets** (:mod:`hpcjobs.training.buckets`). At construction the parameters are laid out, in reverse order
   of ``named_parameters`` (roughly the order backward produces their gradients), into flat buckets of at most
   ``fusion_bytes`` per dtype, as DDP and Horovod's tensor fusion do: one allreduce per bucket instead of one
   per tensor. Every rank checks with one small ``MPI_Allreduce`` that all ranks built the same layout.
2. **Hooks.** A ``post_accumulate_grad`` hook on each parameter copies its gradient into the bucket on the last
   of ``backward_passes_per_step`` passes (earlier passes just accumulate in ``.grad``, as torch does).
3. **Overlap.** When a bucket is full it is handed to a communication thread which allreduces it (``op="avg"``,
   our algorithms) while backward goes on computing the next gradients. Buckets are launched strictly in index
   order on every rank -- a bucket waits for the ones before it -- so the collectives match across ranks
   whatever order the hooks fire in. ``overlap="none"`` instead reduces every bucket in ``step()`` after
   backward (``hpcjobs bench train`` measures both).
4. **Step.** ``step()`` launches the buckets whose gradients never arrived (unused parameters contribute zeros),
   waits for all, raises where a ``.grad`` changed since it was copied in (a clip or a GradScaler's unscale
   that the averages would overwrite: :func:`~hpcjobs.training.buckets.changed_grads`; change the averages,
   after :meth:`synchronize`), copies the averages back into ``.grad`` and calls the wrapped optimizer.

On one rank without compression the gradients are their own average: nothing is copied or reduced (unused
parameters still get zeros). With P ranks each on b samples and a loss averaged over its b samples, the averaged
gradient is the gradient of the mean loss over all P*b samples, so training computes what one process computes
with batch P*b. With ``backward_passes_per_step=k`` the k gradients are summed (torch's own accumulation):
divide the loss by k for a mean over P*k*b samples.

Compression (``compression=``, any :mod:`hpcjobs.compression` compressor) sends each bucket through
:func:`~hpcjobs.compression.compressed_allreduce`. The casts (fp16, bf16) compress fused buckets whole; the
others need one tensor at a time (top-k per layer, PowerSGD's matrices), so with them every parameter is its own
bucket. ``error_feedback=True`` keeps each bucket's residual (:class:`~hpcjobs.compression.ErrorFeedback`, by
parameter name), updated at the end of a step's reductions; where the step is skipped whole on one bucket's
overflow (``nonfinite="skip"``, or ``skips_whole_steps = True`` under a loss scaler) none is, and every
residual stays as it was. :meth:`DistributedOptimizer.compression_state_dict` carries the residuals, the
compressor's state and the step count into checkpoints.

BatchNorm statistics are not reduced: each rank normalises over its own b samples (Goyal et al. 2017).
Parameters on a GPU are bucketed and reduced on it (:mod:`~hpcjobs.training.buckets` orders the streams).
Optimizers alive at once, and a communication thread, reduce on communicators of their own
(:mod:`~hpcjobs.training.communicators`; ``close()`` frees them). The thread needs ``MPI_THREAD_SERIALIZED``
or better (mpi4py asks for ``MULTIPLE``, which the main thread's calls beside it need). Where some rank has a
lower thread level or less than two cores to itself (:func:`~hpcjobs.runtime.cores_per_rank`: ranks on one
machine share its cores, emulated hosts and containers included), ``overlap="auto"`` is ``"none"`` everywhere."""

from __future__ import annotations

import contextlib
import math
import queue
import sys
import threading
import time
import weakref

import torch
from mpi4py import MPI

from ..collectives import ALGORITHMS, MESSAGE_ALGORITHMS, allreduce
from ..collectives.counting import counted_allreduce
from ..comm import private
from ..compression import Compressor, ErrorFeedback, compressed_allreduce
from ..runtime import cores_per_rank
from .buckets import EDITED, STRAY, Bucket, changed_grads, check_layout, layout, listed, stray_grads
from .communicators import any_rank, communicator, dropped, serve, weakly
from .optimizer_state import OptimizerState
from .config import DEFAULT_FUSION_BYTES, NONFINITE, OVERLAPS

__all__ = ["DistributedOptimizer", "NonFiniteGradientError"]


class NonFiniteGradientError(FloatingPointError):
    """An averaged gradient holds NaN or Inf (``nonfinite="abort"``); raised on every rank alike."""


class DistributedOptimizer(OptimizerState):
    """Average gradients over ``comm`` with hpcjobs' allreduce, then step.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (SGD with momentum or
            Nesterov, Adam, Adagrad, Adadelta, RMSprop, LARS, ...).
        named_parameters: ``model.named_parameters()``: every parameter the
            optimizer updates, with a unique name; the same names, shapes and
            dtypes on every rank.
        comm: the data-parallel communicator (None: COMM_WORLD).
        algorithm: an allreduce algorithm name (:data:`ALGORITHMS`) or "auto".
        compression: None, or a :class:`~hpcjobs.compression.Compressor`
            (the same on every rank); compressed payloads take a
            message-passing algorithm ("auto" chooses among them).
        error_feedback: keep what compression drops and add it back the
            next step (needs ``compression``).
        fusion_bytes: largest bucket, in bytes (> 0).
        backward_passes_per_step: backward passes accumulated locally before
            each reduction.
        nonfinite: what ``step()`` does when an averaged gradient holds NaN
            or Inf: "ignore" (step anyway), "skip" (leave the parameters
            alone this step, count it in ``stats["skipped_steps"]``, warn on
            rank 0 naming the parameters) or "abort" (raise
            :class:`NonFiniteGradientError` naming them). The averages are
            bitwise the same on every rank, so every rank decides alike.
        overlap: "thread" (reduce buckets during backward on a thread), "none" (reduce in ``step()``), or
            "auto": the thread where the MPI thread level allows it and every rank may use two or more cores
            (with one, the thread competes with backward for it: "none" was 1.18x faster in ``bench train``).
        noise_scale: sum squared norms of this rank's gradient and of the average in ``stats`` (for the
            gradient noise scale, ``train --noise-scale``); uncompressed, 2+ ranks (``reset_stats``).

    Raises:
        ValueError: bad arguments, parameters the optimizer updates that are
            not named, or a layout that differs between ranks (raised on
            every rank, naming what differs).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters, comm: MPI.Comm | None = None,
                 algorithm: str = "auto", compression: Compressor | None = None, error_feedback: bool = False,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, backward_passes_per_step: int = 1,
                 overlap: str = "auto", nonfinite: str = "ignore", noise_scale: bool = False):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OptimizerState):
            raise TypeError("optimizer must be a torch.optim.Optimizer not yet wrapped, got "
                            f"{type(optimizer).__name__}")
        if algorithm != "auto" and algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose from auto, {', '.join(ALGORITHMS)}")
        if int(fusion_bytes) != fusion_bytes or fusion_bytes <= 0:
            raise ValueError(f"fusion_bytes must be a positive integer, got {fusion_bytes}")
        if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step}")
        if overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        if compression is not None:
            if not isinstance(compression, Compressor):
                raise TypeError(f"compression must be an hpcjobs.compression.Compressor, "
                                f"got {type(compression).__name__}")
            if algorithm != "auto" and algorithm not in MESSAGE_ALGORITHMS:
                raise ValueError(f"compressed gradients need a message-passing algorithm (auto or "
                                 f"{', '.join(MESSAGE_ALGORITHMS)}), got {algorithm!r}")
        elif error_feedback:
            raise ValueError("error_feedback needs a compression")
        self._optimizer = optimizer
        self._closed = False  # (close() ran: another optimizer may take the shared communicator)
        if overlap == "auto":  # a thread on every rank or on none (agreed: the two kinds' communicators differ)
            shared = private(comm if comm is not None else MPI.COMM_WORLD)
            ok = cores_per_rank(shared) >= 2 and MPI.Query_thread() >= MPI.THREAD_SERIALIZED  # (collective first)
            overlap = "thread" if shared.allreduce(ok, op=MPI.LAND) else "none"
        elif overlap == "thread" and MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise ValueError("overlap='thread' needs MPI_THREAD_SERIALIZED or better; this MPI gives "
                             f"level {MPI.Query_thread()}; use overlap='none'")
        self.overlap = overlap
        # a thread reduces on a duplicate of its own (a metric averaged before step() met its buckets)
        self._user_comm, self._comm, self._own_comm = communicator(self, comm, own=overlap == "thread")
        self.size = self._comm.Get_size()
        self.rank = self._comm.Get_rank()
        if noise_scale and (compression is not None or self.size < 2):
            raise ValueError("noise_scale needs uncompressed gradients on at least 2 ranks (one rank's batch "
                             "against the average over all)")
        self.noise_scale, self.algorithm = bool(noise_scale), algorithm
        # the loss scale the gradients carry (fp16's GradScaler, set before each step); this step's squared norms
        self.grad_scale, self._sq_step = 1.0, [0.0, 0.0]
        self.compression = compression
        self.memory = ErrorFeedback(per_step=True) if error_feedback else None
        # Whether a step whose average is not finite somewhere is skipped whole: nonfinite="skip" here, or a
        # loss scaler's step (the caller says so, as loop.py does for fp16). Error feedback then keeps every
        # bucket's residual of that step or none; else each bucket's own average decides.
        self.skips_whole_steps = nonfinite == "skip"
        self._fused = compression is None or compression.fusable
        self._counted = compression is not None or algorithm in MESSAGE_ALGORITHMS
        self.fusion_bytes = int(fusion_bytes)
        self.backward_passes_per_step = int(backward_passes_per_step)

        named = [(n, p) for n, p in named_parameters]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"named_parameters has duplicate names: {', '.join(dup)}")
        self._names = by_id = {id(p): n for n, p in named}
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [p for p in opt_params if id(p) not in by_id]
        if missing:
            raise ValueError(f"{len(missing)} parameter(s) the optimizer updates are not in named_parameters; "
                             "pass model.named_parameters() for the model the optimizer was built on")
        opt_ids = {id(p) for p in opt_params}
        named = [(n, p) for n, p in named if id(p) in opt_ids and p.requires_grad]
        self._buckets = layout(named, self.fusion_bytes, self._fused)
        # one rank, no compression: the gradient is its own average (no copies: they cost 5-8%)
        self._alone = self.size == 1 and compression is None
        check_layout(self._comm, named, self._buckets, {
            "fusion_bytes": self.fusion_bytes, "backward_passes_per_step": self.backward_passes_per_step,
            "algorithm": self.algorithm, "compression/error feedback": f"{compression!r} ef={self.memory is not None}"})
        self._slot_of: dict[int, tuple[Bucket, int]] = {}
        self._passes: dict[int, int] = {}
        self._handles = []
        for b in self._buckets:
            for pos, slot in enumerate(b.slots):
                self._slot_of[id(slot.param)] = (b, pos)
                self._passes[id(slot.param)] = 0
                self._handles.append(slot.param.register_post_accumulate_grad_hook(weakly(self, "_hook")))
        self._next = 0  # the next bucket to launch, the same sequence on every rank
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        dropped(self, self._handles, self._queue)  # collected without close(): the hooks go, the thread ends
        self._error: BaseException | None = None
        self._step = 0  # reductions done: random-k's and PowerSGD's step, checkpointed
        self._synced = False  # synchronize() ran and no gradient has arrived since: step() does not again
        self._skip_sync = False  # inside skip_synchronize()
        self.reset_stats()
        self._reset_buckets()

    # -- per step ------------------------------------------------------------

    def _reset_buckets(self) -> None:
        for b in self._buckets:
            b.reset()
        for k in self._passes:
            self._passes[k] = 0
        self._next = 0

    def _hook(self, param: torch.Tensor) -> None:
        self._synced = False
        key = id(param)
        self._passes[key] += 1
        n = self._passes[key]
        if n < self.backward_passes_per_step:
            return
        if n > self.backward_passes_per_step:
            name = self._slot_of[key][0].slots[self._slot_of[key][1]].name
            raise RuntimeError(f"gradient of {name} computed {n} times before step(); "
                               f"backward_passes_per_step is {self.backward_passes_per_step}")
        if self._alone:
            return
        bucket, pos = self._slot_of[key]
        bucket.fill(pos)
        if not bucket.pending:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and not self._buckets[self._next].pending:
            bucket = self._buckets[self._next]
            self._next += 1
            if self.overlap == "thread":
                self._ensure_thread()
                self._queue.put(bucket)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=serve, args=(weakref.ref(self), self._queue),
                                            name="hpcjobs-allreduce", daemon=True)
            self._thread.start()

    def _reduce(self, bucket: Bucket) -> None:
        t0 = time.perf_counter()
        bucket.before_reduce()
        if self.noise_scale:  # this rank's gradient, before it is averaged (convergence.noise_scale)
            self._sq_step[0] += float(bucket.buffer.double().square().sum())
        self._exchange(bucket)
        if self.noise_scale:
            self._sq_step[1] += float(bucket.buffer.double().square().sum())
        bucket.after_reduce()
        self.stats["comm_s"] += time.perf_counter() - t0
        self.stats["allreduces"] += 1

    def _exchange(self, bucket: Bucket) -> None:
        """The bucket's average over the ranks, in place: compressed, counted or plain (the Horovod door's
        own goes by its controller while a rank has joined)."""
        if self.compression is not None:
            single = len(bucket.slots) == 1
            tensor = bucket.buffer.view(bucket.slots[0].param.shape) if single else bucket.buffer
            name = bucket.slots[0].name if single else f"bucket{bucket.index}"
            mean, sent = compressed_allreduce(tensor, self.compression, self.memory, name=name,
                                              comm=self._user_comm, algorithm=self.algorithm, step=self._step)
            bucket.buffer.copy_(mean.reshape(-1))
            self.stats["sent_bytes"] += sent
        elif self._counted:  # the byte-counting host algorithms: a GPU's bucket crosses the host
            with bucket.on_host() as host:
                self.stats["sent_bytes"] += counted_allreduce(host, "avg", self.algorithm, self._user_comm)
        else:
            allreduce(bucket.buffer, op="avg", algorithm=self.algorithm, comm=self._user_comm)

    def synchronize(self) -> None:
        """Finish this step's reductions and leave the averages in ``.grad``.

        Parameters whose gradient never arrived contribute ``.grad`` if they have one, else zeros. Called by
        :meth:`step`, unless it ran since the last gradient arrived (``synchronize()``, clip the averages,
        ``step()``: one reduction, as Horovod's ``skip_synchronize`` would give; a second would average, and
        compress, the averages again).
        """
        t0 = time.perf_counter()
        if self._alone:
            for bucket in self._buckets:
                bucket.zero_unused_grads()
            self._synced = True
            return self._finish_step(t0)
        for bucket in self._buckets:
            bucket.fill_missing()
        self._launch_ready()
        if self.overlap == "thread":
            for bucket in self._buckets:
                bucket.done.wait()
        else:
            for bucket in self._buckets:
                self._reduce(bucket)
        if self._error is not None:
            error, self._error = self._error, None
            self._reset_buckets()
            if self.memory is not None:
                self.memory.discard()
            raise RuntimeError(f"allreduce of gradients failed on rank {self.rank}: {error}") from error
        stray = stray_grads(self._optimizer.param_groups, self._slot_of, self._names)  # a parameter none averages
        edited = stray or changed_grads(self._buckets)  # the averages would overwrite a change: GradScaler's 65,536x
        seen = self._any_rank(2 if stray else 1 if edited else 0)  # one refusal on every rank, whatever each saw
        if seen:
            self._reset_buckets()
            if self.memory is not None:
                self.memory.discard()
            raise RuntimeError((STRAY if seen == 2 else EDITED).format(names=listed(stray if seen == 2 else edited)))
        if self.memory is not None:  # a step skipped as a whole counts for no bucket's residual
            self.memory.commit(self.skips_whole_steps)
        for bucket in self._buckets:
            bucket.unpack()
        self._synced = True
        self._finish_step(t0)

    def _any_rank(self, mine: int) -> int:  # the highest on any rank (the Horovod door's: by its controller)
        return any_rank(self._comm, mine, "DistributedOptimizer.synchronize")

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's: :meth:`step` inside it steps on ``.grad`` as it is
        (after a :meth:`synchronize` of one's own: since it, a plain
        :meth:`step` does not reduce again either)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def _finish_step(self, t0: float) -> None:
        if self.noise_scale:  # a step whose average overflowed counts nowhere, the same on every rank
            if all(map(math.isfinite, self._sq_step)):
                for key, sq in zip(("grad_sq_rank", "grad_sq_avg"), self._sq_step):
                    self.stats[key] += sq / self.grad_scale ** 2  # in the gradient's own units
                self.stats["noise_steps"] += 1
            self._sq_step = [0.0, 0.0]
        self._reset_buckets()
        self._step += 1
        self.stats["wait_s"] += time.perf_counter() - t0
        self.stats["steps"] += 1

    def step(self, closure=None):
        """Average the gradients over the ranks, then step the wrapped optimizer
        (or not: see ``nonfinite``). A ``closure`` is refused (TypeError)."""
        if closure is not None:  # its backward would replace the averages with this rank's own gradients
            raise TypeError("DistributedOptimizer.step() takes no closure: its backward would replace the averaged "
                            "gradients with this rank's own (LBFGS and the like are not supported)")
        if not (self._synced or self._skip_sync):
            self.synchronize()
        self._synced = False
        if self.nonfinite != "ignore":
            bad = self.nonfinite_parameters()
            if bad:
                what = (f"non-finite averaged gradient at step {self._step} in {len(bad)} parameter(s): "
                        + ", ".join(bad[:5]) + (", ..." if len(bad) > 5 else ""))
                if self.nonfinite == "abort":
                    raise NonFiniteGradientError(what)
                self.stats["skipped_steps"] += 1
                if self.rank == 0:
                    print(f"hpcjobs: warning: {what}; step skipped", file=sys.stderr, flush=True)
                return None
        return self._optimizer.step()

    def close(self, free: bool = True) -> None:
        """Remove the hooks, stop the communication thread and, with ``free``,
        free the communicator of its own that an optimizer made beside another
        one (collective: every rank calls it; a finalizer, whose time differs by
        rank, passes ``free=False`` and leaves it)."""
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if free and self._own_comm is not None and not MPI.Is_finalized():
            self._own_comm.Free()  # (its private duplicate, and what lives on that, with it)
            self._own_comm = None

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self._optimizer).__name__}, ranks={self.size}, "
                f"algorithm={self.algorithm!r}, buckets={len(self._buckets)}, overlap={self.overlap!r})")
