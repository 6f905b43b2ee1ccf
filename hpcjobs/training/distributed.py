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

1. **Buckets.** At construction the parameters are laid out, in reverse
   order of ``named_parameters`` (roughly the order backward produces their
   gradients), into flat buckets of at most ``fusion_bytes`` per dtype, as
   DDP and Horovod's tensor fusion do: one allreduce per bucket instead of
   one per tensor. Every rank checks with one small ``MPI_Allreduce`` that
   all ranks built the same layout.
2. **Hooks.** A ``post_accumulate_grad`` hook on each parameter copies its
   gradient into the bucket on the last of ``backward_passes_per_step``
   passes (earlier passes just accumulate in ``.grad``, as torch does).
3. **Overlap.** When a bucket is full it is handed to a communication thread
   which allreduces it (``op="avg"``, our algorithms) while backward goes on
   computing the next gradients. Buckets are launched strictly in index
   order on every rank -- a bucket waits for the ones before it -- so the
   collectives match across ranks whatever order the hooks fire in.
   ``overlap="none"`` instead reduces every bucket in ``step()`` after
   backward (``hpcjobs bench train`` measures both).
4. **Step.** ``step()`` launches the buckets whose gradients never arrived
   (unused parameters contribute zeros), waits for all, copies the averages
   back into ``.grad`` and calls the wrapped optimizer.

With P ranks each on b samples and a loss averaged over its b samples, the
averaged gradient is the gradient of the mean loss over all P*b samples, so
training computes what one process computes with batch P*b. With
``backward_passes_per_step=k`` the k gradients are summed (torch's own
accumulation): divide the loss by k for a mean over P*k*b samples.

