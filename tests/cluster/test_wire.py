"""Bytes on the wire across emulated hosts: ``bench allreduce`` counts what
each host's interfaces sent per call (hpcjobs.bench.wire) and prints it
beside the uplink formula (collectives/costs.py). The counters are the
hosts' own network stacks, so this checks the formulas against the kernel,
and the counting against a bound no exact allreduce can beat."""

import json
import os
import re
import subprocess
import sys

import pytest

from hpcjobs.bench.wire import host_tx_bytes, stacked

N = 1 << 20


def test_bench_counts_each_hosts_uplink_beside_the_formula(emulated_cluster, tmp_path):
    out = tmp_path / "wire.json"
    proc = emulated_cluster.mpirun(
        "h1:2,h2:2", 4, "hpcjobs", "bench", "allreduce", "--impl", "ring,recursive_doubling,rabenseifner,hierarchical",
        "--baselines", "mpi", "-b", "64K", "-e", "1M", "-f", "16", "--iters", "3", "--warmup", "1", "--json", out,
        timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"#\s+size\(B\).*#wrong\s+wire\(B\)\s+model\(B\)\s+wire/model", proc.stdout), proc.stdout
    assert "(/proc/net/dev: eth0 on h1,h2; 3 untimed calls" in proc.stdout, proc.stdout  # what each host counts
    records = json.loads(out.read_text())["records"]
    rows = {r["impl"]: r for r in records if r["size_bytes"] == N}
    assert set(rows) == {"ring", "recursive_doubling", "rabenseifner", "hierarchical", "mpi"}
    # 4 ranks, 2 per host: ring 1.5N, recursive doubling 2N, Rabenseifner and hierarchical N per host
    # (Rabenseifner's first halving stays inside the host; far-first it sent 2N)
    formulas = {"ring": 1.5 * N, "recursive_doubling": 2 * N, "rabenseifner": N, "hierarchical": N}
    for impl, r in rows.items():
        assert r["wrong"] == 0
        assert len(r["wire_hosts"]) == 2 and r["wire_bytes"] == max(r["wire_hosts"])
        # No exact allreduce between two hosts sends less than N from each
        # (everything one host holds must reach the other, or its share of
        # the sum come back); headers and the barriers add a few percent.
        assert all(h >= N for h in r["wire_hosts"]), (impl, r["wire_hosts"])
        if impl == "mpi":
            assert r["wire_model"] is None
            continue
        assert r["wire_model"] == pytest.approx(formulas[impl], rel=1e-6), impl
        for h in r["wire_hosts"]:
            assert 1.0 <= h / r["wire_model"] <= 1.15, (impl, r["wire_hosts"], r["wire_model"])


def test_host_counters_sum_every_interface_but_loopback_and_the_stacked(tmp_path):
    dev = tmp_path / "dev"
    dev.write_text(
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls "
        "carrier compressed\n"
        "    lo: 5000 10 0 0 0 0 0 0 7000 10 0 0 0 0 0 0\n"
        "  eth0: 100 1 0 0 0 0 0 0 1234 5 0 0 0 0 0 0\n"
        "  eth1: 200 2 0 0 0 0 0 0 66 1 0 0 0 0 0 0\n"
        " bond0: 300 3 0 0 0 0 0 0 1300 6 0 0 0 0 0 0\n")
    assert host_tx_bytes(str(dev)) == 2600
    assert host_tx_bytes(str(dev), skip={"bond0"}) == 1300
    assert host_tx_bytes(str(tmp_path / "missing")) is None


