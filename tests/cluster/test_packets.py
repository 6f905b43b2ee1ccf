"""What waits in front of a shaped link (`emulated_cluster.sh up --gso-segs`).
A host sending bulk data to one peer keeps up to two of its packets queued
at the link (TCP Small Queues). With the kernel's 64 KB GSO packets that is
tens of milliseconds at an emulated rate, and a short message to another
peer waits behind it: Open MPI's rendezvous reply did, at every ring step
across hosts (docs/results/multinode.md). With one segment per packet (the
default up to 200 Mbit/s) it waits a few frames."""

import subprocess
import sys

import pytest

SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("198.18.0.3", 47321)); s.listen(1); print("listening", flush=True)
c, _ = s.accept()
while c.recv(1 << 16):
    pass
"""

ECHO = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("198.18.0.1", 47322)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while b := c.recv(1):
    c.sendall(b)
"""

# On h2: 8 MB to h3 in the background, and while it flows, 20 round trips of
# one byte to h1; prints their median in ms.
PROBE = """
import socket, statistics, threading, time
bulk = socket.create_connection(("198.18.0.3", 47321), timeout=60)
sender = threading.Thread(target=bulk.sendall, args=(bytes(8 << 20),)); sender.start()
time.sleep(0.5)
ping = socket.create_connection(("198.18.0.1", 47322), timeout=30)
ping.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range(20):
    t0 = time.perf_counter(); ping.sendall(b"x"); assert ping.recv(1) == b"x"
    rtt.append((time.perf_counter() - t0) * 1e3); time.sleep(0.01)
still_sending = sender.is_alive()
ping.close(); sender.join(); bulk.close()
print(f"{statistics.median(rtt):.3f} {still_sending}", flush=True)
"""


def _rtt_behind_bulk(cluster) -> float:
    with cluster.serve("h3", SINK), cluster.serve("h1", ECHO):
        out = subprocess.run([*cluster.exec_prefix("h2"), sys.executable, "-c", PROBE], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        median, still_sending = out.stdout.split()
        assert still_sending == "True", "the bulk transfer ended before the round trips did"
        return float(median)


@pytest.fixture
def reshaped(emulated_cluster):
    """The session's cluster, brought up again by the test with other links,
    and as it was (unshaped) afterwards."""
    yield emulated_cluster
    emulated_cluster.script("up", "--hosts", emulated_cluster.hosts)


def test_a_short_message_waits_behind_gso_packets_and_not_behind_one_segment_ones(reshaped):
    # 20 Mbit/s: two 64 KB packets are 52 ms of the link, two frames 1.2 ms
    medians = {}
    for segs in ("kernel", "1"):
        reshaped.script("up", "--hosts", reshaped.hosts, "--rate", "20mbit", "--gso-segs", segs)
        assert f"segments per packet on shaped links: {segs}" in reshaped.script("status").stdout
        medians[segs] = _rtt_behind_bulk(reshaped)
    assert medians["kernel"] > 25, medians   # behind h2's GSO packets to h3 (44 ms when written)
    assert medians["1"] < 15, medians        # behind a few frames (3 ms when written)


def _gso_max_segs(netns: str, dev: str) -> int:
    link = subprocess.run(["ip", "-n", netns, "-d", "link", "show", dev], capture_output=True, text=True).stdout
    return int(link.split(" gso_max_segs ")[1].split()[0])


def test_the_default_is_a_segment_per_200_mbit_and_a_bad_count_is_refused_with_the_cluster_kept(reshaped):
    reshaped.script("up", "--hosts", 2, "--rate", "20mbit", "--rate-h2", "1gbit")
    assert "segments per packet on shaped links: auto" in reshaped.script("status").stdout
    # both ends of each host's cable: its uplink, and the switch port that is its downlink
    assert [_gso_max_segs("emu-h1", "eth0"), _gso_max_segs("emu-sw", "h1")] == [1, 1]
    assert [_gso_max_segs("emu-h2", "eth0"), _gso_max_segs("emu-sw", "h2")] == [5, 5]
    proc = reshaped.script("up", "--hosts", 3, "--gso-segs", "0", check=False)
    assert proc.returncode != 0
    assert "--gso-segs '0': auto, 1..65535" in proc.stderr
    assert reshaped.script("status").stdout.count("link up") == 2
