"""Stall detection: a collective that does not finish in time ends the job.

A rank that never calls a collective the others are in -- it died without
the launcher noticing, it is stuck in a loop, or the program's control flow
differs between ranks -- leaves the others blocked in MPI forever. Horovod's
stall inspector warns after 60 s; we do the same and then abort:

- every hpcjobs collective registers itself (name, call number, start time)
  on entry and unregisters on exit -- a dictionary store, under a
  microsecond;
- a daemon thread wakes once a second. A collective in flight for longer
  than the warning threshold (``HPCJOBS_STALL_WARNING``, default 60 s) gets
  one warning on stderr; past the timeout (``HPCJOBS_TIMEOUT`` or
  ``hpcjobs --timeout``, default 300 s) the rank says which collective it
  waited in, and for how long, and calls ``MPI_Abort`` on COMM_WORLD, which
  ends every rank with a non-zero exit. The ranks that report are the ones
  that arrived; the ones missing from the reports are those that never did.

mpi4py releases the GIL inside blocking MPI calls, so the thread runs while
the main thread waits. A timeout of 0 turns the watchdog off.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

from mpi4py import MPI

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_WARNING", "set_timeout", "timeout", "guard"]

DEFAULT_TIMEOUT = 300.0
DEFAULT_WARNING = 60.0


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {text}")
    return value


_timeout = _env_seconds("HPCJOBS_TIMEOUT", DEFAULT_TIMEOUT)
_warning = _env_seconds("HPCJOBS_STALL_WARNING", DEFAULT_WARNING)
_inflight: dict[int, tuple[str, int, float]] = {}  # thread id -> (collective, call number, start)
_calls = itertools.count(1)
_thread: threading.Thread | None = None
_lock = threading.Lock()


def set_timeout(seconds: float, warning: float | None = None) -> None:
    """Abort after ``seconds`` in one collective (0: never); warn after
    ``warning`` (default: min(60 s, seconds / 2))."""
    global _timeout, _warning
    if seconds < 0 or (warning is not None and warning < 0):
        raise ValueError("timeouts must be >= 0 seconds")
    _timeout = float(seconds)
    _warning = float(warning) if warning is not None else min(DEFAULT_WARNING, _timeout / 2)


def timeout() -> float:
    return _timeout


def _watch() -> None:
    warned: set[tuple[int, int]] = set()
    rank = MPI.COMM_WORLD.Get_rank()
    while True:
        time.sleep(min(1.0, max(0.05, _warning / 4)) if _warning else 1.0)
        if not _timeout:
            continue
        now = time.monotonic()
        for tid, (what, call, t0) in list(_inflight.items()):
            waited = now - t0
            if waited > _timeout:
                print(f"hpcjobs: rank {rank}: {what} (call #{call}) did not complete within {_timeout:g} s: "
                      "a rank never arrived or died; aborting the job", file=sys.stderr, flush=True)
                MPI.COMM_WORLD.Abort(124)
                os._exit(124)  # where Abort returns
            if _warning and waited > _warning and (tid, call) not in warned:
                warned.add((tid, call))
                print(f"hpcjobs: warning: rank {rank} has waited {waited:.0f} s in {what} (call #{call}) for the "
                      f"other ranks; it aborts the job at {_timeout:g} s (HPCJOBS_TIMEOUT)", file=sys.stderr,
                      flush=True)


class guard:
    """``with guard("ring_allreduce"):`` -- the collective inside is watched."""

    __slots__ = ("what", "tid", "outer")

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        global _thread
        if not _timeout:
            self.tid = None
            return self
        if _thread is None:
            with _lock:
                if _thread is None:
                    _thread = threading.Thread(target=_watch, name="hpcjobs-watchdog", daemon=True)
                    _thread.start()
        self.tid = threading.get_ident()
        self.outer = _inflight.get(self.tid)  # a collective built on another one
        _inflight[self.tid] = (self.what, next(_calls), time.monotonic())
        return self

    def __exit__(self, *exc):
        if self.tid is not None:
            if self.outer is None:
                _inflight.pop(self.tid, None)
            else:
                _inflight[self.tid] = self.outer
        return False