def test_stacked_interfaces_are_the_masters_the_uppers_tunnels_and_ifb():
    """``ip -d -j link show``'s fields as iproute2 writes them."""
    links = [{"ifname": "lo"},
             {"ifname": "eth0", "master": "bond0"}, {"ifname": "eth1", "master": "bond0"},
             {"ifname": "bond0", "linkinfo": {"info_kind": "bond"}},
             {"ifname": "bond0.7", "link": "bond0", "linkinfo": {"info_kind": "vlan"}},
             {"ifname": "veth0", "link": "veth1", "linkinfo": {"info_kind": "veth"}},  # peer in this namespace
             {"ifname": "veth1", "link": "veth0", "linkinfo": {"info_kind": "veth"}},
             # a macvlan whose lower device is in another namespace: the bottom here
             {"ifname": "mv0", "link_index": 2, "link_netnsid": 0, "linkinfo": {"info_kind": "macvlan"}},
             {"ifname": "br0", "linkinfo": {"info_kind": "bridge"}}, {"ifname": "tap0", "master": "br0"},
             {"ifname": "wg0", "linkinfo": {"info_kind": "wireguard"}},
             {"ifname": "ifb0", "linkinfo": {"info_kind": "ifb"}},
             {"ifname": "vpn0", "linkinfo": {"info_kind": "tun", "info_data": {"type": "tun"}}},
             # a tap is kind tun too, and may be a container's only uplink (slirp4netns, pasta)
             {"ifname": "tap1", "linkinfo": {"info_kind": "tun", "info_data": {"type": "tap"}}}]
    assert stacked(links) == {"bond0", "bond0.7", "br0", "wg0", "ifb0", "vpn0"}


# Host A sends 200 datagrams of 1000 bytes through a macvlan on a veth and 200
# through a bridge on another, and receives 200 that an ingress filter
# redirects through an ifb; a vxlan sits idle. Prints the interfaces left
# out, the bytes the counted ones sent and what every interface but lo says.
STACKED_HOST = """
import json, socket, subprocess, sys, time
from hpcjobs.bench.wire import interface_links, stacked, tx_bytes_by_interface
skip = stacked(interface_links())
before = tx_bytes_by_interface()
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(200):
    s.sendto(bytes(1000), ("198.19.251.2", 9)); s.sendto(bytes(1000), ("198.19.252.2", 9))
peer = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\\n"
peer += "for _ in range(200): s.sendto(bytes(1000), ('198.19.252.1', 9))"
subprocess.run(["ip", "netns", "exec", sys.argv[1], sys.executable, "-c", peer], check=True, timeout=60)
time.sleep(0.2)
after = tx_bytes_by_interface()
sent = {k: after[k] - before[k] for k in after}
print(json.dumps([sorted(skip), sum(v for k, v in sent.items() if k not in skip), sum(sent.values())]))
"""

STACK = """set -e
A=$1; B=$2
ip netns add $A; ip netns add $B
for n in $A $B; do
    ip netns exec $n sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
done
ip link add wa netns $A type veth peer name wb netns $B
ip -n $A link add mv0 link wa type macvlan mode bridge
ip link add pa netns $A type veth peer name pb netns $B
ip -n $A link add br0 type bridge
ip -n $A link set pa master br0
ip -n $A link add ifb0 type ifb
ip -n $A link add vx0 type vxlan id 42 dstport 4789 dev wa
ip -n $A addr add 198.19.251.1/24 dev mv0; ip -n $B addr add 198.19.251.2/24 dev wb
ip -n $A addr add 198.19.252.1/24 dev br0; ip -n $B addr add 198.19.252.2/24 dev pb
for d in wa mv0 pa br0 ifb0 vx0; do ip -n $A link set $d up; done
for d in wb pb; do ip -n $B link set $d up; done
ip netns exec $A tc qdisc add dev pa ingress
ip netns exec $A tc filter add dev pa parent ffff: protocol all u32 match u32 0 0 action mirred egress redirect dev ifb0
"""