Compression (``compression=``, any :mod:`hpcjobs.compression` compressor)
sends each bucket through :func:`~hpcjobs.compression.compressed_allreduce`.
The casts (fp16, bf16) compress fused buckets whole; the others need one
tensor at a time (top-k per layer, PowerSGD's matrices), so with them every
parameter is its own bucket. ``error_feedback=True`` keeps each bucket's
residual (:class:`~hpcjobs.compression.ErrorFeedback`, by parameter name);
:meth:`DistributedOptimizer.compression_state_dict` carries the residuals,
the compressor's state and the step count into checkpoints.

BatchNorm statistics are not reduced: each rank normalises over its own b
samples (Goyal et al. 2017); only parameters travel.

The communication thread needs ``MPI_THREAD_SERIALIZED`` or better (mpi4py
asks for ``MULTIPLE``); the main thread makes no MPI call on this
communicator between backward and ``step()``. With a lower thread level, or
a rank bound to a single core, ``overlap="auto"`` chooses ``"none"``.
"""

from __future__ import annotations

import io
import os
import queue
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from ..collectives import ALGORITHMS, allreduce
from ..collectives.counting import MESSAGE_ALGORITHMS, counted_allreduce
from ..comm import agree, private
from ..compression import Compressor, ErrorFeedback, compressed_allreduce

__all__ = ["DEFAULT_FUSION_BYTES", "NONFINITE", "OVERLAPS", "DistributedOptimizer", "NonFiniteGradientError",
           "broadcast_parameters",
           "broadcast_optimizer_state", "cores_per_rank"]

# Horovod fuses up to 64 MiB and DDP starts at 25 MiB, both tuned for GPUs
# and large models. On CPU ranks the models are small; 1 MiB buckets still
# amortise the per-message latency and leave several buckets to overlap.
DEFAULT_FUSION_BYTES = 1 << 20
OVERLAPS = ("auto", "thread", "none")
NONFINITE = ("ignore", "skip", "abort")


@dataclass
class _Slot:
    name: str
    param: torch.Tensor
    offset: int
    numel: int


@dataclass
class _Bucket:
    index: int
    dtype: torch.dtype
    slots: list[_Slot]
    buffer: torch.Tensor
    pending: set = field(default_factory=set)  # slot positions whose gradient has not arrived
    done: threading.Event = field(default_factory=threading.Event)


class NonFiniteGradientError(FloatingPointError):
    """An averaged gradient holds NaN or Inf (``nonfinite="abort"``); raised
    on every rank alike."""


class DistributedOptimizer:
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
        overlap: "thread" (reduce buckets during backward on a communication
            thread), "none" (reduce in ``step()``), or "auto": the thread when
            the MPI thread level allows it and this rank may use two or more
            cores; with one core the thread only competes with backward for
            it (``hpcjobs bench train``: "none" was 1.18x faster there).

    Raises:
        ValueError: bad arguments, parameters the optimizer updates that are
            not named, or a layout that differs between ranks (raised on
            every rank, naming what differs).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters, comm: MPI.Comm | None = None,
                 algorithm: str = "auto", compression: Compressor | None = None, error_feedback: bool = False,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, backward_passes_per_step: int = 1,
                 overlap: str = "auto", nonfinite: str = "ignore"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
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
        self._user_comm = comm if comm is not None else MPI.COMM_WORLD
        self._comm = private(self._user_comm)  # collective: done here, never first on the thread
        self.size = self._comm.Get_size()
        self.rank = self._comm.Get_rank()
        self.algorithm = algorithm
        self.compression = compression
        self.memory = ErrorFeedback() if error_feedback else None
        self._fused = compression is None or compression.fusable
        self._counted = compression is not None or algorithm in MESSAGE_ALGORITHMS
        self.fusion_bytes = int(fusion_bytes)
        self.backward_passes_per_step = int(backward_passes_per_step)
        if overlap == "auto":
            overlap = ("thread" if MPI.Query_thread() >= MPI.THREAD_SERIALIZED and cores_per_rank(self._comm) >= 2
                       else "none")
        elif overlap == "thread" and MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise ValueError("overlap='thread' needs MPI_THREAD_SERIALIZED or better; this MPI gives "
                             f"level {MPI.Query_thread()}; use overlap='none'")
        self.overlap = overlap

        named = [(n, p) for n, p in named_parameters]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"named_parameters has duplicate names: {', '.join(dup)}")
        by_id = {id(p): n for n, p in named}
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        missing = [p for p in opt_params if id(p) not in by_id]
        if missing:
            raise ValueError(f"{len(missing)} parameter(s) the optimizer updates are not in named_parameters; "
                             "pass model.named_parameters() for the model the optimizer was built on")
        opt_ids = {id(p) for p in opt_params}
        named = [(n, p) for n, p in named if id(p) in opt_ids and p.requires_grad]
        self._buckets = self._layout(named)
        self._check_agreement(named)
        self._slot_of: dict[int, tuple[_Bucket, int]] = {}
        self._passes: dict[int, int] = {}
        self._handles = []
        for b in self._buckets:
            for pos, slot in enumerate(b.slots):
                self._slot_of[id(slot.param)] = (b, pos)
                self._passes[id(slot.param)] = 0
                self._handles.append(slot.param.register_post_accumulate_grad_hook(self._hook))
        self._lock = threading.Lock()
        self._next = 0  # the next bucket to launch, the same sequence on every rank
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step = 0  # reductions done: random-k's and PowerSGD's step, checkpointed
        self.reset_stats()
        self._reset_buckets()

    # -- layout and agreement ---------------------------------------------

    def _layout(self, named) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_: dict[torch.dtype, list[_Slot]] = {}  # the bucket being filled, per dtype

        def close(dtype):
            slots = open_.pop(dtype)
            count = slots[-1].offset + slots[-1].numel
            buckets.append(_Bucket(len(buckets), dtype, slots, torch.zeros(count, dtype=dtype)))

        for name, p in reversed(named):
            if p.device.type != "cpu":
                raise ValueError(f"parameter {name} is on {p.device}; DistributedOptimizer reduces CPU tensors "
                                 "(CUDA parameters need a CUDA-aware MPI, not supported yet)")
            slots = open_.setdefault(p.dtype, [])
            offset = slots[-1].offset + slots[-1].numel if slots else 0
            slots.append(_Slot(name, p, offset, p.numel()))
            if not self._fused or (offset + p.numel()) * p.element_size() >= self.fusion_bytes:
                close(p.dtype)
        for dtype in list(open_):
            close(dtype)
        return buckets

    def _check_agreement(self, named) -> None:
        sig = "|".join(f"{n}:{p.dtype}:{tuple(p.shape)}" for n, p in named)
        layout = "|".join(",".join(s.name for s in b.slots) for b in self._buckets)
        local = np.array([len(named), sum(p.numel() for _, p in named), zlib.crc32(sig.encode()),
                          zlib.crc32(layout.encode()), self.fusion_bytes, self.backward_passes_per_step,
                          zlib.crc32(self.algorithm.encode()),
                          zlib.crc32(f"{self.compression!r} ef={self.memory is not None}".encode())],
                         dtype=np.int64)
        same = agree(local, self._comm)
        if same.all():
            return
        what = ["number of parameters", "number of elements", "parameter names/shapes/dtypes",
                "bucket layout", "fusion_bytes", "backward_passes_per_step", "algorithm",
                "compression/error feedback"]
        differ = [w for w, ok in zip(what, same) if not ok]
        everyone = self._comm.allgather((len(named), int(local[1]), self.fusion_bytes, self.algorithm,
                                         repr(self.compression), self.memory is not None))
        raise ValueError(f"DistributedOptimizer: ranks disagree on {', '.join(differ)}; per rank "
                         f"(params, elements, fusion_bytes, algorithm, compression, error feedback): "
                         + "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone)))

    # -- per step ------------------------------------------------------------

    def _reset_buckets(self) -> None:
        for b in self._buckets:
            b.pending = set(range(len(b.slots)))
            b.done.clear()
        for k in self._passes:
            self._passes[k] = 0
        self._next = 0

    def _hook(self, param: torch.Tensor) -> None:
        key = id(param)
        self._passes[key] += 1
        n = self._passes[key]
        if n < self.backward_passes_per_step:
            return
        if n > self.backward_passes_per_step:
            name = self._slot_of[key][0].slots[self._slot_of[key][1]].name
            raise RuntimeError(f"gradient of {name} computed {n} times before step(); "
                               f"backward_passes_per_step is {self.backward_passes_per_step}")
        bucket, pos = self._slot_of[key]
        slot = bucket.slots[pos]
        bucket.buffer[slot.offset:slot.offset + slot.numel].copy_(param.grad.reshape(-1))
        bucket.pending.discard(pos)
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
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._serve, name="hpcjobs-allreduce", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while True:
            bucket = self._queue.get()
            if bucket is None:
                return
            try:
                if self._error is None:
                    self._reduce(bucket)
            except BaseException as e:  # handed to the main thread in synchronize()
                self._error = e
            finally:
                bucket.done.set()

    def _reduce(self, bucket: _Bucket) -> None:
        t0 = time.perf_counter()
        if self.compression is not None:
            single = len(bucket.slots) == 1
            tensor = bucket.buffer.view(bucket.slots[0].param.shape) if single else bucket.buffer
            name = bucket.slots[0].name if single else f"bucket{bucket.index}"
            mean, sent = compressed_allreduce(tensor, self.compression, self.memory, name=name,
                                              comm=self._user_comm, algorithm=self.algorithm, step=self._step)
            bucket.buffer.copy_(mean.reshape(-1))
            self.stats["sent_bytes"] += sent
        elif self._counted:
            self.stats["sent_bytes"] += counted_allreduce(bucket.buffer, "avg", self.algorithm, self._user_comm)
        else:
            allreduce(bucket.buffer, op="avg", algorithm=self.algorithm, comm=self._user_comm)
        self.stats["comm_s"] += time.perf_counter() - t0
        self.stats["allreduces"] += 1

    def synchronize(self) -> None:
        """Finish this step's reductions and leave the averages in ``.grad``.

        Parameters whose gradient never arrived contribute ``.grad`` if they
        have one, else zeros. Called by :meth:`step`.
        """
        t0 = time.perf_counter()
        for bucket in self._buckets:
            for pos in list(bucket.pending):
                slot = bucket.slots[pos]
                view = bucket.buffer[slot.offset:slot.offset + slot.numel]
                if slot.param.grad is None:
                    view.zero_()
                else:
                    view.copy_(slot.param.grad.reshape(-1))
            bucket.pending.clear()
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
            raise RuntimeError(f"allreduce of gradients failed on rank {self.rank}: {error}") from error
        for bucket in self._buckets:
            for slot in bucket.slots:
                avg = bucket.buffer[slot.offset:slot.offset + slot.numel].view_as(slot.param)
                if slot.param.grad is None:
                    slot.param.grad = avg.clone()
                else:
                    slot.param.grad.copy_(avg)
        self._reset_buckets()
        self._step += 1
        self.stats["wait_s"] += time.perf_counter() - t0
        self.stats["steps"] += 1

    def step(self, closure=None):
        """Average the gradients over the ranks, then step the wrapped optimizer
        (or not: see ``nonfinite``)."""
        self.synchronize()
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
        return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    def nonfinite_parameters(self) -> list[str]:
        """Names of the parameters whose averaged gradient (after
        :meth:`synchronize`) holds a NaN or an Inf."""
        bad = []
        for bucket in self._buckets:
            if torch.isfinite(bucket.buffer).all():
                continue
            bad += [s.name for s in bucket.slots
                    if not torch.isfinite(bucket.buffer[s.offset:s.offset + s.numel]).all()]
        return bad

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def reset_stats(self) -> None:
        """Zero the counters: ``comm_s`` (time spent in allreduce, on the
        thread), ``wait_s`` (time ``step()`` spent before the optimizer ran),
        ``steps``, ``skipped_steps`` (non-finite gradients), ``allreduces``, ``sent_bytes`` (bytes this rank sent,
        counted with compression or a message-passing algorithm, else 0)."""
        self.stats = {"comm_s": 0.0, "wait_s": 0.0, "steps": 0, "allreduces": 0, "sent_bytes": 0,
                      "skipped_steps": 0}

    @property
    def counts_bytes(self) -> bool:
        """Whether ``stats["sent_bytes"]`` counts: with compression, or with
        a message-passing algorithm (shared memory sends no messages)."""
        return self._counted

    def compression_state_dict(self) -> dict:
        """This rank's compression state: the step count, the error-feedback
        residuals and the compressor's own state (PowerSGD's warm start).
        Residuals differ from rank to rank: checkpoint every rank's."""
        return {"step": self._step,
                "memory": self.memory.state_dict() if self.memory is not None else None,
                "compressor": self.compression.state_dict() if hasattr(self.compression, "state_dict") else None}

    def load_compression_state_dict(self, state: dict) -> None:
        self._step = int(state["step"])
        if self.memory is not None and state.get("memory") is not None:
            self.memory.load_state_dict(state["memory"])
        if state.get("compressor") is not None and hasattr(self.compression, "load_state_dict"):
            self.compression.load_state_dict(state["compressor"])

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    @property
    def state(self):
        return self._optimizer.state

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._optimizer.load_state_dict(state_dict)

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self._optimizer).__name__}, ranks={self.size}, "
                f"algorithm={self.algorithm!r}, buckets={len(self._buckets)}, overlap={self.overlap!r})")


