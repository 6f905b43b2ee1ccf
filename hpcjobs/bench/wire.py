"""Bytes on the wire, from each host's own interface counters.

When ``bench allreduce`` runs across hosts, every row gets one more, untimed
pass after its timed calls: a barrier, each host's transmitted bytes read
(``/proc/net/dev``, every interface but ``lo``: what left the host through
its network stack, Ethernet, IP and TCP headers included), :data:`CALLS`
calls of the row (its input restored before each, which sends nothing), a
barrier, the counters read again. Bytes per call per host are the
difference over :data:`CALLS`; the table prints the busiest host's (what
the slowest uplink had to carry) beside what the algorithm's formula says
each node sends to the others (:func:`hpcjobs.collectives.costs.uplink_bytes`),
and the JSON keeps every host's. The two barriers send a few hundred bytes
of their own, which the small sizes show.

Interfaces stacked on others would count the same bytes twice: a bond or
bridge and its members, a VLAN or macvlan and its device, a tunnel and the
device its packets leave by; an ifb's "transmitted" bytes are what an
ingress filter redirected to it, bytes received. Each host leaves those
out (:func:`stacked`, from ``ip -d -j link``, netlink: the reading
process's own namespace) and counts the interfaces at the bottom, which the
bench's preamble names. Where ``ip`` cannot list them, every interface but
``lo`` is counted, and the preamble says so.

``/proc/net/dev`` is read rather than ``/sys/class/net``: inside a network
namespace sysfs may still show the machine's interfaces, while
``/proc/net/dev`` is always the reading process's own stack. Traffic that
bypasses the kernel (InfiniBand verbs, RoCE) does not show in these
counters: there the column reads what went over IP alone.
"""

from __future__ import annotations

import json
import subprocess
from typing import Callable

from mpi4py import MPI

from ..collectives.costs import uplink_bytes

CALLS = 3  # calls per row in the counted pass


# Interface kinds whose transmitted bytes another interface of the host
# counts too, or that are not sent at all: tunnels (their packets leave
# again, encapsulated, through the device under them) and ifb (it
# "transmits" what an ingress filter redirected to it: received bytes).
COUNTED_ELSEWHERE = frozenset({"ifb", "vxlan", "geneve", "gre", "gretap", "ip6gre", "ip6gretap", "erspan",
                               "ip6erspan", "ipip", "sit", "ip6tnl", "vti", "vti6", "xfrm", "wireguard", "tun",
                               "bareudp"})


def stacked(links: list[dict]) -> set[str]:
    """The interfaces of ``links`` (``ip -d -j link show``'s list) whose
    transmitted bytes an interface under them counts again, or that send
    nothing of their own: each master (bond, bridge, team, vrf: its members
    carry the bytes), each device on a lower device of the same namespace
    (VLAN, macvlan, ipvlan; not a veth, whose ``link`` is its peer), and
    the kinds in :data:`COUNTED_ELSEWHERE`."""
    masters = {link.get("master") for link in links} - {None}
    out = set()
    for link in links:
        info = link.get("linkinfo") or {}
        kind = info.get("info_kind")
        # ip reports a tap (a container's only uplink under slirp4netns or pasta) as kind "tun" too: counted
        tap = kind == "tun" and (info.get("info_data") or {}).get("type") == "tap"
        on_lower = link.get("link") is not None and "link_netnsid" not in link and kind != "veth"
        if link["ifname"] in masters or on_lower or (kind in COUNTED_ELSEWHERE and not tap):
            out.add(link["ifname"])
    return out


def interface_links() -> list[dict] | None:
    """``ip -d -j link show`` of this process's network namespace, or None
    where it cannot be run or read."""
    try:
        proc = subprocess.run(["ip", "-d", "-j", "link", "show"], capture_output=True, text=True, timeout=10)
        links = json.loads(proc.stdout) if proc.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    ok = isinstance(links, list) and all(isinstance(x, dict) and "ifname" in x for x in links)
    return links if ok else None


def tx_bytes_by_interface(path: str = "/proc/net/dev") -> dict[str, int] | None:
    """Each interface's transmitted bytes, loopback left out; None where the
    counters cannot be read."""
    try:
        with open(path) as f:
            lines = f.readlines()[2:]
    except OSError:
        return None
    out = {}
    for line in lines:
        name, _, fields = line.partition(":")
        if name.strip() == "lo" or not fields.strip():
            continue
        out[name.strip()] = int(fields.split()[8])  # receive: 8 fields; transmit bytes first
    return out