def test_a_host_with_stacked_interfaces_counts_each_byte_sent_once(emulated_cluster):
    """Real namespaces (the cluster fixture only says they can be made here):
    every byte host A sends crosses two of its interfaces (a macvlan and its
    veth, a bridge and its port) and an ifb "sends" what it receives; the
    count is the bytes sent once, headers included, where the sum over every
    interface was 2.5 times that."""
    a, b = f"hpcjw{os.getpid()}a", f"hpcjw{os.getpid()}b"
    try:
        up = subprocess.run(["bash", "-c", STACK, "stack", a, b], capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stdout + up.stderr
        out = subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", STACKED_HOST, b], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        skip, counted, everything = json.loads(out.stdout)
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert skip == ["br0", "ifb0", "mv0", "vx0"]
    sent = 400 * (1000 + 8 + 20 + 14)  # payload, UDP, IPv4 and Ethernet headers
    assert 1.0 <= counted / sent <= 1.05, (counted, sent)  # and a few ARP and ICMP replies
    assert everything / sent >= 2.4, (everything, sent)


def test_model_across_hosts_measures_both_link_classes_and_predicts_each_algorithm(emulated_cluster, tmp_path):
    """hpcjobs model on 2 hosts x 2 ranks: alpha/beta inside a node and
    between nodes, every two-level algorithm predicted at every size, the
    JSON with both machines. (How close the predictions come is a
    measurement, in docs/results/multinode.md, not a test.)"""
    proc = emulated_cluster.mpirun("h1:2,h2:2", 4, "hpcjobs", "model", "-b", "1M", "-e", "4M", "-f", "4",
                                   "--iters", "3", "--out", tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "# hpcjobs model: 4 ranks on 2 nodes of 2 (shared-memory)" in out, out
    assert re.search(r"inside a node: alpha = [\d.]+ us\s+beta = [\d.]+ GB/s", out), out
    assert re.search(r"between nodes: alpha = [\d.]+ us\s+beta = [\d.]+ GB/s", out), out
    rows = re.findall(r"^\s+(\d+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+[+-]\d+%", out, re.M)
    assert sorted((int(n), a) for n, a, _, _ in rows) == sorted(
        (n, a) for n in (1 << 20, 4 << 20) for a in ("ring", "recursive_doubling", "rabenseifner", "hierarchical"))
    assert all(float(m) > 0 and float(p) > 0 for _, _, m, p in rows)
    data = json.loads((tmp_path / "model.json").read_text())
    assert data["ranks"] == 4 and {"machine", "node_machine", "rows"} <= set(data) and data["ranks_per_node"] == 2
    assert {r["segments"] for r in data["rows"] if r["algorithm"] == "hierarchical"} == {1, 4}  # 4M: 1M segments


def test_model_across_unequal_hosts_is_a_usage_error(emulated_cluster):
    """Every rank exits 2 before measuring anything; rank 0 says why (as
    every usage error of the CLI)."""
    proc = emulated_cluster.mpirun("h1:2,h2:1", 3, "hpcjobs", "model", "-b", "1M", "-e", "1M", timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("hpcjobs model: error: the two-level model needs nodes of as many ranks each; "
                             "these have [2, 1]\n") == 1, proc.stderr
    assert "measuring" not in proc.stdout


def test_tune_across_hosts_records_the_layout_and_link_and_auto_says_it_uses_that_table(emulated_cluster, tmp_path):
    table = tmp_path / "tuning.json"
    proc = emulated_cluster.mpirun("h1:2,h2:2", 4, "hpcjobs", "tune", "--out", table, "-b", "64K", "-e", "1M",
                                   "-f", "16", "--passes", "1", "--iters", "2", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"# link between nodes: [\d.]+ Gbit/s one way", proc.stdout), proc.stdout
    (t,) = json.loads(table.read_text())["tables"]
    assert (t["ranks"], t["nodes"], t["local_sizes"], t["layout"]) == (4, 2, [2, 2], "shared-memory")
    assert t["link_gbps"] > 0.1
    bench = emulated_cluster.mpirun("h1:2,h2:2", 4, "hpcjobs", "bench", "allreduce", "--impl", "auto",
                                    "--baselines", "none", "--tuning", table, "-b", "64K", "-e", "64K",
                                    "--iters", "2", timeout=300)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    assert (f"# auto's tuning table: {table}: the table of 4 ranks on 2 node(s) [2, 2], link "
            f"{t['link_gbps']:.2f} Gbit/s, for 4 ranks on 2 node(s) [2, 2]") in bench.stdout, bench.stdout
