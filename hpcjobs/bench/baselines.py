"""Baselines measured in the same run as our own collectives.

Each adapter has our contract, ``fn(buf, op, comm) -> buf``, in place on the
same buffer, so the table compares like with like:

- ``mpi``: the MPI library's ``MPI_Allreduce`` (``MPI_IN_PLACE``).
- ``gloo``: ``torch.distributed.all_reduce`` with the Gloo backend (CPU).
- ``nccl``: ``torch.distributed.all_reduce`` with NCCL on a copy of the
  buffer in the rank's GPU (one GPU per rank, picked by local rank). The
  benchmark uploads the input before each call and reads the result back
  after the last, both untimed (:class:`DeviceStage`), so the row measures
  what training would see: a device-resident reduction, waited for
  (``torch.cuda.synchronize``). It runs where CUDA and NCCL are available.
- ``horovod``, ``horovod-gloo``: ``horovod.torch.allreduce_`` with
  Horovod's MPI or Gloo controller (:mod:`hpcjobs.bench.horovod`).

``avg`` is a sum followed by one local division wherever the library has no
average of its own, as Horovod does over MPI. Libraries without a dtype (no
MPI has bfloat16) report it through :func:`supports` and their rows are left
out rather than faked.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
from typing import Callable

from mpi4py import MPI

from ..collectives._buffers import OP_TABLE, as_flat, check_op, finish_avg, torch_view
from ..comm import private
from ..topology import detect_private
from . import doors, horovod
from .horovod import Unavailable, horovod_allreduce, horovod_supports
from .names import BASELINES

__all__ = ["ADAPTERS", "LATE_BASELINES", "DeviceStage", "Unavailable", "available", "ensure_process_group",
           "gloo_allreduce", "horovod_allreduce", "mpi_allreduce", "mpi_label", "mpi_supports", "shutdown",
           "tensor_allreduce"]


def mpi_supports(dtype: str) -> bool:
    """Whether ``MPI_Allreduce`` of this MPI can reduce ``dtype``. No MPI has
    bfloat16; float16 is an Open MPI extension (MPIX_C_FLOAT16)."""
    if dtype == "bfloat16":
        return False
    if dtype == "float16":
        return _open_mpi()
    return True


@functools.lru_cache(maxsize=None)
def _open_mpi() -> bool:  # asked on every timed float16 call of the mpi row: once is enough
    return MPI.Get_library_version().startswith("Open MPI")


def mpi_label() -> str:
    """"mpi", or "mpi/tuned:N" when Open MPI's coll/tuned was told to force
    allreduce algorithm N (``mpirun --mca coll_tuned_use_dynamic_rules 1
    --mca coll_tuned_allreduce_algorithm N``; MCA parameters must be set
    before MPI_Init, so the launcher sets them). The table then says which
    algorithm the mpi row measured instead of passing it off as the default."""
    forced = os.environ.get("OMPI_MCA_coll_tuned_allreduce_algorithm", "").strip()
    dynamic = os.environ.get("OMPI_MCA_coll_tuned_use_dynamic_rules", "").strip().lower() in ("1", "true", "yes")
    return f"mpi/tuned:{forced}" if forced and forced != "0" and dynamic else "mpi"


def mpi_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """The MPI library's own ``MPI_Allreduce``, in place (``MPI_IN_PLACE``)."""
    check_op(op)
    flat = as_flat(buf)
    if not mpi_supports(flat.dtype):
        raise TypeError(f"MPI_Allreduce of this MPI has no {flat.dtype} type")
    comm = private(comm)
    comm.Allreduce(MPI.IN_PLACE, flat.data, op=getattr(MPI, OP_TABLE[op].mpi))
    if op == "avg":
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    return buf


def _rendezvous(comm: MPI.Intracomm) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT if the job set them (Slurm templates do), else
    rank 0's host name and a free port it picked, broadcast over MPI."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return addr, int(port)
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            free = s.getsockname()[1]
        mine = (socket.gethostname() if comm.Get_size() > 1 else "127.0.0.1", free)
    else:
        mine = None
    host, free = comm.bcast(mine, root=0)
    # All ranks on rank 0's host (the usual local run): loopback always resolves.
    same_host = comm.allreduce(int(socket.gethostname() == host), op=MPI.MIN)
    return ("127.0.0.1" if same_host else host), free


