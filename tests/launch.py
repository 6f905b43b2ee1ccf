"""Launching hpcjobs as a user does: real mpirun, a clean environment.
Imported by the command-line tests (tests/ is on sys.path via its conftest)."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest


def require(missing: str | None, flag: str = "HPCJOBS_REQUIRE_HOROVOD") -> None:
    """Go on when ``missing`` is None; otherwise skip with that reason, or fail
    where ``flag`` is 1 (CI sets it: what a test needs must be there)."""
    if missing is None:
        return
    if os.environ.get(flag) == "1":
        pytest.fail(f"{flag}=1 but {missing}")
    pytest.skip(missing)


def clean_env():
    # A clean launch: no MPI variables inherited from a pytest that may itself
    # run as an MPI singleton.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_", "PMI_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _mpirun_prefix(n):
    exe = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if exe is None:
        pytest.fail("no mpirun next to the interpreter or on PATH (scripts/test.sh installs one)")
    over = ["--oversubscribe"] if "Open MPI" in subprocess.run([exe, "--version"], capture_output=True,
                                                               text=True, env=clean_env()).stdout else []
    return [exe, *over, "-n", str(n), sys.executable]


@contextlib.contextmanager
def launch_env(env=None):
    """clean_env() with a TMPDIR of this launch's own, removed afterwards.

    Open MPI 5's mpirun keeps its session in $TMPDIR/ompi.<its pid> and
    removes it on exit, but not when it is killed (a test that SIGKILLs a
    job, a timeout). A later mpirun given the same pid (pid_max is 32768
    here, and a test run starts tens of thousands of processes) then finds
    the old rendezvous file and fails with "The PMIx server's listener
    thread failed to start". A private TMPDIR can hold no one else's
    leftovers, and this launch's own go with it."""
    with tempfile.TemporaryDirectory(prefix="hpcjobs-launch-", ignore_cleanup_errors=True) as tmp:
        yield clean_env() | {"TMPDIR": tmp} | (env or {})


def session_pids(sid):
    """The processes of session ``sid``. mpirun puts every rank in a process
    group of its own, so killing mpirun's group leaves the ranks running
    (they go on computing, and writing files, without it); a launch started
    with ``start_new_session=True`` keeps them all in the session that bears
    mpirun's pid."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def kill_session(sid):
    """SIGKILL mpirun and every rank it started: the whole job at once, as a
    node failure or the batch system would."""
    for pid in session_pids(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class LaunchTimeout(subprocess.TimeoutExpired):
    """subprocess.TimeoutExpired whose message carries the tail of what the
    launch printed before it was ended: a hang in CI shows where it stood."""

    def __str__(self):
        return (f"{super().__str__()}\n--- stdout (tail) ---\n{(self.stdout or '')[-2000:]}"
                f"\n--- stderr (tail) ---\n{(self.stderr or '')[-4000:]}")


def run(cmd, timeout, env):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout),
    except that a launch that runs out of time is ended whole: mpirun gets
    SIGTERM (it stops its ranks and removes its session folder), and after
    10 s whatever is left of its session gets SIGKILL. Plain subprocess.run
    kills mpirun alone, and its ranks would spin on for the rest of the test
    run."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                kill_session(proc.pid)
                out, err = proc.communicate()
            raise LaunchTimeout(cmd, timeout, out, err) from None
        finally:
            kill_session(proc.pid)  # ranks that outlived mpirun, if any
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def mpirun(n, *args, timeout=120, env=None):
    with launch_env(env) as e:
        return run([*_mpirun_prefix(n), "-m", "hpcjobs", *args], timeout, e)


def mpirun_script(n, script, timeout=120, env=None):
    """Run a Python ``script`` (source text) on ``n`` ranks."""
    with launch_env(env) as e:
        return run([*_mpirun_prefix(n), "-c", script], timeout, e)


def main_in_one_launch(n, commands, timeout=300, env=None):
    """Each of ``commands`` (argument lists of ``hpcjobs``) through the
    command line's ``main`` on ``n`` ranks, one after another in one launch:
    for refusals, where a launch each spent seconds starting MPI and torch
    for a line of stderr. Returns, per command, per rank, (exit status,
    stdout, stderr). Collective calls inside a command meet as in a launch of their
    own; the ranks wait for each other between commands, on a communicator
    of their own. For refusals only: what a command sets for the process
    (the checks off in a benchmark, torch's threads) stays for the next."""
    import json

    with tempfile.TemporaryDirectory() as out:
        done = mpirun_script(n, f"""
import contextlib, io, json
from mpi4py import MPI
from hpcjobs.cli import main
between = MPI.COMM_WORLD.Dup()  # not the commands' own: a barrier of theirs one rank skipped must not meet this
rows = []
for argv in {json.dumps([list(c) for c in commands])}:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
    rows.append([rc, out.getvalue(), err.getvalue()])
    between.Barrier()
with open({out!r} + f"/rank{{MPI.COMM_WORLD.Get_rank()}}.json", "w") as f:
    json.dump(rows, f)
""", timeout=timeout, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        ranks = [json.load(open(f"{out}/rank{r}.json")) for r in range(n)]
    return [[tuple(ranks[r][i]) for r in range(n)] for i in range(len(commands))]


def hpcjobs_here(*args):
    """``hpcjobs ARGS`` through the command line's ``main`` in this process,
    as ``hpcjobs()`` returns it: for refusals of commands that start no MPI
    (plan, slurm render), which spent a second each starting Python. This
    process may have MPI started, so that a command starts none is checked
    in a fresh process (test_planner, slurm/test_render)."""
    import io

    from hpcjobs.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
    return subprocess.CompletedProcess(["hpcjobs", *args], rc, out.getvalue(), err.getvalue())


def hpcjobs(*args):
    return subprocess.run([sys.executable, "-m", "hpcjobs", *args], capture_output=True, text=True,
                          timeout=60, env=clean_env())


def in_a_forked_child(check) -> int:
    """``check()`` in a forked child, which leaves with os._exit: its exit code (1 for False or an error, 9 when it
    had not answered in 30 s and was killed)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if check() else 1)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return 9
