"""Two-level allreduce: inside each node, then across nodes, as NCCL and
Horovod do it on multi-GPU nodes.

Steps, for N bytes on nodes of L ranks each (``hpcjobs.topology.detect``):

1. Intra-node reduce-scatter of the first L·⌊count/L⌋ elements: local rank
   r ends with shard r of its node's sum (ring, or the shared-memory stage
   with ``intra="shm"``).
2. Inter-node allreduce of shard r among the ranks with local rank r, one
   per node, on ``cross_comm``: L independent allreduces of N/L bytes run in
   parallel, each over its own set of links (``inter`` picks the algorithm;
   ring by default).
3. Intra-node allgather of the shards.
4. The count % L elements left over: reduce to local rank 0, allreduce among
   the local-rank-0 ranks, broadcast inside the node.

With ``segment_bytes`` (by default 1/32 of the buffer, at least 256 KiB
per ring step across the nodes: 256 KiB x ranks per node x nodes; across
real nodes; off on nodes simulated on one host) the uniform path runs in
segments, pipelined: the
network stage (2) of segment k runs in a thread of its own while this
thread does the node stages of segments k+1 (1) and k-1 (3), so the
transfer across nodes overlaps the work inside them. Every rank of a node
runs the node stages in one fixed order, RS(0), RS(1), AG(0), RS(2), AG(1),
..., AG(K-1), and the network stages in segment order.

Nodes with different numbers of ranks have no partner for some local ranks,
so there the documented fallback runs instead: binomial reduce of the whole
buffer to local rank 0, allreduce among local-rank-0 ranks, binomial
broadcast inside the node. Correct for any layout, with one rank per node
on the network.

Cost (uniform nodes, ring inside and across): inside a node 2(L-1)/L·N
bytes per rank; across nodes 2(M-1)/M·N/L bytes per rank for M nodes -- the
slow links carry 1/L of what a flat ring would put on them. Model
(``costs.COSTS["hierarchical"]``, each level with its own α, β in reality):
2(L-1)α + 2(L-1)/L·Nβ + (L-1)/L·Nγ + 2(M-1)α + 2(M-1)/M·(N/L)β + (M-1)/M·(N/L)γ.

On CUDA tensors with ``intra="cuda_ipc"`` (what ``auto`` runs across nodes)
the node stages are :mod:`~hpcjobs.collectives.cuda_ipc`'s reduce-scatter and
allgather on the GPUs, and the network stage is the staged transport
(:mod:`~hpcjobs.collectives.staged`) of each rank's shard: Horovod's
NCCL+MPI hierarchical allreduce, without NCCL. With another ``intra`` a
CUDA tensor is staged through host memory whole-algorithm.

Step: :func:`allreduce`.
"""

from __future__ import annotations

import threading

from mpi4py import MPI

from ..comm import private
from ..topology import Topology, detect_private
import functools

from . import cuda_ipc, ring, shm, staged, tree
from ._buffers import Flat, chunk_bounds, finish_avg
from .costs import default_segment_bytes, segment_elements
from .device import DeviceFlat, divide
from ._frame import checked, run
from .messages import message_passing
from .names import INTRA

__all__ = ["hierarchical_allreduce", "allreduce", "default_segment_bytes"]


def allreduce(flat: Flat, op: str, comm: MPI.Intracomm, topology: Topology | None = None,
              inter: str = "ring", intra: str = "ring", ranks_per_node: int | None = None,
              segment_bytes: int | None = None) -> None:
    """The two-level step (module docstring); ``segment_bytes`` pipelines
    the uniform path in segments of about that size."""
    if isinstance(flat, DeviceFlat):
        _on_device(flat, op, comm, topology, inter, intra, ranks_per_node, segment_bytes)
        return
    if intra == "cuda_ipc":
        raise ValueError("intra='cuda_ipc' reduces CUDA tensors; this buffer is in host memory (use ring or shm)")
    topo = topology or detect_private(comm, ranks_per_node)
    inter_step = message_passing(inter, "inter").bound
    node, cross = topo.node_comm, topo.cross_comm
    size, L = comm.Get_size(), topo.local_size
    stage = "sum" if op == "avg" else op  # divide once, at the end, by the whole size
    if topo.num_nodes == 1:
        (shm.allreduce if intra == "shm" else ring.allreduce)(flat, op, node)
        return
    if L == 1 and topo.uniform:  # one rank per node: only the network stage
        inter_step(flat, op, cross)
        return
    if not topo.uniform:
        _through_leaders(flat, op, topo, inter_step, size)
        return
    main = flat.count // L * L
    per = segment_elements(flat.count, flat.itemsize, L, topo.num_nodes, topo.source == "override",
                           segment_bytes)
    if main > per and _threads_everywhere(comm):
        _pipelined(flat.slice(0, main), op, topo, inter_step, intra, per, size)
    elif main:
        m = flat.slice(0, main)
        (shm.reduce_scatter if intra == "shm" else ring.reduce_scatter)(m, stage, node)
        _network_step(m, op, topo, inter_step, size)
        (shm.allgather if intra == "shm" else ring.allgather)(m, node)
    if main < flat.count:
        _through_leaders(flat.slice(main, flat.count), op, topo, inter_step, size)


