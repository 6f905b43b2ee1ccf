"""Stall detection: a collective that does not finish in time ends the job.

A rank that never calls a collective the others are in -- it died without the launcher noticing, it is stuck in a
loop, or the program's control flow differs between ranks -- leaves the others blocked in MPI forever. Horovod's
stall inspector warns after 60 s; we do the same and then abort:

- every hpcjobs collective registers itself (name, call number, start time)
  on entry and unregisters on exit -- a dictionary store, under a
  microsecond;
- a daemon thread wakes once a second. A collective in flight for longer than the warning threshold
  (``HPCJOBS_STALL_WARNING``, default 60 s) gets one warning on stderr; past the timeout (``HPCJOBS_TIMEOUT`` or
  ``hpcjobs --timeout``, default 300 s) the rank says which collective it waited in, and for how long, asks every
  other rank where it is (below), prints the answers, and calls ``MPI_Abort`` on COMM_WORLD, which ends every rank
  with a non-zero exit. Where a host has dropped off the network, Open MPI's launcher waits for that host's daemon
  forever after the abort; :mod:`hpcjobs._reaper`, started when the collective times out, kills the launcher if it
  has not ended the job :data:`LAUNCHER_GRACE` seconds after the abort, so the user's ``mpirun`` returns. In an
  ``mpirun`` launch across hosts each rank starts that process at its first collective (:func:`attach`) as a
  guardian: it stands down at the rank's clean end (an ``atexit`` word, before MPI_Finalize) and otherwise kills a
  launcher still there :data:`UNCLEAN_GRACE` seconds after the rank ended (killed, or aborted by Open MPI's own
  error handler on a lost peer).

Which ranks never arrived: the first hpcjobs collective on COMM_WORLD (the CLI makes one at start) also duplicates
COMM_WORLD for the watchdog (:func:`attach`). From then on every rank's watchdog thread answers, once a second, a
query on that communicator with where its main thread is: which collective and call number it waits in and for how
long, or that it is in none and which it entered last. A rank past the timeout queries all the others and waits up
to :data:`ANSWER_WAIT` seconds, so the report reads::

    hpcjobs: rank 0: ring_allreduce (call #2) did not complete within 3 s; ranks not in ring_allreduce: 2; aborting the job
      rank 0: waiting 3 s in ring_allreduce (call #2)
      rank 1: waiting 3 s in ring_allreduce (call #2)
      rank 2: in no hpcjobs collective; the last it entered was ring_allreduce (call #1)

A rank that does not answer (dead, or stuck in C code that holds the GIL) is listed as such. Answering needs
``MPI_THREAD_MULTIPLE`` (mpi4py asks for it); without it the report names only the rank that timed out. mpi4py
releases the GIL inside blocking MPI calls, so the thread runs while the main thread waits. A timeout of 0 turns the
watchdog off."""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time

from mpi4py import MPI

from .. import _reaper
from ..comm import ranks_in

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_WARNING", "ANSWER_WAIT", "set_timeout", "timeout", "guard", "enter", "leave",
           "attach", "env_number"]

DEFAULT_TIMEOUT = 300.0
DEFAULT_WARNING = 60.0
ANSWER_WAIT = 3.0  # seconds a timed-out rank waits for the others to say where they are
LAUNCHER_GRACE = 3.0  # seconds after MPI_Abort before the launcher is killed (hpcjobs._reaper)
UNCLEAN_GRACE = 10.0  # seconds after a rank's end without MPI_Finalize before its guardian kills the launcher
_QUERY, _ANSWER = 1, 2  # tags on the watchdog's own communicator


def env_number(name: str, default: float, unit: str = "seconds") -> float:
    """The environment variable ``name`` as a number >= 0 of ``unit``; ``default`` when unset or empty.

    Raises:
        ValueError: not a number, or negative (naming the variable and the unit).
    """
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of {unit}") from None
    if not 0 <= value < float("inf"):  # nan and inf too, as --timeout refuses them (0 is never)
        raise ValueError(f"{name} must be >= 0 {unit}, got {text}")
    return value


