"""Handles: every ``hvd`` operation is a request to the controller.

Horovod's asynchronous calls (``allreduce_async`` and the others) return an
integer handle; ``poll(handle)`` says whether the operation has finished
and ``synchronize(handle)`` waits for it and returns its output. Here a
call becomes a :class:`~hpcjobs.horovod._controller.Request` and the
controller runs it once every rank of its process set has submitted the
same name (:mod:`~hpcjobs.horovod._controller`), so the ranks may submit
in different orders, as Horovod's may.

Names. ``name`` is per kind of operation and process set; an unnamed call
is ``<kind>.noname.<n>``, the n-th unnamed call of that kind on this rank,
so unnamed calls must come in the same order on every rank (as in
Horovod). A rank that has joined skips the calls the others make; when
``join`` returns, every rank is at the same point, and the count starts
again from 0 everywhere, so unnamed calls after a join match again. A name is in use from the call until the operation completes; a
second operation of the same kind under a name in use raises ValueError at
the call, as Horovod's duplicate-name check does.

Arguments. ``check()`` validates this rank's arguments at the call; what
it raises travels to the coordinator, so every rank of the set gets an
error rather than a hang: the rank whose arguments failed its own
exception (ValueError, TypeError), the others
:class:`HorovodMismatchError` naming it. Fields that differ across ranks
(shapes, dtypes, root, op, ...) raise HorovodMismatchError on every rank,
naming the ranks and their values.

GPU tensors. A job on a CUDA tensor runs on the controller's thread with
the caller's device and current stream (taken at the call), so it runs
after the kernels that produced the tensor and before those the caller
queues after ``synchronize``.

Errors. ``synchronize`` raises ValueError and TypeError as they are,
anything else as :class:`~hpcjobs.horovod._state.HorovodInternalError`
(a RuntimeError: what Horovod's users catch).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from ..collectives.agreement import MismatchError
from ..collectives.watchdog import enter, guard, leave
from ._controller import ControllerError, Request
from ._process_sets import resolve, watched_comm
from ._state import HorovodInternalError, world

__all__ = ["submit", "run", "poll", "synchronize", "clear", "restart_unnamed", "HorovodMismatchError"]


class HorovodMismatchError(HorovodInternalError, MismatchError):
    """The ranks' arguments to one operation disagree, or some rank's failed:
    a RuntimeError for Horovod's users, a MismatchError for hpcjobs'."""


_lock = threading.Lock()
_jobs: dict[int, Request] = {}  # handle -> request
_in_use: dict[tuple, Request] = {}  # (process set, key) -> its request, submitted and not yet complete here
_counter = itertools.count()
_unnamed: dict[tuple, itertools.count] = {}


def submit(kind: str, name, job: Callable, tensors=(), *, process_set=None, meta: dict | None = None,
           check: Callable | None = None, buffers: list | None = None, spec: list | None = None) -> int:
    """Submit an operation; returns its handle.

    Args:
        kind: "allreduce", "allgather", ...; names are per kind.
        name: the user's name, or None.
        job: returns the handle's result -- for allreduce, after the
            controller has reduced ``buffers``; otherwise it runs the
            collective (on the process set's communicator).
        tensors: the tensors it reads or writes (for the CUDA stream).
        meta: the fields every rank must agree on.
        check: validates this rank's arguments (module docstring).
        buffers, spec: allreduce only: the buffers to reduce, and each
            one's ``(shape, dtype)`` for a joined rank's zeros.

    Raises:
        ValueError: not initialized, a process set this rank cannot use,
            or ``name`` is in use.
    """
    w = world()
    set_id = resolve(process_set)[0]
    error = None
    if check is not None:
        try:
            check()
        except (TypeError, ValueError) as e:
            error = e
    meta = dict(meta or {})
    buffers = list(buffers or ())
    wrap = _on_callers_stream(tensors)
    request = Request(set_id, "", kind, meta, error, sum(b.numel() * b.element_size() for b in buffers),
                      buffers, list(spec or ()), job if kind == "allreduce" else (lambda: wrap(job)), wrap)
    with _lock:
        if name is None:
            n = next(_unnamed.setdefault((set_id, kind), itertools.count()))
            request.key = f"{kind}.noname.{n}"
        else:
            request.key = f"{kind}.{name}"
            if (set_id, request.key) in _in_use:
                raise ValueError(f"Requested to {kind} a tensor with the same name as another tensor that is "
                                 f"currently being processed: {name!r}")
        meta.setdefault("name", request.key)
        handle = next(_counter)
        _in_use[(set_id, request.key)] = request
        _jobs[handle] = request
    request.future.add_done_callback(lambda _: _release(request))
    w.controller.submit(request)
    return handle


def restart_unnamed() -> None:
    """Number unnamed calls from 0 again (on every rank, as ``join`` returns)."""
    with _lock:
        _unnamed.clear()


def _release(request: Request) -> None:
    """Free ``request``'s name (not one submitted again since under it)."""
    with _lock:
        if _in_use.get((request.set_id, request.key)) is request:
            del _in_use[(request.set_id, request.key)]


def run(kind: str, name, job: Callable, tensors=(), **kwargs):
    """:func:`submit`, then :func:`synchronize`: the blocking calls."""
    return synchronize(submit(kind, name, job, tensors, **kwargs))


def poll(handle: int) -> bool:
    """Whether the operation behind ``handle`` has finished.

    Raises:
        ValueError: an unknown handle (never issued, or synchronized already).
    """
    with _lock:
        request = _jobs.get(handle)
    if request is None:
        raise ValueError(f"unknown handle {handle!r}")
    world().controller.drive()
    return request.future.done()


def synchronize(handle: int):
    """Wait for the operation behind ``handle`` and return its output; None
    for a handle that is not in flight (Horovod's behaviour). The wait is
    watched: a name some rank never submits ends the job after
    ``HPCJOBS_TIMEOUT`` (hpcjobs.collectives.watchdog), never a silent hang."""
    with _lock:
        request = _jobs.get(handle)
    if request is None:
        return None
    try:
        if request.kind == "join":
            return _await_join(request)
        with guard(f"hvd.synchronize({request.key})", watched_comm(request.set_id)):
            future = request.future
            return future.result() if future.done() else world().controller.wait(future)
    except ControllerError as e:
        raise HorovodMismatchError(str(e)) from None
    except (ValueError, TypeError, HorovodInternalError):
        raise
    except Exception as e:
        raise HorovodInternalError(f"{request.key} failed: {type(e).__name__}: {e}") from e
    finally:  # the name is free once synchronize returns (the future's callback that frees it may come later)
        with _lock:
            _jobs.pop(handle, None)
        if request.future.done():
            _release(request)


def _await_join(request: Request):
    """``hvd.join``'s wait, watched by progress: the others may train for hours
    after this rank joined (uneven data is what join is for), this rank's
    controller running their collectives with zeros, each watched on its own.
    The wait's clock starts again whenever one of them has run, so
    ``HPCJOBS_TIMEOUT`` ends the job only when nothing has happened for that
    long (a rank that neither steps nor joins), not when training outlasts it."""
    controller, what, comm = world().controller, f"hvd.synchronize({request.key})", watched_comm(request.set_id)
    seen, token = None, None
    try:
        while True:
            ran = controller.stats["responses"]
            if ran != seen:
                if seen is not None:
                    leave(token)
                token, seen = enter(what, comm), ran
            if controller.wait_for(request.future, 1.0):
                return request.future.result()
    finally:
        if seen is not None:
            leave(token)


def clear() -> None:
    """Forget the names (at shutdown, after the controller stopped). The
    handles stay until synchronized: one still pending then raises
    HorovodInternalError ("shut down"), as in Horovod."""
    with _lock:
        _in_use.clear()
        _unnamed.clear()


def _on_callers_stream(tensors) -> Callable:
    """``wrap(fn)``: runs ``fn()`` with the caller's CUDA device and current
    stream (taken now) where ``tensors`` live on a GPU."""
    cuda = next((t for t in tensors if getattr(t, "is_cuda", False)), None)
    if cuda is None:
        return _plain
    import torch

    device, stream = cuda.device, torch.cuda.current_stream(cuda.device)

    def on_stream(fn):
        with torch.cuda.device(device), torch.cuda.stream(stream):
            return fn()

    return on_stream


def _plain(fn):
    return fn()