# The pipelined path's network stages run on a worker thread of their own per
# cross-node communicator: two communicators' collectives in flight at once
# (the torch backend's process groups, Horovod's executor beside a user's
# call) never queue behind each other's, whose order may differ by rank.
# It is an attribute of that communicator, shut down as it is freed (with its topology): kept by the
# communicator's id, every communicator that ever ran this path left an idle thread for good.
_workers_lock = threading.Lock()
_THREADS_KEYVAL = MPI.Comm.Create_keyval()  # on a communicator: every rank has MPI_THREAD_MULTIPLE


def _stop_worker(comm, keyval, worker) -> None:
    worker.shutdown(wait=False)  # (its last stage is done: each call waits for its own)


_WORKER_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_stop_worker)


def _worker(cross: MPI.Intracomm):
    from concurrent.futures import ThreadPoolExecutor

    with _workers_lock:
        worker = cross.Get_attr(_WORKER_KEYVAL)
        if worker is None:
            worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcjobs-inter")
            cross.Set_attr(_WORKER_KEYVAL, worker)
        return worker


def _threads_everywhere(comm: MPI.Intracomm) -> bool:
    """Whether every rank of ``comm`` runs with MPI_THREAD_MULTIPLE (one
    small allreduce the first time per communicator, on every rank alike:
    the pipelined and the plain path must not mix)."""
    ok = comm.Get_attr(_THREADS_KEYVAL)
    if ok is None:
        ok = bool(comm.allreduce(MPI.Query_thread() == MPI.THREAD_MULTIPLE, op=MPI.LAND))
        comm.Set_attr(_THREADS_KEYVAL, ok)
    return ok

# The segments across real nodes (MIN_STEP_BYTES, SEGMENTS, default_segment_bytes,
# segment_elements) live in costs.py, which the planner reads without MPI.


def _network_step(seg: Flat, op: str, topo: Topology, inter_step, size: int) -> None:
    """Step 2 on a reduce-scattered piece: this rank's shard of it across
    the nodes (divided by the job's size for avg)."""
    b = chunk_bounds(seg.count, topo.local_size)
    shard = seg.slice(b[topo.local_rank], b[topo.local_rank + 1])
    inter_step(shard, "sum" if op == "avg" else op, topo.cross_comm)
    if op == "avg":
        finish_avg(shard.data, seg.dtype, size)


def _pipelined(m: Flat, op: str, topo: Topology, inter_step, intra: str, per: int, size: int) -> None:
    """The uniform path in segments of ``per`` elements, the network stage
    of one segment running in a thread of its own while this one does the
    node stages of its neighbours. The node communicator sees one order on
    every rank -- RS(0), RS(1), AG(0), RS(2), AG(1), ..., AG(K-1) -- and the
    cross communicator the segments in order, so no two ranks can disagree
    on what comes next; the segments are disjoint memory."""
    stage = "sum" if op == "avg" else op
    node = topo.node_comm
    worker = _worker(topo.cross_comm)
    rs = shm.reduce_scatter if intra == "shm" else ring.reduce_scatter
    ag = shm.allgather if intra == "shm" else ring.allgather
    segments = [m.slice(lo, min(lo + per, m.count)) for lo in range(0, m.count, per)]
    across = functools.partial(_network_step, op=op, topo=topo, inter_step=inter_step, size=size)

    in_flight = None  # (segment index, future) of the network stage running now
    try:
        for k, seg in enumerate(segments):
            rs(seg, stage, node)
            if in_flight is not None:
                in_flight[1].result()
                done = in_flight[0]
            else:
                done = None
            in_flight = (k, worker.submit(across, seg))
            if done is not None:
                ag(segments[done], node)
        in_flight[1].result()
        ag(segments[in_flight[0]], node)
        in_flight = None
    finally:
        if in_flight is not None:  # an error here: let the network stage finish or fail before the buffer goes
            try:
                in_flight[1].result()
            except Exception:
                pass


