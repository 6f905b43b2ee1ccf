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

``/proc/net/dev`` is read rather than ``/sys/class/net``: inside a network
namespace sysfs may still show the machine's interfaces, while
``/proc/net/dev`` is always the reading process's own stack. Traffic that
bypasses the kernel (InfiniBand verbs, RoCE) does not show in these
counters: there the column reads what went over IP alone.
"""

from __future__ import annotations

from typing import Callable

from mpi4py import MPI

from ..collectives.costs import uplink_bytes

CALLS = 3  # calls per row in the counted pass


def host_tx_bytes(path: str = "/proc/net/dev") -> int | None:
    """Bytes this host's network stack has transmitted, summed over every
    interface but loopback; None where the counters cannot be read. Right
    where a host sends through one interface each, as the emulated hosts do;
    stacked ones (a bond and its members, a VLAN and its device, ifb) count
    the same bytes on each, which this sum does not tell apart."""
    try:
        with open(path) as f:
            lines = f.readlines()[2:]
    except OSError:
        return None
    total = 0
    for line in lines:
        name, _, fields = line.partition(":")
        if name.strip() == "lo" or not fields.strip():
            continue
        total += int(fields.split()[8])  # receive: 8 fields; transmit bytes first
    return total


class WireMeter:
    """Counts what each host sends during a row's calls (collective: every
    rank of ``comm`` makes the same calls in the same order)."""

    def __init__(self, comm: MPI.Intracomm, topology):
        self.comm = comm
        self.leader = topology.local_rank == 0
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
        before = host_tx_bytes() if self.leader else None
        self.comm.Barrier()  # every leader has read before anyone sends
        calls()
        self.comm.Barrier()  # every rank's calls are done
        after = host_tx_bytes() if self.leader else None
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