_torch_dist_backend: str | None = None


def _process_group_backend() -> str:
    """Gloo for CPU tensors, and NCCL for CUDA tensors where there is CUDA:
    one default group serves the gloo and the nccl rows of one table.
    Without CUDA it is plain "gloo": a device map ("cpu:gloo") leaves the
    group without a default backend type, and DDP's reducer then warns
    "No backend of type 0 found ... Assuming no hooks are registered" on
    every rank (torch 2.13)."""
    import torch
    import torch.distributed as dist

    nccl = torch.cuda.is_available() and dist.is_nccl_available()
    return "cpu:gloo,cuda:nccl" if nccl else "gloo"


def ensure_process_group(comm: MPI.Intracomm) -> None:
    """Start torch.distributed's default process group over ``comm``'s ranks
    (COMM_WORLD only), once: Gloo, and NCCL too where there is CUDA.

    Raises:
        Unavailable: torch.distributed is missing, or ``comm`` is not COMM_WORLD.
    """
    global _torch_dist_backend
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise Unavailable(f"torch.distributed is not importable: {e}") from None
    if _torch_dist_backend is not None:
        return
    if comm.Compare(MPI.COMM_WORLD) == MPI.UNEQUAL:
        raise Unavailable("the torch.distributed baselines run on COMM_WORLD only")
    backend = _process_group_backend()
    addr, port = _rendezvous(comm)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    _torch_dist_backend = backend
    # Gloo's worker thread must not outlive the interpreter: left to exit on
    # its own it can still hold a tensor when Python finalises, take the GIL
    # and abort the process ("terminate called without an active exception",
    # seen here). atexit runs before mpi4py's MPI_Finalize (last in, first out).
    atexit.register(shutdown)


def _dist_op(op: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, OP_TABLE[op].dist)


# The benchmark's dtypes that torch.distributed reduces with Gloo and with
# NCCL (ncclFloat16 ... ncclBfloat16) alike.
_TORCH_DIST_DTYPES = ("float16", "float32", "float64", "int32", "int64", "bfloat16")


def gloo_supports(dtype: str) -> bool:
    return dtype in _TORCH_DIST_DTYPES


def gloo_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """``torch.distributed.all_reduce`` over Gloo, on the same memory (CPU)."""
    import torch.distributed as dist

    check_op(op)
    flat = as_flat(buf)
    comm = private(comm)
    ensure_process_group(comm)
    dist.all_reduce(torch_view(flat), op=_dist_op(op))
    if op == "avg":
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    return buf


def nccl_supports(dtype: str) -> bool:
    return dtype in _TORCH_DIST_DTYPES


def tensor_allreduce(tensor, op: str = "sum", comm: MPI.Comm | None = None):
    """``torch.distributed.all_reduce`` of a torch tensor wherever it lives
    (the process group's NCCL for CUDA tensors, Gloo for CPU ones), in place
    and waited for: CUDA collectives return before the GPU is done, so the
    call synchronises the tensor's device. ``avg`` is a sum, then a division
    on the device (floor division for integers, as :func:`finish_avg`)."""
    import torch
    import torch.distributed as dist

    check_op(op)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch tensor, got {type(tensor).__name__}")
    comm = private(comm)
    ensure_process_group(comm)
    dist.all_reduce(tensor, op=_dist_op(op))
    size = comm.Get_size()
    if op == "avg" and size > 1:
        if tensor.is_floating_point():
            tensor.div_(size)
        else:
            tensor.div_(size, rounding_mode="floor")
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return tensor


class DeviceStage:
    """A benchmark buffer's copy on a device, for baselines that reduce
    device memory (nccl): ``buf`` is the copy, ``upload`` fills it from the
    host buffer and ``download`` writes it back, both waited for, neither
    timed. ``device`` "cpu" gives a plain second copy (the tests use it to
    run the same path through Gloo)."""

    def __init__(self, host, device: str):
        import torch

        flat = as_flat(host)
        self.host = torch_view(flat)
        self.buf = torch.empty_like(self.host, device=device)

    def _sync(self) -> None:
        if self.buf.is_cuda:
            import torch

            torch.cuda.synchronize(self.buf.device)

    def upload(self) -> None:
        self.buf.copy_(self.host)
        self._sync()

    def download(self) -> None:
        self.host.copy_(self.buf)
        self._sync()