def _on_device(flat: DeviceFlat, op: str, comm: MPI.Intracomm, topology, inter: str, intra: str,
               ranks_per_node, segment_bytes: int | None = None) -> None:
    """The two levels on a CUDA tensor (module docstring); the staged host
    chunks pipeline in ``segment_bytes`` as a host buffer would (0: not)."""
    host = functools.partial(allreduce, topology=topology, inter=inter, intra="ring" if intra == "cuda_ipc" else intra,
                             ranks_per_node=ranks_per_node, segment_bytes=segment_bytes)
    topo = topology or detect_private(comm, ranks_per_node)
    L = topo.local_size
    if intra == "cuda_ipc" and topo.uniform and L > 1:
        # IPC may open on one node and not on another: agree over every rank
        # (one small allreduce per call), and fall back together.
        failed = cuda_ipc.unavailable(topo.node_comm, flat.count // L * L * flat.itemsize, flat.tensor)
        if comm.allreduce(failed is not None, op=MPI.LOR):
            intra = "staged"
    if intra != "cuda_ipc" or not topo.uniform or L == 1:
        staged.allreduce(flat, op, comm, host)
        return
    if topo.num_nodes == 1:
        cuda_ipc.allreduce(flat, op, topo.node_comm)
        return
    inter_step = message_passing(inter, "inter").bound
    stage = "sum" if op == "avg" else op
    per = max(L, cuda_ipc.CAPACITY // flat.itemsize // L * L)  # a piece cuda_ipc takes whole
    main = flat.count // L * L
    for lo in range(0, main, per):
        m = flat.slice(lo, min(lo + per, main))
        cuda_ipc.reduce_scatter(m, stage, topo.node_comm)
        b = chunk_bounds(m.count, L)
        shard = m.slice(b[topo.local_rank], b[topo.local_rank + 1])
        staged.allreduce(shard, stage, topo.cross_comm, inter_step)
        if op == "avg":
            divide(shard.tensor, flat.dtype, comm.Get_size())
        cuda_ipc.allgather(m, topo.node_comm)
    if main < flat.count:
        staged.allreduce(flat.slice(main, flat.count), op, comm, host)


allreduce.takes_device = True


def _through_leaders(flat: Flat, op: str, topo: Topology, inter_step, size: int) -> None:
    """Binomial reduce to local rank 0, allreduce among the local-rank-0
    ranks, binomial broadcast inside the node: the uneven-node fallback, and
    the count % L tail of the uniform path."""
    stage = "sum" if op == "avg" else op
    tree.reduce(flat, stage, topo.node_comm)
    if topo.local_rank == 0:
        inter_step(flat, stage, topo.cross_comm)
        if op == "avg":
            finish_avg(flat.data, flat.dtype, size)
    tree.bcast(flat, topo.node_comm)


def hierarchical_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None, *,
                           topology: Topology | None = None, inter: str = "ring", intra: str = "ring",
                           ranks_per_node: int | None = None, segment_bytes: int | None = None):
    """Allreduce ``buf`` in place in two levels, inside then across nodes
    (module docstring).

    Args:
        buf: numpy array, torch CPU tensor or CUDA tensor, contiguous and
            writable; same count and dtype on every rank.
        op: "sum", "avg", "min", "max" or "prod".
        comm: intracommunicator; None for COMM_WORLD.
        topology: a :class:`hpcjobs.topology.Topology` from
            ``detect(comm)``; None detects (and caches) it.
        inter: the message-passing algorithm across nodes ("ring",
            "recursive_doubling", ...).
        intra: "ring" or "shm" (MPI-3 shared memory) inside a node, or
            "cuda_ipc" for CUDA tensors (the GPUs read each other's memory).
        ranks_per_node: simulate nodes of this many consecutive ranks
            (ignored when ``topology`` is given).
        segment_bytes: pipeline equal nodes in segments of about this many
            bytes (a multiple of the ranks per node in elements): the
            network stage of one segment runs in a thread of its own while
            the node stages of the next and the previous run (needs
            ``MPI_THREAD_MULTIPLE``; without it, or for a buffer of one
            segment, the stages run one after the other). 0: not
            pipelined. None (default): :func:`default_segment_bytes` on
            real nodes (1/32 of the buffer, at least 256 KiB x ranks per
            node x nodes: 1 MiB on 2 nodes of 2), not pipelined
            on nodes simulated with ``ranks_per_node``.

    Returns:
        ``buf``, reduced in place, bitwise identical on every rank.

    Raises:
        ValueError: unknown ``inter``/``intra``, a topology of another
            communicator, ``segment_bytes`` not a positive integer, or a bad
            buffer/op (TypeError: unsupported dtype).
    """
    name = "hierarchical_allreduce"
    checked(buf, op, comm, name, _check_options, comm, topology, inter, intra, segment_bytes)
    return run(buf, op, comm, name, allreduce, topology=topology, inter=inter, intra=intra,
               ranks_per_node=ranks_per_node, segment_bytes=segment_bytes)


def _check_options(comm, topology: Topology | None, inter: str, intra: str, segment_bytes) -> None:
    if segment_bytes is not None and (isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int)
                                      or segment_bytes < 0):
        raise ValueError(f"segment_bytes must be an integer >= 0 (0: not pipelined) or None, got {segment_bytes!r}")
    if intra not in INTRA:
        raise ValueError(f"unknown intra={intra!r}; choose one of {', '.join(INTRA)}")
    message_passing(inter, "inter")
    if topology is not None and topology.comm is not private(comm):
        raise ValueError("topology was detected on another communicator; pass detect(comm) for this comm")