def _from_environment() -> tuple[float, float, str | None]:
    """HPCJOBS_TIMEOUT and HPCJOBS_STALL_WARNING (the warning before the
    abort), or the defaults and why not. Not raised here at import, where it
    would end this rank alone while the others wait for it in MPI:
    :mod:`hpcjobs.comm` reports it on every rank as each communicator's
    duplicate is made (and :func:`set_timeout` does not clear it)."""
    try:
        timeout = env_number("HPCJOBS_TIMEOUT", DEFAULT_TIMEOUT)
        return timeout, env_number("HPCJOBS_STALL_WARNING", min(DEFAULT_WARNING, timeout / 2)), None
    except ValueError as e:
        return DEFAULT_TIMEOUT, DEFAULT_WARNING, str(e)


_timeout, _warning, ENV_ERROR = _from_environment()
# thread id -> (collective, call number, start, communicator or None: world, its limit or None: HPCJOBS_TIMEOUT)
_inflight: dict[int, tuple] = {}
_last: tuple | None = None  # the collective entered last, in flight or not (as in _inflight)
_calls = itertools.count(1)
_thread: threading.Thread | None = None
_lock = threading.Lock()
_reports = None  # the watchdog's duplicate of COMM_WORLD, once attached
_mpi_lock = threading.Lock()  # held by the thread around its MPI calls; atexit takes it for good
_guardian = None  # this rank's hpcjobs._reaper, started by attach() in an mpirun launch across hosts


def set_timeout(seconds: float, warning: float | None = None) -> None:
    """Abort after ``seconds`` in one collective (0: never); warn after
    ``warning`` (default: ``HPCJOBS_STALL_WARNING``, else min(60 s, seconds / 2))."""
    global _timeout, _warning
    if seconds < 0 or (warning is not None and warning < 0):
        raise ValueError("timeouts must be >= 0 seconds")
    _timeout = float(seconds)
    if warning is None:
        warning = env_number("HPCJOBS_STALL_WARNING", min(DEFAULT_WARNING, _timeout / 2))
    _warning = float(warning)


def timeout() -> float:
    return _timeout


def attach(world_dup) -> None:
    """Let the watchdog answer and ask "where are you?" on ``world_dup``, a
    duplicate of COMM_WORLD made collectively for it (:func:`hpcjobs.comm.private`
    does this with the first collective on COMM_WORLD). Starts the thread."""
    global _reports, _guardian
    if _guardian is None and _spans_hosts():
        _guardian = _start_reaper(guardian=True)
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE or _reports is not None:
        return
    world_dup.Set_errhandler(MPI.ERRORS_RETURN)
    _reports = world_dup
    _start()


def _start() -> None:
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_watch, name="hpcjobs-watchdog", daemon=True)
            _thread.start()


def _forget_guardian() -> None:
    """In a child forked from a rank (a DataLoader worker): the guardian is
    the rank's, not the child's. Close the child's copy of its pipe, so the
    guardian sees EOF when the rank ends, and never say "clean" for it."""
    global _guardian
    if _guardian is not None:
        try:
            _guardian.stdin.close()
        except (OSError, ValueError):
            pass
        _guardian = None


os.register_at_fork(after_in_child=_forget_guardian)


@atexit.register
def _stop() -> None:
    # Runs before mpi4py finalizes MPI (atexit is last in, first out): after
    # this the thread makes no MPI call.
    global _reports, _guardian
    _mpi_lock.acquire()
    _reports = None
    if _guardian is not None:  # a clean end: the guardian stands down
        _tell_reaper(_guardian, _reaper.CLEAN)
        _guardian = None


def _where() -> tuple:
    """This rank's state for a query: ("in", what, call, seconds, its communicator's ranks or None: all) or
    ("last", what, call) or ("none",)."""
    now = time.monotonic()
    inflight = list(_inflight.values())
    if inflight:
        what, call, t0, comm = min(inflight, key=lambda e: e[2])[:4]
        return ("in", what, call, now - t0, _members(comm))
    if _last is not None:
        return ("last", _last[0], _last[1])
    return ("none",)


def _answer_queries() -> None:
    """Answer every pending "where are you?" (under ``_mpi_lock``)."""
    status = MPI.Status()
    while _reports.Iprobe(MPI.ANY_SOURCE, _QUERY, status):
        source = status.Get_source()
        _reports.recv(source=source, tag=_QUERY)
        _reports.send(_where(), dest=source, tag=_ANSWER)


