"""Which ranks share a node: ``detect()`` (``hpcjobs topology`` prints it).

Sources, first that applies (every rank must agree on which; they do, since
the choice is made collectively):

1. An explicit override, ``ranks_per_node`` (``--ranks-per-node``, env
   ``HPCJOBS_RANKS_PER_NODE``): consecutive blocks of that many ranks form a
   node; the last may be smaller. This simulates nodes on one host.
2. ``SLURM_NODEID``, when every rank is an srun task of its own (its
   ``SLURM_PROCID`` is its rank). Not under mpirun inside an allocation:
   there every rank inherits the batch shell's ``SLURM_NODEID`` (0) on
   every node, and shared memory (3.) tells the hosts apart. Never the
   hostname: containers and test clusters can share one.
3. ``MPI.Comm.Split_type(COMM_TYPE_SHARED)``: the ranks that can share memory.

Node ids are numbered 0..nodes-1 in order of each node's lowest rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .comm import by_value, private

__all__ = ["Topology", "detect", "detect_private", "check_ranks_per_node"]


@dataclass(frozen=True)
class Topology:
    """How a communicator's ranks sit on nodes.

    Attributes:
        comm: the (private) communicator this describes.
        node_comm: the ranks on this rank's node, ordered by rank.
        cross_comm: the ranks with this rank's local rank, one per node,
            ordered by node id (the inter-node stage of a hierarchical
            collective runs on it).
        node_id: this rank's node, 0..num_nodes-1.
        local_rank, local_size: this rank's place on its node.
        num_nodes: nodes in ``comm``.
        local_sizes: ranks on each node, by node id.
        source: "override", "slurm" or "shared-memory".
    """

    comm: MPI.Intracomm
    node_comm: MPI.Intracomm
    cross_comm: MPI.Intracomm
    node_id: int
    local_rank: int
    local_size: int
    num_nodes: int
    local_sizes: tuple[int, ...]
    source: str

    @property
    def uniform(self) -> bool:
        """Every node has the same number of ranks."""
        return len(set(self.local_sizes)) == 1

    @property
    def agreed(self) -> str:
        """What every rank's copy must say alike (a collective's check compares it): the nodes and their ranks."""
        return f"{self.num_nodes} nodes of {list(self.local_sizes)} ranks ({self.source})"


def check_ranks_per_node(value) -> int | None:
    """``value`` (or, for None, ``HPCJOBS_RANKS_PER_NODE``) as a positive
    integer, or None when neither is set.

    Raises:
        ValueError: not a positive integer, naming the argument or variable.
    """
    name = "ranks_per_node"
    if value is None:
        name, value = "HPCJOBS_RANKS_PER_NODE", os.environ.get("HPCJOBS_RANKS_PER_NODE", "").strip() or None
        if value is None:
            return None
    try:
        if isinstance(value, bool):  # int(True) == 1: one rank per node, silently
            raise TypeError
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if n <= 0 or n != float(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


def _all_have_slurm_nodeid(comm: MPI.Intracomm) -> int | None:
    """This rank's SLURM_NODEID where every rank of ``comm`` was started by
    srun as a task of its own (its SLURM_PROCID is its COMM_WORLD rank), else
    None. Under mpirun inside an allocation every rank inherits the batch
    shell's SLURM_NODEID (0) and SLURM_PROCID (0) whichever node it runs on:
    trusting it there put two hosts' ranks on one "node"."""
    raw = os.environ.get("SLURM_NODEID", "")
    mine = int(raw) if raw.strip().isdigit() else -1
    task = os.environ.get("SLURM_PROCID", "").strip()
    if not (task.isdigit() and int(task) == MPI.COMM_WORLD.Get_rank()):
        mine = -1
    lowest = np.array([mine], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, lowest, op=MPI.MIN)
    return mine if lowest[0] >= 0 else None


def _free_topologies(comm, keyval, cache):
    if not MPI.Is_finalized():
        for topo in cache.values():
            topo.node_comm.Free()
            topo.cross_comm.Free()


_TOPO_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_topologies)


def detect(comm: MPI.Comm | None = None, ranks_per_node: int | None = None) -> Topology:
    """Find which ranks of ``comm`` share a node (module docstring for the order).

    Collective over ``comm``. The result is cached on the communicator per
    ``ranks_per_node`` value, so collectives can call this on every call.

    Args:
        comm: intracommunicator; None for COMM_WORLD.
        ranks_per_node: simulate nodes of this many consecutive ranks
            (overrides Slurm and shared-memory detection); None reads
            ``HPCJOBS_RANKS_PER_NODE``, unset means detect.

    Raises:
        ValueError: ``ranks_per_node`` (or the env var) is not a positive
            integer, or not the same on every rank (raised on every rank,
            when the communicator's topology for it is first detected).
    """
    return detect_private(private(comm), ranks_per_node)


def detect_private(comm: MPI.Intracomm, ranks_per_node: int | None = None) -> Topology:
    """:func:`detect` on a communicator that is already the suite's private one."""
    try:
        rpn, error = check_ranks_per_node(ranks_per_node), None
    except ValueError as e:  # said on every rank below, not raised on this one alone
        rpn, error = None, str(e)
    cache = comm.Get_attr(_TOPO_KEYVAL)
    if cache is None:
        cache = {}
        comm.Set_attr(_TOPO_KEYVAL, cache)
    if error is None and rpn in cache:
        return cache[rpn]
    given = comm.allgather(error or rpn)
    if any(g != given[0] for g in given):  # each would split its own way, and the job hang or pair ranks wrongly
        values = by_value(["unset" if g is None else g for g in given])
        raise ValueError(f"ranks_per_node differs across ranks ({values}): give every rank the same "
                         "(HPCJOBS_RANKS_PER_NODE on every host, or none)")
    if error:
        raise ValueError(error)
    rank = comm.Get_rank()
    if rpn is not None:
        color, source = rank // rpn, "override"
    else:
        slurm = _all_have_slurm_nodeid(comm)
        if slurm is not None:
            color, source = slurm, "slurm"
        else:
            shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
            leader = np.array([rank], dtype=np.int64)
            shared.Allreduce(MPI.IN_PLACE, leader, op=MPI.MIN)
            shared.Free()
            color, source = int(leader[0]), "shared-memory"
    node_comm = comm.Split(color, rank)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    # Number the nodes by their lowest rank: gather (lowest rank, size) per rank.
    lowest = np.array([rank], dtype=np.int64)
    node_comm.Allreduce(MPI.IN_PLACE, lowest, op=MPI.MIN)
    table = np.empty(2 * comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([lowest[0], local_size], dtype=np.int64), table)
    leaders = sorted(set(table[0::2].tolist()))
    sizes = {int(lead): int(s) for lead, s in zip(table[0::2], table[1::2])}
    node_id = leaders.index(int(lowest[0]))
    cross_comm = comm.Split(local_rank, node_id)
    topo = Topology(comm, node_comm, cross_comm, node_id, local_rank, local_size, len(leaders),
                    tuple(sizes[lead] for lead in leaders), source)
    cache[rpn] = topo
    return topo