def cores_per_rank(comm: MPI.Comm) -> int:
    """Cores this rank may use: its affinity when the launcher bound it
    (e.g. mpirun's default binding to one core), else the node's cores
    shared among the ranks of ``comm`` on this node. Collective over ``comm``."""
    cpus = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    node.Free()
    return max(1, allowed) if allowed < cpus else max(1, allowed // local)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if not t.is_contiguous():
        raise ValueError("broadcast needs contiguous tensors")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.numpy()


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
    sig = np.array([len(tensors), zlib.crc32(";".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors).encode())],
                   dtype=np.int64)
    if not agree(sig, comm).all():
        counts = comm.allgather(len(tensors))
        raise ValueError(f"broadcast_parameters: ranks hold different tensors (counts per rank {counts}, "
                         "or different shapes/dtypes)")
    with torch.no_grad():
        for t in tensors:
            data = t.data if isinstance(t, torch.nn.Parameter) else t
            comm.Bcast(_as_numpy(data), root=root_rank)


def broadcast_optimizer_state(optimizer, root_rank: int = 0, comm: MPI.Comm | None = None) -> None:
    """Give every rank root's optimizer state (momentum buffers, Adam
    moments, step counts, hyper-parameters).

    The state dict is serialised with ``torch.save`` on root, sent as bytes
    (buffer ``Bcast``) and loaded with ``weights_only=True``.
    """
    comm = private(comm)
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if comm.Get_rank() == root_rank:
        raw = io.BytesIO()
        torch.save(inner.state_dict(), raw)
        payload = np.frombuffer(raw.getbuffer(), dtype=np.uint8).copy()
        n = np.array([payload.size], dtype=np.int64)
    else:
        n = np.zeros(1, dtype=np.int64)
    comm.Bcast(n, root=root_rank)
    if comm.Get_rank() != root_rank:
        payload = np.empty(int(n[0]), dtype=np.uint8)
    comm.Bcast(payload, root=root_rank)
    if comm.Get_rank() != root_rank:
        inner.load_state_dict(torch.load(io.BytesIO(payload.tobytes()), weights_only=True))
