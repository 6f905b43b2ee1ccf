"""The Horovod door's controller: the ranks agree, by name, on what to run.

Horovod matches operations across ranks by name, not by the order each rank
submits them, so its scripts may submit in different orders (a branch on
the rank, ``join``). So does this controller. Every call (``allreduce``,
``allgather``, ``broadcast``, ..., ``barrier``, ``join``) becomes a
*request*: its process set, its key (``<kind>.<name>``, or
``<kind>.noname.<n>`` with a per-kind counter, as Horovod names them), the
fields every rank must agree on (shapes, dtypes, op, root, ...), and any
error its arguments raised here. One thread per process (started by
``init``) runs the cycle:

1. **Requests.** New requests go to the coordinator, rank 0 of the ``hvd``
   communicator, in one message per cycle (its own go straight into its
   table), on a communicator of the controller's own.
2. **Negotiation.** The coordinator keeps a table: key -> the ranks that
   submitted it. A key is ready when every member of its process set that
   has not joined has submitted it. The ready keys of a cycle become
   *responses*, in the order they became ready; allreduces of one process
   set, dtype, device, op and scale factors are fused into one response up
   to ``HOROVOD_FUSION_THRESHOLD`` bytes (one buffer, one reduction by
   hpcjobs' ``auto``). A response carries an error instead when the ranks'
   fields differ (naming the ranks and their values), when some rank's
   arguments failed, or when a rank has joined and the operation is not an
   allreduce. The coordinator sends the cycle's responses to every rank.
3. **Execution.** Every rank runs the responses in the coordinator's
   order, each on its process set's communicator: one global order, so
   collectives on different process sets never wait on each other in a
   cycle. A rank that has joined runs the allreduces it did not submit
   with zeros of the agreed shapes and dtypes.

A key pending longer than ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (60 s;
``HOROVOD_STALL_CHECK_DISABLE=1`` turns it off) makes the coordinator print
Horovod's stall warning naming the missing ranks; ``hvd.synchronize``
waits under hpcjobs' watchdog, which ends a job that never completes
(``HPCJOBS_TIMEOUT``). ``HOROVOD_CYCLE_TIME`` (ms, default 1) is how long
the thread sleeps between cycles while it has nothing to do; within 5 ms of
a cycle that did something it polls every 50 us instead, since operations
come in bursts (a backward pass), and a worker with nothing in flight
sleeps until a call wakes it.

Without ``MPI_THREAD_MULTIPLE`` there is no thread: ``poll`` and
``synchronize`` run cycles on the calling thread.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait as futures_wait
from dataclasses import dataclass, field

from mpi4py import MPI

from ..collectives.watchdog import env_number
from ._coordinator import Coordinator

__all__ = ["Request", "Controller", "fusion_threshold", "ControllerError", "ControllerStopped"]

_REQUEST, _RESPONSE = 1, 2  # tags on the controller's communicator
_IDLE_S = 0.05  # a worker with nothing in flight sleeps this long unless a submit wakes it
_FAST_S, _BURST_S = 5e-5, 5e-3  # within 5 ms of work, the thread polls every 50 us, not every cycle
DEFAULT_FUSION_BYTES = 64 << 20  # Horovod 0.28's default HOROVOD_FUSION_THRESHOLD


def fusion_threshold(default: int = DEFAULT_FUSION_BYTES) -> int:
    """``HOROVOD_FUSION_THRESHOLD`` in bytes (0 turns fusion off), else ``default``."""
    return int(env_number("HOROVOD_FUSION_THRESHOLD", default, "bytes"))


class ControllerError(RuntimeError):
    """A response that carries an error (mismatch across ranks, a rank's bad
    arguments, an operation refused after ``join``)."""


class ControllerStopped(RuntimeError):
    """The operation will never run: ``hvd.shutdown()``, or the controller failed."""


@dataclass
class Request:
    """One rank's submitted operation (module docstring).

    ``job()`` returns the handle's result: for allreduce, after the
    controller has reduced ``tensors`` (fused with other requests'); for
    the other kinds it runs the collective itself. ``spec`` lists each
    tensor's shape and dtype, for a joined rank's zeros.
    """

    set_id: int
    key: str
    kind: str
    meta: dict
    error: BaseException | None
    nbytes: int = 0
    tensors: list = field(default_factory=list)
    spec: list = field(default_factory=list)
    job: Callable | None = None
    wrap: Callable = staticmethod(lambda fn: fn())  # runs fn on the caller's CUDA stream, if any
    future: Future = field(default_factory=Future)

    def wire(self) -> tuple:
        err = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        return self.set_id, self.key, self.kind, self.meta, err, self.nbytes, self.spec


class Controller:
    """The cycle of one process (module docstring). ``members(set_id)``
    returns a process set's global ranks (None while unknown here) and
    ``comm_of(set_id)`` its communicator for the collectives."""

    def __init__(self, comm: MPI.Intracomm, members: Callable, comm_of: Callable, threaded: bool):
        self.comm = comm  # the controller's own duplicate
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.members, self.comm_of = members, comm_of
        self.join_device = -1  # join()'s device: where a joined rank's zeros live
        self.fusion = fusion_threshold()
        self.cycle_s = env_number("HOROVOD_CYCLE_TIME", 1.0, "milliseconds") / 1000.0
        disabled = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "0") not in ("", "0")
        self.stall_s = 0.0 if disabled else env_number("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0)
        self._lock = threading.Lock()
        self._new: list[Request] = []  # submitted, not yet sent to the coordinator
        self._mine: dict[tuple, Request] = {}  # (set, key) -> this rank's request, sent, not yet run
        self._join: Request | None = None  # this rank's join, while it waits
        self._quit: Request | None = None  # this rank's shutdown, while it waits
        # The coordinator's table.
        self._coordinator = (Coordinator(self.size, members, self.fusion, self.stall_s) if self.rank == 0
                             else None)
        self._sends: list = []  # isend requests not yet complete
        # What this rank's controller did: cycles that found work, requests
        # submitted, responses run (a fused one counts once), tensors they carried.
        self.stats = {"cycles": 0, "requests": 0, "responses": 0, "tensors": 0}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="hpcjobs-hvd-controller", daemon=True)
            self._thread.start()

    # -- the caller's side ------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._lock:
            if self._stopping:
                raise ValueError("Horovod has been shut down; call hvd.init() first")
            self._new.append(request)
        self._wake.set()

    def wait(self, future: Future):
        """The result of ``future``, driving the cycle here when there is no thread."""
        if self._thread is None:
            while not future.done():
                if not self.cycle():
                    time.sleep(self.cycle_s)
        return future.result()

    def wait_for(self, future: Future, seconds: float) -> bool:
        """Whether ``future`` is done within ``seconds`` (driving the cycle here when there is no thread)."""
        if self._thread is None:
            deadline = time.monotonic() + seconds
            while not future.done() and time.monotonic() < deadline:
                if not self.cycle():
                    time.sleep(self.cycle_s)
            return future.done()
        return bool(futures_wait([future], timeout=seconds).done)

    def drive(self) -> None:
        """One cycle on the calling thread (``poll`` without a thread)."""
        if self._thread is None:
            self.cycle()

    def stop(self, wait_s: float = 10.0) -> None:
        """Shut down with the other ranks: ask the coordinator, go on serving
        until every rank has asked (a rank's operations may still need this
        one), then stop; every request not yet run fails. Like
        ``MPI_Finalize``, it waits for the ranks still at work, however long."""
        if not self._stopping:
            request = Request(0, "shutdown", "shutdown", {}, None)
            try:
                self.submit(request)
                self.wait(request.future)
            except Exception:  # the controller failed: nothing to agree with
                pass
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        deadline = time.monotonic() + wait_s  # the last responses on their way
        while self._sends and time.monotonic() < deadline:
            self._sends = [r for r in self._sends if not r.Test()]
            time.sleep(0.001)
        self._fail_pending(ControllerStopped("Horovod has been shut down. This was caused by hvd.shutdown() "
                                             "being called before this operation completed"))

    # -- the cycle -------------------------------------------------------------

    def _loop(self) -> None:
        last_busy = 0.0
        while not self._stopping:
            self._wake.clear()  # before the cycle takes the new requests: a submit after it wakes the wait
            try:
                busy = self.cycle()
            except BaseException as e:  # never leave a caller waiting on a dead thread
                self._fail_all(e)
                return
            now = time.monotonic()
            if busy:
                last_busy = now
                continue
            if now - last_busy < _BURST_S:  # operations come in bursts: answer the next one quickly
                wait = min(_FAST_S, self.cycle_s)
            elif self._mine or self._join or self._quit or self._coordinator:
                wait = self.cycle_s
            else:
                wait = _IDLE_S
            self._wake.wait(wait)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._stopping = True
        self._fail_pending(ControllerStopped(f"the Horovod controller failed: {type(error).__name__}: {error}"))

    def _fail_pending(self, error: ControllerStopped) -> None:
        """Every request of this rank not yet run fails with ``error``."""
        with self._lock:
            pending = [*self._new, *self._mine.values(), *(r for r in (self._join, self._quit) if r)]
            self._new, self._mine, self._join, self._quit = [], {}, None, None
        for r in pending:
            if not r.future.done():
                r.future.set_exception(error)

    def cycle(self) -> bool:
        """One round: send what is new, negotiate (coordinator), run what is
        ready. Returns whether anything happened."""
        with self._lock:
            new, self._new = self._new, []
        for r in new:
            if r.kind == "join":
                self._join = r
            elif r.kind == "shutdown":
                self._quit = r
            else:
                self._mine[(r.set_id, r.key)] = r
        wires = [r.wire() for r in new]
        responses = None
        if self.rank == 0:
            coordinator = self._coordinator
            coordinator.record(0, wires)
            status = MPI.Status()
            while self.comm.Iprobe(MPI.ANY_SOURCE, _REQUEST, status):
                source = status.Get_source()
                coordinator.record(source, self.comm.recv(source=source, tag=_REQUEST))
            responses = coordinator.negotiate()
            if responses:
                for dest in range(1, self.size):
                    self._send(responses, dest, _RESPONSE)
            coordinator.check_stalls()
        else:
            if wires:
                self._send(wires, 0, _REQUEST)
            if self.comm.Iprobe(0, _RESPONSE):
                responses = self.comm.recv(source=0, tag=_RESPONSE)
        if new or responses:  # counted first: running a response wakes its caller, who may read them at once
            st = self.stats
            st["cycles"] += 1
            st["requests"] += len(new)
            ran = [r for r in responses or () if r[1] not in ("join", "shutdown")]
            st["responses"] += len(ran)
            st["tensors"] += sum(len(r[2]) for r in ran)
        for response in responses or ():
            self._run(response)
        return bool(new or responses)

    def _send(self, obj, dest: int, tag: int) -> None:
        """Send without waiting for the receiver: a blocking send of a large
        message would wait for a receiver that may be inside a collective
        that waits for this rank (its requests in flight are kept until done;
        MPI keeps messages between two ranks in the order they were sent)."""
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends.append(self.comm.isend(obj, dest=dest, tag=tag))

    # -- every rank: running a response ---------------------------------------

    def _run(self, response: tuple) -> None:
        set_id, kind, keys, error, specs, meta = response
        if kind == "join":
            request, self._join = self._join, None
            if request is not None:
                request.future.set_result(specs[0])
            return
        if kind == "shutdown":  # every rank asked: this cycle is the last
            self._stopping = True
            if self._quit is not None:
                self._quit.future.set_result(None)
            return
        members = self.members(set_id)
        if members is None or self.rank not in members:
            return
        requests = [self._mine.pop((set_id, k), None) for k in keys]
        if error is not None:
            for r in requests:
                if r is not None:
                    r.future.set_exception(r.error if r.error is not None else ControllerError(error))
            return
        if self._join is None and any(r is None for r in requests):
            raise RuntimeError(f"hpcjobs.horovod controller: told to run {keys} that this rank never submitted")
        try:
            if kind == "allreduce":
                self._allreduce(set_id, requests, specs, meta)
            elif requests[0] is not None:
                requests[0].future.set_result(requests[0].job())
        except BaseException as e:
            for r in requests:
                if r is not None and not r.future.done():
                    r.future.set_exception(e)

    def _allreduce(self, set_id: int, requests: list, specs: list, meta: dict) -> None:
        """One reduction of every request's buffers, zeros where this rank
        joined and did not submit."""
        from ._collectives import allreduce, zeros
        from ._handles import _on_callers_stream as _on_device

        tensors = []
        for r, spec in zip(requests, specs):
            tensors.extend(r.tensors if r is not None else zeros(spec, meta["devices"], self.join_device))
        lead = next((r for r in requests if r is not None), None)
        wrap = lead.wrap if lead is not None else _on_device(tensors)  # joined: join(device)'s GPU, if any
        wrap(lambda: allreduce(tensors, meta["op"], float(meta["prescale"]), float(meta["postscale"]),
                               self.comm_of(set_id)))
        for r in requests:
            if r is not None:
                r.future.set_result(r.job())