def _ask_everyone(rank: int) -> dict[int, tuple]:
    """Ask every other rank where it is; wait up to ANSWER_WAIT for the answers."""
    size = _reports.Get_size()
    sends = [_reports.isend(None, dest=r, tag=_QUERY) for r in range(size) if r != rank]
    pending = {r: _reports.irecv(source=r, tag=_ANSWER) for r in range(size) if r != rank}
    answers = {rank: _where()}
    deadline = time.monotonic() + ANSWER_WAIT
    while pending and time.monotonic() < deadline:
        _answer_queries()  # other timed-out ranks ask us at the same time
        for r, req in list(pending.items()):
            done, value = req.test()
            if done:
                answers[r] = value
                del pending[r]
        time.sleep(0.01)
    for req in sends:
        req.test()
    return answers


def _describe(state: tuple | None) -> str:
    if state is None:
        return f"no answer within {ANSWER_WAIT:g} s (dead, exiting, or stuck in code that holds the GIL)"
    if state[0] == "in":
        return f"waiting {state[3]:.0f} s in {state[1]} (call #{state[2]})"
    if state[0] == "last":
        return f"in no hpcjobs collective; the last it entered was {state[1]} (call #{state[2]})"
    return "in no hpcjobs collective; it has not entered one yet"


def _members(comm) -> list[int] | None:
    """The COMM_WORLD ranks of ``comm`` (None: all of them, or where they cannot be told)."""
    if comm is None:
        return None
    try:
        ranks = ranks_in(comm)
    except Exception:  # noqa: BLE001 -- the report goes on without: the job must still end
        return None
    return None if MPI.UNDEFINED in ranks else sorted(ranks)


def _report(what: str, call: int, rank: int, comm=None, limit: float | None = None) -> str:
    """The timeout message, with every rank's answer where the watchdog is
    attached; on a communicator of some ranks only, the others are listed
    as outside it, not as missing from the collective."""
    head = f"hpcjobs: rank {rank}: {what} (call #{call}) did not complete within {limit or _timeout:g} s"
    with _mpi_lock:
        if _reports is None:
            return head + ": a rank never arrived or died; aborting the job"
        size = _reports.Get_size()
        try:
            answers = _ask_everyone(rank)
        except MPI.Exception as e:
            return head + f" (could not ask the other ranks: {e}); aborting the job"
        members = _members(comm) or list(range(size))  # MPI calls too: under the lock, as _stop expects
    states, world = [answers.get(r) for r in range(size)], list(range(size))
    # in the same collective on another communicator (a cross-group deadlock): as missing as a rank elsewhere
    other = {r: s[4] or world for r, s in enumerate(states)
             if s and s[:2] == ("in", what) and (s[4] or world) != members}
    missing = [r for r in members if not (states[r] and states[r][:2] == ("in", what)) or r in other]
    outside = "" if len(members) == size else f" (its communicator: ranks {', '.join(map(str, members))})"
    lines = [head + outside + (f"; ranks not in {what}: {', '.join(map(str, missing))}" if missing else "")
             + "; aborting the job"]
    lines += [f"  rank {r}: {_describe(s)}" + (f" on ranks {', '.join(map(str, other[r]))}" if r in other else "")
              + ("" if r in members else " (outside the communicator)") for r, s in enumerate(states)]
    return "\n".join(lines)


_REAPER = _reaper.__file__  # run by path in a process of its own; imported here for its constants only


def _spans_hosts() -> bool:
    """Whether this rank was started by Open MPI's launcher or one of its
    daemons in a job with ranks on more than one host (where a lost peer can
    leave the launcher waiting forever)."""
    try:
        size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
        local = int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
        with open(f"/proc/{os.getppid()}/comm") as f:
            parent = f.read().strip()
    except (KeyError, ValueError, OSError):
        return False
    return local < size and parent in _reaper.LAUNCHERS | _reaper.DAEMONS


def _start_reaper(guardian: bool = False):
    """Start the last resort (:mod:`hpcjobs._reaper`) that makes the launcher
    return if MPI_Abort cannot end the job within ANSWER_WAIT +
    LAUNCHER_GRACE seconds of now (a host cut off the network); with
    ``guardian``, one that waits for this rank's end and does the same
    UNCLEAN_GRACE seconds after an end without a clean word. Returns the
    process (its stdin takes the report) or None. Never raises."""
    try:
        import subprocess

        wait = ["eof", f"{UNCLEAN_GRACE:g}"] if guardian else [f"{ANSWER_WAIT + 1:g}"]
        return subprocess.Popen(
            [sys.executable, "-I", "-S", _REAPER, str(os.getpid()), str(os.getppid()), f"{LAUNCHER_GRACE:g}", *wait],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            close_fds=True)
    except Exception:
        return None


