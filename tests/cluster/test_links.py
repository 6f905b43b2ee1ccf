"""The emulated hosts' links as a cluster's hosts have them: TCP between
hosts with the congestion control `up --tcp-cc` names (cubic unless told),
whatever this machine's own default is, and Open MPI's TCP settings as a
user sets them (docs/cluster.md)."""

import os
import subprocess
import sys

LISTEN = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("198.18.0.2", 47311)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); c.recv(1); c.close()
"""

CONNECT = """
import socket
s = socket.create_connection(("198.18.0.2", 47311), timeout=20)
print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode()); s.send(b"x")
"""


# Rank 0 on h1 sends 4 MiB to rank 1 on h2, which posts its receive only after
# hearing whether that send completed: it can only if it went eagerly,
# without the receiver's handshake (Open MPI's TCP default: eager up to 64 KB).
EAGER_PROBE = """
import socket, sys, time
import numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
big = np.arange(1 << 20, dtype=np.float32)
if c.rank == 0:
    req, deadline = c.Isend(big, 1, 1), time.monotonic() + float(sys.argv[1])
    while not (done := req.Test()) and time.monotonic() < deadline:
        time.sleep(0.01)
    c.send(done, 1, 2)
    req.Wait()
else:
    done = c.recv(source=0, tag=2)
    got = np.empty_like(big)
    c.Recv(got, 0, 1)
    assert np.array_equal(got, big)
print(socket.gethostname(), c.rank, "completed before the receive" if done else "waited for the receive", flush=True)
"""

EAGER = {"OMPI_MCA_btl_tcp_eager_limit": "8388608", "OMPI_MCA_btl_tcp_rndv_eager_limit": "8388608",
         "OMPI_MCA_btl_tcp_max_send_size": "8388608"}


def _congestion_control_between_hosts(cluster) -> str:
    """The congestion control of a real connection from h1 to h2."""
    with cluster.serve("h2", LISTEN):
        out = subprocess.run([*cluster.exec_prefix("h1"), sys.executable, "-c", CONNECT], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()


def test_hosts_talk_tcp_with_cubic_and_status_says_so(emulated_cluster):
    assert _congestion_control_between_hosts(emulated_cluster) == "cubic"
    status = emulated_cluster.script("status").stdout
    assert "tcp congestion control: cubic" in status
    # the hosts share this machine's cores, and status says so, with the warning where they are fewer
    cores, hosts = len(os.sched_getaffinity(0)), emulated_cluster.hosts
    assert f"cores: {cores}, shared by the {hosts} hosts" in status
    assert ("more hosts than cores" in status) == (hosts > cores)


def test_an_unknown_congestion_control_is_refused_and_the_running_cluster_kept(emulated_cluster):
    proc = emulated_cluster.script("up", "--hosts", "3", "--tcp-cc", "no_such_cc", check=False)
    assert proc.returncode != 0
    assert "--tcp-cc no_such_cc: this kernel has only" in proc.stderr and "cubic" in proc.stderr
    # refused before anything was torn down: the session's hosts still answer
    status = emulated_cluster.script("status").stdout
    assert status.count("link up") == emulated_cluster.hosts
    assert _congestion_control_between_hosts(emulated_cluster) == "cubic"


def test_open_mpi_settings_set_where_mpirun_runs_reach_every_host(emulated_cluster, tmp_path):
    """The eager tuning docs/cluster.md gives, as OMPI_MCA_* variables: forwarded
    by `emulated_cluster.sh mpirun` and in effect between hosts; without
    them the same 4 MiB send waits for its receiver (the probe can tell)."""
    probe = tmp_path / "eager_probe.py"
    probe.write_text(EAGER_PROBE)
    eager = emulated_cluster.mpirun("h1:1,h2:1", 2, "python", probe, "60", env=EAGER)
    assert eager.returncode == 0, eager.stdout + eager.stderr
    assert "h1 0 completed before the receive" in eager.stdout, eager.stdout + eager.stderr
    assert "h2 1 completed before the receive" in eager.stdout
    default = emulated_cluster.mpirun("h1:1,h2:1", 2, "python", probe, "2")
    assert default.returncode == 0, default.stdout + default.stderr
    assert "h1 0 waited for the receive" in default.stdout, default.stdout + default.stderr


def test_a_second_session_is_refused_the_cluster_while_this_one_holds_it(emulated_cluster):
    """One emulated cluster per machine: a second test session (a second
    scripts/test.sh) used to bring the hosts up again, and take them down,
    under the first one's tests."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import emulated; fd, why = emulated._lock(); print(fd, why)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tests,
                         env=dict(os.environ, PYTHONPATH=tests), timeout=60)
    assert out.stdout.startswith("None another test session (pid "), out.stdout + out.stderr
    assert f"(pid {os.getpid()}) is using the emulated cluster (/run/hpcjobs-emu.lock)" in out.stdout
