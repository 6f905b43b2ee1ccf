"""Handles: every ``hvd`` collective is a job on one worker thread.

Horovod's asynchronous calls (``allreduce_async`` and the others) return an
integer handle; ``poll(handle)`` says whether the operation has finished
and ``synchronize(handle)`` waits for it and returns its output. Horovod's
background thread negotiates, by name, which tensors every rank is ready to
reduce, so its ranks may submit them in different orders. hpcjobs has no
negotiation: each collective is a job on a single worker thread per process
(``ThreadPoolExecutor(max_workers=1)``, :mod:`~hpcjobs.horovod._state`) and
runs in the order it was called, so the ranks must call the collectives in
the same order -- which Horovod scripts do. The names the ranks give their
operations are checked against each other with the shapes
(:mod:`~hpcjobs.horovod._collectives`): ranks that called in different
orders get a MismatchError on every rank, not a sum of unrelated tensors.

Names. ``name`` (``<kind>.noname.<handle>`` when None) is in use from the
asynchronous call until ``synchronize`` returns its handle; a second
operation of the same kind under a name in use raises ValueError, as
Horovod's duplicate-name check does. Horovod frees a name when the
operation completes; here it is freed when the handle is synchronized, so
whether a reuse is refused never depends on timing.

GPU tensors. A job on a CUDA tensor runs on the worker with the caller's
device and current stream (taken at the call), so it runs after the
kernels that produced the tensor and before those the caller queues after
``synchronize``.

Errors. ``synchronize`` raises what the job raised: errors in the
arguments (ValueError, TypeError, MismatchError) as they are, anything else
as :class:`~hpcjobs.horovod._state.HorovodInternalError`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ._state import HorovodInternalError, world

__all__ = ["submit", "run", "poll", "synchronize", "clear"]

_lock = threading.Lock()
_jobs: dict[int, tuple[str, Future]] = {}  # handle -> (name in use, future)
_in_use: set[str] = set()
_counter = itertools.count()


def submit(kind: str, name: str | None, job: Callable, tensors=()) -> int:
    """Queue ``job()`` (a collective on the ``hvd`` communicator) behind the
    ones called before it; returns its handle.

    Args:
        kind: the operation ("allreduce", "allgather", ...); names are per kind.
        name: the user's name for the operation, or None.
        tensors: the tensors it reads or writes (for the CUDA stream).

    Raises:
        ValueError: not initialized, or ``name`` is in use.
    """
    w = world()
    job = _on_callers_stream(job, tensors)
    with _lock:
        handle = next(_counter)
        key = f"{kind}.{name}" if name is not None else f"{kind}.noname.{handle}"
        if key in _in_use:
            raise ValueError(f"Requested to {kind} a tensor with the same name as another tensor that is "
                             f"currently being processed: {name!r} (synchronize its handle first)")
        _in_use.add(key)
        # Submitting under the lock keeps the queue in call order across threads.
        future = w.executor.submit(job) if w.executor is not None else _run_now(job)
        _jobs[handle] = (key, future)
    return handle


def run(kind: str, name: str | None, job: Callable, tensors=()):
    """:func:`submit`, then :func:`synchronize`: the blocking calls."""
    return synchronize(submit(kind, name, job, tensors))


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` has finished.

    Raises:
        ValueError: an unknown handle (never issued, or synchronized already).
    """
    with _lock:
        entry = _jobs.get(handle)
    if entry is None:
        raise ValueError(f"unknown handle {handle!r}")
    return entry[1].done()


def synchronize(handle: int):
    """Wait for the operation behind ``handle`` and return its output; None
    for a handle that is not in flight (Horovod's behaviour)."""
    with _lock:
        entry = _jobs.get(handle)
    if entry is None:
        return None
    key, future = entry
    try:
        return future.result()
    except (ValueError, TypeError):
        raise
    except Exception as e:
        raise HorovodInternalError(f"{key} failed: {type(e).__name__}: {e}") from e
    finally:
        with _lock:
            _jobs.pop(handle, None)
            _in_use.discard(key)


def clear() -> None:
    """Forget every handle (at shutdown, after the worker has finished)."""
    with _lock:
        _jobs.clear()
        _in_use.clear()


def _run_now(job: Callable) -> Future:
    """``job`` run on the calling thread, as a finished future (MPI below
    ``THREAD_MULTIPLE``: no worker thread)."""
    future = Future()
    try:
        future.set_result(job())
    except Exception as e:
        future.set_exception(e)
    return future


def _on_callers_stream(job: Callable, tensors) -> Callable:
    cuda = next((t for t in tensors if t.is_cuda), None)
    if cuda is None:
        return job
    import torch

    device, stream = cuda.device, torch.cuda.current_stream(cuda.device)

    def on_stream():
        with torch.cuda.device(device), torch.cuda.stream(stream):
            return job()

    return on_stream
