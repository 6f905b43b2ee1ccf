"""The emulated cluster under the tests: scripts/emulated_cluster.sh, driven
as a user drives it. tests/conftest.py's ``emulated_cluster`` fixture brings
it up once per test session (3 hosts, unshaped links) and down at the end;
tests/cluster and tests/slurm use it.

Where it cannot be brought up (not root, no ``ip netns`` permission) the
tests that need it skip with the script's reason, unless
HPCJOBS_REQUIRE_CLUSTER=1 (CI sets it), which turns the skip into a failure.
"""

import fcntl
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from launch import clean_env, launch_env, run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "emulated_cluster.sh"
HOSTS = 3
# One emulated cluster per machine (its names and /run/hpcjobs-emu are fixed): a test session holds this
# lock from bringing it up to taking it down, and a second session is refused instead of tearing the
# first one's hosts down under it.
LOCK = Path("/run/hpcjobs-emu.lock")


def _env(extra=None):
    # HPCJOBS_EMU_LOCKED: this session holds the script's lock (start() takes it before anything runs)
    return clean_env() | {"HPCJOBS_VENV": sys.prefix, "HPCJOBS_EMU_LOCKED": "1"} | (extra or {})


class Cluster:
    """A running emulated cluster of ``hosts`` hosts, h1..hN."""

    def __init__(self, hosts: int, lock_fd: int | None = None):
        self.hosts, self.lock_fd = hosts, lock_fd

    def script(self, *args, timeout=120, check=True, env=None):
        proc = subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              env=_env(env))
        if check and proc.returncode != 0:
            raise AssertionError(f"emulated_cluster.sh {' '.join(map(str, args))} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def mpirun(self, hosts: str, n: int, *cmd, timeout=300, env=None):
        """``emulated_cluster.sh mpirun --host HOSTS -n N CMD...`` with a clean
        environment and a TMPDIR of its own (launch.launch_env)."""
        with launch_env(_env(env)) as e:
            return run([str(SCRIPT), "mpirun", "--host", hosts, "-n", str(n), *map(str, cmd)], timeout, e)

    def popen(self, hosts: str, n: int, *cmd, env=None, tmpdir=None):
        """The same launch, started and left running (the fault tests)."""
        e = _env(env) | ({"TMPDIR": str(tmpdir)} if tmpdir else {})
        return subprocess.Popen([str(SCRIPT), "mpirun", "--host", hosts, "-n", str(n), *map(str, cmd)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e,
                                start_new_session=True)

    def exec_prefix(self, host: str) -> list[str]:
        return [str(SCRIPT), "exec", host, "--"]

    @contextmanager
    def serve(self, host: str, code: str, seconds: float = 20):
        """``python -c code`` started inside ``host``, once it has printed
        "listening"; afterwards given ``seconds`` to end on its own, then killed."""
        proc = subprocess.Popen([*self.exec_prefix(host), sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.stdout.readline().strip() == "listening"
            yield proc
        finally:
            deadline = time.monotonic() + seconds
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def pids(self, host: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", f"emu-{host}"], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def processes(self, host: str, needle: str) -> list[int]:
        """The processes in ``host`` whose command line contains ``needle``."""
        found = []
        for pid in self.pids(host):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if needle in cmdline:
                found.append(pid)
        return found

    def wait_no_processes(self, host: str, needle: str, seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        while (left := self.processes(host, needle)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def cut(self, host: str):
        self.script("cut", host)

    def heal(self, host: str):
        self.script("heal", host)

    def down(self):
        self.script("down", check=False)
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # (releases the lock)
            self.lock_fd = None


def _lock() -> tuple[int | None, str | None]:
    """:data:`LOCK`, held: (its descriptor, None); (None, why) where another
    session holds it. Where it cannot be opened (not root) nothing is locked:
    the cluster cannot be brought up there either, and the script says why."""
    try:
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        return None, (f"another test session (pid {holder}) is using the emulated cluster ({LOCK}); there is one "
                      "per machine: wait for that session to end")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd, None


def start(hosts: int = HOSTS) -> Cluster:
    """Bring the cluster up, or skip (fail where HPCJOBS_REQUIRE_CLUSTER=1) with the reason."""
    required = os.environ.get("HPCJOBS_REQUIRE_CLUSTER") == "1"
    reason, fd = None, None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces are Linux-only"
    else:
        fd, reason = _lock()
    if reason is None and sys.platform.startswith("linux"):
        proc = subprocess.run([str(SCRIPT), "up", "--hosts", str(hosts)], capture_output=True, text=True,
                              timeout=120, env=_env())
        if proc.returncode != 0:
            reason = f"scripts/emulated_cluster.sh up failed: {(proc.stderr or proc.stdout).strip()[-500:]}"
    if reason:
        if fd is not None:
            os.close(fd)
        (pytest.fail if required else pytest.skip)(reason)
    return Cluster(hosts, fd)