def cuda_stage(host, comm: MPI.Intracomm) -> DeviceStage:
    """The copy on this rank's GPU: local rank modulo the node's GPU count,
    made the current device first, as NCCL's communicator is built there."""
    import torch

    index = detect_private(comm).local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return DeviceStage(host, f"cuda:{index}")


_gloo_group = None


def gloo_group():
    """A Gloo group of every rank of the default process group, made at the
    first call (``bench --device cuda``'s Gloo baseline, whose default group
    may be NCCL's); :func:`shutdown` drops it with the default group."""
    import torch.distributed as dist

    global _gloo_group
    if _gloo_group is None:
        _gloo_group = dist.new_group(backend="gloo")
    return _gloo_group


def shutdown() -> None:
    """Tear down the torch.distributed process group and Horovod, if started,
    so a long-lived process (a test session) stops paying for their threads."""
    global _torch_dist_backend, _gloo_group
    horovod.stop()
    doors.stop()
    if _torch_dist_backend is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
        _gloo_group = None  # it went with the default group
        _torch_dist_backend = None


# name -> (fn, supports(dtype), stage): stage(host_buf, comm) gives the
# DeviceStage fn works on, or None for the host buffer itself.
ADAPTERS: dict[str, tuple[Callable, Callable[[str], bool], Callable | None]] = {
    "mpi": (mpi_allreduce, mpi_supports, None),
    "gloo": (gloo_allreduce, gloo_supports, None),
    "nccl": (tensor_allreduce, nccl_supports, cuda_stage),
    "horovod": (horovod_allreduce, horovod_supports, None),
    "horovod-gloo": (functools.partial(horovod_allreduce, controller="gloo"), horovod_supports, None),
    # the doors take what torch.distributed takes
    "ddp-hpcjobs": (doors.backend_allreduce, gloo_supports, None),
    "hvd-hpcjobs": (doors.hvd_api_allreduce, gloo_supports, None),
}
# Measured after everything else, each in a pass of its own, in this order:
# Horovod's coordinator thread burns about half a core on rank 0 from
# hvd.init() on (measured: 1.06 CPU-s in a 2 s sleep), which on a small node
# slows whatever is measured beside it; and Gloo cannot follow MPI (above).
LATE_BASELINES = ("horovod-gloo", "horovod")


def _nccl_unavailable(comm: MPI.Intracomm) -> str | None:
    """Why this rank cannot run the nccl baseline, or None. Collective (the
    node layout): NCCL wants a GPU of its own for every rank of a node."""
    local_size = detect_private(comm).local_size
    # Slurm jobs bind each rank to a GPU of its own (runtime.bind_gpu): each then sees one, device 0; distinct
    # where the ranks of a node were bound to different ones
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    bound = node.allgather(os.environ.get("CUDA_VISIBLE_DEVICES", "")  # bind_gpu bound it (and set LOCAL_RANK)
                           if os.environ.get("HPCJOBS_BIND_GPU") == "1" and "LOCAL_RANK" in os.environ else None)
    node.Free()
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not importable: {e}"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible here (nccl reduces GPU memory)"
    if not dist.is_nccl_available():
        return "this torch was built without NCCL"
    if None not in bound:
        if len(set(bound)) < len(bound):
            return f"{len(set(bound))} GPU(s) bound on a node for {len(bound)} ranks; nccl needs one GPU per rank"
    elif torch.cuda.device_count() < local_size:
        return (f"{torch.cuda.device_count()} GPU(s) on a node for {local_size} ranks; "
                "nccl needs one GPU per rank")
    return None


def available(name: str, comm: MPI.Intracomm) -> str | None:
    """None if baseline ``name`` can run here, else the reason it cannot.
    Collective: every rank gets the same answer."""
    reason = None
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
    if name == "gloo":
        try:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_gloo_available():
                reason = "this torch has no Gloo backend"
        except ImportError as e:
            reason = f"torch is not importable: {e}"
    elif name == "nccl":
        reason = _nccl_unavailable(comm)
    elif name in ("horovod", "horovod-gloo"):
        reason = horovod.unavailable(name, comm)
    reasons = comm.allgather(reason)
    return next((r for r in reasons if r), None)