def host_tx_bytes(path: str = "/proc/net/dev", skip: frozenset | set = frozenset()) -> int | None:
    """Bytes this host's network stack has transmitted, summed over every
    interface but loopback and those in ``skip`` (:func:`stacked`'s); None
    where the counters cannot be read."""
    counters = tx_bytes_by_interface(path)
    return None if counters is None else sum(v for name, v in counters.items() if name not in skip)


def counted_interfaces() -> tuple[frozenset, str]:
    """This host's interfaces to leave out of its count (:func:`stacked`),
    and the ones it counts, said in words for the bench's preamble."""
    counters = tx_bytes_by_interface() or {}
    links = interface_links()
    if links is None:
        return frozenset(), f"{','.join(sorted(counters)) or 'none'} (all but lo: 'ip -d -j link' failed)"
    skip = frozenset(stacked(links))
    return skip, ",".join(sorted(set(counters) - skip)) or "none"


class WireMeter:
    """Counts what each host sends during a row's calls (collective: every
    rank of ``comm`` makes the same calls in the same order)."""

    def __init__(self, comm: MPI.Intracomm, topology):
        self.comm = comm
        self.leader = topology.local_rank == 0
        self.skip, counted = counted_interfaces() if self.leader else (frozenset(), "")
        hosts: dict[str, list[str]] = {}  # the interfaces counted: the hosts that count them
        for text, host, lead in comm.allgather((counted, MPI.Get_processor_name(), self.leader)):
            if lead:
                hosts.setdefault(text, []).append(host)
        self.counted = "; ".join(f"{text} on {','.join(names)}" for text, names in hosts.items())
        self.hosts = topology.num_nodes
        self.ranks = comm.Get_size()
        nodes = comm.allgather(topology.node_id)
        # The uplink formulas hold for equal nodes of consecutive ranks.
        consecutive = nodes == sorted(nodes) and topology.uniform
        self.ranks_per_node = topology.local_size if consecutive else None

    def measure(self, calls: Callable[[], None]) -> list[float] | None:
        """Bytes per call each host sent while every rank ran ``calls()``
        (which makes :data:`CALLS` calls), in node order; None if any
        host's counters cannot be read."""
        self.comm.Barrier()
        before = host_tx_bytes(skip=self.skip) if self.leader else None
        self.comm.Barrier()  # every leader has read before anyone sends
        calls()
        self.comm.Barrier()  # every rank's calls are done
        after = host_tx_bytes(skip=self.skip) if self.leader else None
        sent = None if before is None or after is None else (after - before) / CALLS
        per_host = [s for s, lead in self.comm.allgather((sent, self.leader)) if lead]
        return None if any(s is None for s in per_host) else per_host

    def measure_rows(self, runs: dict[str, Callable[[], object]], reset: Callable[[str], object]
                     ) -> dict[str, list[float] | None]:
        """Each row's bytes per call per host: :meth:`measure` of
        :data:`CALLS` calls of ``runs[label]``, ``reset(label)`` before each."""
        out = {}
        for label, fn in runs.items():
            def calls(label=label, fn=fn):
                for _ in range(CALLS):
                    reset(label)
                    fn()

            out[label] = self.measure(calls)
        return out

    def model(self, label: str, nbytes: int, kept: str | None = None) -> float | None:
        """What the formula says each node sends per call for the row
        ``label`` (an algorithm of ours, maybe with +check or /SEGMENT; for
        auto, ``kept``: the algorithm it kept); None for baselines, auto
        without ``kept``, and layouts no formula covers."""
        if self.ranks_per_node is None:
            return None
        algorithm = (kept or label).split("/")[0].removesuffix("+check")
        return uplink_bytes(algorithm, nbytes, self.ranks, self.ranks_per_node)


def spans_hosts(comm: MPI.Intracomm) -> bool:
    """Whether ``comm``'s ranks run on more than one host (by hostname:
    nodes simulated on one host with --ranks-per-node do not count, their
    traffic never leaves it)."""
    return len(set(comm.allgather(MPI.Get_processor_name()))) > 1