def _tell_reaper(reaper, report: str) -> None:
    """Give the reaper the report's headline (one line: a write that cannot
    fill the pipe and block this rank before its abort)."""
    if reaper is None:
        return
    try:
        reaper.stdin.write(report.split("\n", 1)[0][:4000].encode(errors="replace") + b"\n")
        reaper.stdin.close()
    except Exception:
        pass


def _watch() -> None:
    warned: set[tuple[int, int]] = set()
    rank = MPI.COMM_WORLD.Get_rank()
    while True:
        time.sleep(min(1.0, max(0.05, _warning / 4)) if _warning else 1.0)
        try:  # whatever fails (a stderr that cannot be written), the thread goes on watching
            _look(rank, warned)
        except Exception:  # noqa: BLE001 -- it had ended the thread, and no timeout came again
            pass


def _look(rank: int, warned: set) -> None:
    """One look: answer the other ranks' queries, end the job where a call waited past its limit, warn."""
    if _reports is not None and _mpi_lock.acquire(blocking=False):
        try:
            if _reports is not None:
                _answer_queries()
        except MPI.Exception:
            pass  # a peer gone: the launcher or a timeout ends the job
        finally:
            _mpi_lock.release()
    if not _timeout:
        return
    now = time.monotonic()
    for tid, (what, call, t0, comm, limit) in list(_inflight.items()):
        waited = now - t0
        if waited > (limit or _timeout):
            report = f"hpcjobs: rank {rank}: {what} (call #{call}) did not complete in time; aborting the job"
            try:  # each part on its own: the abort below comes whatever fails before it
                alive = _guardian is not None and _guardian.poll() is None
                reaper = _guardian if alive else _start_reaper()
                report = _report(what, call, rank, comm, limit)
                print(report, file=sys.stderr, flush=True)
                _tell_reaper(reaper, report)
            finally:
                MPI.COMM_WORLD.Abort(124)
                os._exit(124)  # where Abort returns
        if _warning and waited > _warning and (tid, call) not in warned:
            warned.add((tid, call))
            print(f"hpcjobs: warning: rank {rank} has waited {waited:.0f} s in {what} (call #{call}) for the "
                  f"other ranks; it aborts the job at {limit or _timeout:g} s "
                  f"({'its own limit' if limit else 'HPCJOBS_TIMEOUT'})", file=sys.stderr, flush=True)


def enter(what: str, comm=None, limit: float | None = None):
    """Register the calling thread as in the collective ``what`` on ``comm`` (None: COMM_WORLD); returns the
    token :func:`leave` takes. The frame of every collective calls the pair (cheaper than :class:`guard` on small
    messages, where every call's bookkeeping counts). ``limit``: seconds this call may wait instead of
    HPCJOBS_TIMEOUT (a torch process group's timeout), which the collectives it is built on inherit; the
    watchdog off (timeout 0) stays off."""
    global _last
    if not _timeout:
        return _OFF
    if _thread is None:
        _start()
    tid = _get_ident()
    outer = _inflight.get(tid)  # a collective built on another one: its limit holds inside
    if limit is None and outer is not None:
        limit = outer[4]
    _inflight[tid] = _last = (what, next(_calls), _monotonic(), comm, limit)
    return outer


def leave(token) -> None:
    """Unregister what :func:`enter` registered (``token``: its return)."""
    if token is None:
        _inflight.pop(_get_ident(), None)
    elif token is not _OFF:
        _inflight[_get_ident()] = token


_OFF = ("off",)  # enter's token with the watchdog off
_get_ident, _monotonic = threading.get_ident, time.monotonic


class guard:
    """``with guard("ring_allreduce", comm):`` -- the collective inside is
    watched (:func:`enter` and :func:`leave` as a context manager)."""

    __slots__ = ("what", "comm", "limit", "token")

    def __init__(self, what: str, comm=None, limit: float | None = None):
        self.what, self.comm, self.limit = what, comm, limit

    def __enter__(self):
        self.token = enter(self.what, self.comm, self.limit)
        return self

    def __exit__(self, *exc):
        leave(self.token)
        return False
