"""Horovod, measured beside our collectives: its torch API with its MPI
controller (``horovod``) or its Gloo controller (``horovod-gloo``).

``horovod-gloo`` runs as ``horovodrun --gloo`` would: rank 0 starts Horovod's
own HTTP rendezvous server inside the MPI job and every rank gets the slot
variables ``horovodrun`` would set (rank, local and cross rank by node).
Horovod 0.28.1 cannot switch a process from its MPI controller to Gloo (the
Gloo context would be rebuilt from the freed MPI communicator), so
horovod-gloo is measured before horovod. ``scripts/install_horovod.sh``
builds Horovod.
"""

from __future__ import annotations

import atexit
import os
import socket

from mpi4py import MPI

from ..collectives._buffers import OP_TABLE, as_flat, check_op, finish_avg, torch_view
from ..comm import private
from ..topology import detect_private

__all__ = ["Unavailable", "start", "stop", "horovod_supports", "horovod_allreduce", "unavailable"]


class Unavailable(RuntimeError):
    """A baseline library is missing or cannot run here; the message says why."""


_hvd = None
_hvd_controller: str | None = None  # "mpi" or "gloo" while Horovod runs
_hvd_used_mpi = False  # once Horovod has run its MPI controller, Gloo cannot follow
_rendezvous_server = None
_hvd_env: list[str] = []  # the HOROVOD_* variables we set for Gloo, removed at shutdown


def start(comm: MPI.Intracomm, controller: str = "mpi"):
    """``horovod.torch``, initialised with ``controller`` ("mpi" or "gloo")
    on every rank of ``comm`` (COMM_WORLD only); reused while it runs.

    Raises:
        Unavailable: Horovod is missing or cannot start here.
    """
    global _hvd, _hvd_controller, _hvd_used_mpi
    if _hvd is not None and _hvd_controller == controller:
        return _hvd
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise Unavailable(f"Horovod is not installed ({e}); run scripts/install_horovod.sh") from None
    if comm.Compare(MPI.COMM_WORLD) == MPI.UNEQUAL:
        raise Unavailable("the horovod baselines run on COMM_WORLD only")
    if controller == "gloo" and _hvd_used_mpi:
        raise Unavailable("Horovod ran its MPI controller in this process already; horovod-gloo must come "
                          "first (Horovod 0.28.1 rebuilds Gloo from the freed MPI communicator)")
    if _hvd is not None:
        stop()
    if controller == "gloo":
        _gloo_rendezvous(comm)
        hvd.init()
    else:
        os.environ.setdefault("HOROVOD_CONTROLLER", "mpi")
        os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "mpi")
        hvd.init(comm=MPI.COMM_WORLD)
        _hvd_used_mpi = True
    _hvd, _hvd_controller = hvd, controller
    atexit.register(stop)
    if hvd.size() != comm.Get_size():
        raise Unavailable(f"Horovod sees {hvd.size()} ranks, MPI {comm.Get_size()}")
    return _hvd


def _gloo_rendezvous(comm: MPI.Intracomm) -> None:
    """What ``horovodrun --gloo`` does before it starts the workers: a
    rendezvous server on rank 0 with every rank's slot, and the slot's
    variables in each rank's environment. Nodes come from hpcjobs.topology
    (SLURM_NODEID under srun, or shared memory), so the hosts are told apart."""
    global _rendezvous_server
    topo = detect_private(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    cross_size = sum(1 for n in topo.local_sizes if n > topo.local_rank)
    slot = dict(hostname=f"node{topo.node_id}", rank=rank, local_rank=topo.local_rank, cross_rank=topo.node_id,
                size=size, local_size=topo.local_size, cross_size=cross_size)
    slots = comm.allgather(slot)
    iface = os.environ.get("HOROVOD_GLOO_IFACE") or ("lo" if topo.num_nodes == 1 else None)
    port, error = None, None
    if rank == 0:
        try:
            from horovod.runner.common.util.hosts import SlotInfo
            from horovod.runner.http.http_server import RendezvousServer

            _rendezvous_server = RendezvousServer(0)
            port = _rendezvous_server.start()
            _rendezvous_server.init([SlotInfo(**s) for s in slots])
        except Exception as e:  # the reason goes to every rank
            error = f"Horovod's rendezvous server did not start: {type(e).__name__}: {e}"
    port, error = comm.bcast((port, error), root=0)
    if error:
        raise Unavailable(error)
    addr = "127.0.0.1" if topo.num_nodes == 1 else comm.bcast(socket.gethostname() if rank == 0 else None, root=0)
    env = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": iface,
           "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
           "HOROVOD_HOSTNAME": slot["hostname"],
           **{f"HOROVOD_{k.upper()}": str(slot[k]) for k in ("rank", "size", "local_rank", "local_size",
                                                             "cross_rank", "cross_size")}}
    os.environ.update(env)
    _hvd_env[:] = env


def stop() -> None:
    """Shut Horovod down, if it runs, and its rendezvous server."""
    global _hvd, _hvd_controller, _rendezvous_server
    if _hvd is None:
        return
    _hvd.shutdown()
    _hvd, _hvd_controller = None, None
    for key in _hvd_env:  # the next init (Horovod's MPI controller) must not see them
        os.environ.pop(key, None)
    _hvd_env.clear()
    if _rendezvous_server is not None:
        _rendezvous_server.stop()
        _rendezvous_server = None


def horovod_supports(dtype: str) -> bool:
    # 0.28.1's torch binding raises "Tensor type torch.BFloat16Tensor is not supported".
    return dtype in ("float16", "float32", "float64", "int32", "int64")


def horovod_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None, controller: str = "mpi"):
    """``horovod.torch.allreduce_`` (MPI or Gloo controller), in place on the same memory."""
    check_op(op)
    flat = as_flat(buf)
    comm = private(comm)
    hvd = start(comm, controller)
    red = getattr(hvd, OP_TABLE[op].horovod)
    hvd.allreduce_(torch_view(flat), op=red, name=f"hpcjobs.{flat.count}.{flat.dtype}")
    if op == "avg":
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    return buf


def unavailable(name: str, comm: MPI.Intracomm) -> str | None:
    """Why ``name`` ("horovod" or "horovod-gloo") cannot run here, or None
    (this rank's answer; :func:`hpcjobs.bench.baselines.available` agrees
    across ranks). Collective: every rank finds the node layout first."""
    nodes = detect_private(comm).num_nodes
    try:
        import horovod.torch as hvd
    except ImportError as e:
        return f"Horovod is not installed ({e}); run scripts/install_horovod.sh"
    if name == "horovod-gloo":
        if not hvd.gloo_built():
            return "this Horovod was built without Gloo"
        if _hvd_used_mpi:
            return "Horovod's MPI controller ran in this process already; horovod-gloo must come first"
        if nodes > 1 and not os.environ.get("HOROVOD_GLOO_IFACE"):
            return "several nodes: set HOROVOD_GLOO_IFACE to the network interface between them"
    return None
