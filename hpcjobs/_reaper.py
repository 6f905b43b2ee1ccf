"""The watchdog's last resort: make the launcher return after a rank's abort.

Run by path (``python -I -S _reaper.py RANK_PID DAEMON_PID GRACE REPORT_WAIT
[UNCLEAN_GRACE]``), so that it loads nothing of hpcjobs and no MPI (the
watchdog imports it only for its constants; it imports only the standard
library). It runs in a
session of its own and without the rank's stdout or stderr (a rank's open
stdout keeps Open MPI's daemon from counting that rank as ended), and reads
what the rank says on its stdin. Two ways to start it:

- **as a guardian**, from the rank's start (:func:`hpcjobs.collectives.watchdog.attach`,
  in an ``mpirun`` launch that spans more than one host), with
  ``REPORT_WAIT`` ``eof``: it sleeps in a read until the rank's end. A rank
  that ends cleanly writes ``clean`` first (an ``atexit`` hook, before
  MPI_Finalize) and the guardian exits. A rank that ends without a word --
  killed, ``os._exit``, or aborted in C by Open MPI's own error handler
  ("An MPI communication peer process has unexpectedly disconnected",
  ERRORS_ARE_FATAL on a NULL communicator) -- is an exit without
  MPI_Finalize, on which PRRTE ends the whole job. If the daemon is still
  there ``UNCLEAN_GRACE`` seconds later, the job is stuck (seen once in
  about twenty remote rank kills on the emulated cluster: every rank gone,
  ``prterun`` waiting forever) and the guardian kills it as below;
- **as the watchdog's reaper**, when a collective times out (by the
  guardian where there is one), before the rank asks the others where they
  are, so a rank killed by another's abort meanwhile has one too; the rank
  writes its report's headline to the reaper's stdin, then calls MPI_Abort.

MPI_Abort asks the rank's launcher daemon (``prted``, or ``prterun``/``mpirun``
itself on the first node) to end the job everywhere. When a host is cut off
the network, that daemon waits for the lost host's daemon forever: the ranks
on the surviving hosts have ended, but the user's ``mpirun`` never returns,
and ``SIGTERM`` does not end it (a second ``SIGINT`` does, with exit status
0, which would read as success). If the daemon is still there ``GRACE``
seconds after the abort, this says so on the daemon's stderr (for
``mpirun``, the user's terminal), ends the rank if its abort never returned
(a rank on the lost host), and kills the daemon: ``mpirun`` returns 137.
Its session folder stays in ``$TMPDIR``; ``hpcjobs.runtime.clear_stale_mpi_sessions``
(run by the suite's scripts before each launch) removes it. Once ``mpirun``
has ended, the daemons on the other surviving hosts lose their connection
to it and exit by themselves; a rank's reaper kills its node's daemon only
later (``2 * GRACE + 1`` s), for the case where ``mpirun``'s own node is the
one cut off or runs no rank: then the job's exit status is up to PRRTE,
which has been seen to exit 0 on a lost daemon.
"""

import os
import select
import signal
import sys
import time

# Only these parents are ended: Open MPI's and PRRTE's launchers and daemons.
# A rank started by srun (slurmstepd) or another MPI's launcher is left alone.
LAUNCHERS = {"prterun", "prte", "mpirun", "mpiexec", "orterun"}  # the job's launcher: the user's mpirun
DAEMONS = {"prted", "orted"}  # its daemons on the other nodes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _started(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat's 22nd field): a pid used again by another
    process has another; "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return not _alive(pid)


def _say(daemon: int, text: str) -> None:
    """One line on the launcher's own stderr (for mpirun, the user's terminal)."""
    try:
        with open(f"/proc/{daemon}/fd/2", "w") as f:
            f.write(text + "\n")
    except OSError:
        pass


def _read_report(deadline: float) -> str:
    """The rank's report on stdin, up to EOF (the rank wrote it, or died) or the deadline (inf: EOF only)."""
    chunks = []
    try:
        fd = sys.stdin.fileno()
        while True:
            left = None if deadline == float("inf") else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
                break
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
    except (OSError, ValueError):
        pass
    return b"".join(chunks).decode(errors="replace")


CLEAN = "clean"  # what a rank writes when it ends cleanly (the guardian then exits)


def main(argv: list[str]) -> int:
    rank, daemon, grace = int(argv[1]), int(argv[2]), float(argv[3])
    guardian = argv[4] == "eof"
    unclean_grace = float(argv[5]) if len(argv) > 5 else grace
    start, born = time.monotonic(), _started(rank)
    name = _comm(daemon)
    if name not in LAUNCHERS | DAEMONS:
        return 0
    report = _read_report(float("inf") if guardian else start + float(argv[4])).strip()
    if report == CLEAN:
        return 0
    headline = report.splitlines()[0] if report else ""
    if not headline:  # the rank ended without a word: not the watchdog's abort
        grace = unclean_grace
    # A node daemon waits longer: when its death is what tells mpirun, PRRTE
    # reports the lost daemon and exits 0 (read as success), so mpirun's own
    # node, whose reaper kills it (exit 137), goes first.
    wait = grace if name in LAUNCHERS else 2 * grace + 1  # counted from the abort (the report's arrival)
    if _wait_gone(daemon, wait):
        return 0
    if _comm(daemon) != name:
        return 0  # its pid went to another process
    host = os.uname().nodename
    # What the rank said: its stderr, forwarded by the daemon, may never
    # arrive (PRRTE holds a stuck job's output); the headline names the
    # ranks that did not answer.
    if headline:
        why = f"{headline}\nhpcjobs: {name} (pid {daemon}) on {host} had not ended the job {grace:g} s after MPI_Abort"
    else:
        why = (f"hpcjobs: a rank (pid {rank}) on {host} ended without MPI_Finalize (killed, or aborted by MPI's "
               f"error handler) and {name} (pid {daemon}) had not ended the job {grace:g} s later")
    _say(daemon, why + " (a host cut off or dead?); killing it so the launch returns")
    if _alive(rank) and _started(rank) == born:  # (seconds later its pid may be another process's)
        try:
            os.kill(rank, signal.SIGKILL)
        except OSError:
            pass
    if _comm(daemon) == name:
        try:
            os.kill(daemon, signal.SIGKILL)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
