"""Baselines measured in the same run as our own collectives.

Each adapter has our contract, ``fn(buf, op, comm) -> buf``, in place on the
same buffer, so the table compares like with like:

- ``mpi``: the MPI library's ``MPI_Allreduce`` (``MPI_IN_PLACE``).
- ``gloo``: ``torch.distributed.all_reduce`` with the Gloo backend (CPU).
- ``nccl``: ``torch.distributed`` with NCCL; needs a GPU per rank and a
  device-resident buffer, so it is listed only where CUDA is available.
- ``horovod``: ``horovod.torch.allreduce_`` with Horovod's MPI controller
  (``scripts/install_horovod.sh`` builds it).

``avg`` is a sum followed by one local division wherever the library has no
average of its own, as Horovod does over MPI. Libraries without a dtype (no
MPI has bfloat16) report it through :func:`supports` and their rows are left
out rather than faked.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..collectives._buffers import as_flat, check_op, finish_avg
from ..comm import private

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}


class BaselineUnavailable(RuntimeError):
    """A baseline library is missing or cannot run here; the message says why."""


def mpi_supports(dtype: str) -> bool:
    """Whether ``MPI_Allreduce`` of this MPI can reduce ``dtype``. No MPI has
    bfloat16; float16 is an Open MPI extension (MPIX_C_FLOAT16)."""
    if dtype == "bfloat16":
        return False
    if dtype == "float16":
        return MPI.Get_library_version().startswith("Open MPI")
    return True


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
    comm.Allreduce(MPI.IN_PLACE, flat.data, op=_MPI_OPS[op])
    if op == "avg":
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    return buf


def _torch_view(flat):
    """The Flat's memory as a torch CPU tensor of its dtype (no copy)."""
    import torch

    if flat.dtype == "bfloat16":
        return torch.from_numpy(flat.data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(flat.data)


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


def _ensure_process_group(backend: str, comm: MPI.Intracomm) -> None:
    global _torch_dist_backend
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise BaselineUnavailable(f"torch.distributed is not importable: {e}") from None
    if _torch_dist_backend == backend:
        return
    if _torch_dist_backend is not None:
        raise BaselineUnavailable(f"torch.distributed already runs {_torch_dist_backend}; one backend per process")
    if comm.Compare(MPI.COMM_WORLD) == MPI.UNEQUAL:
        raise BaselineUnavailable(f"the {backend} baseline runs on COMM_WORLD only")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise BaselineUnavailable("nccl needs a CUDA GPU per rank; none is visible here")
    addr, port = _rendezvous(comm)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    _torch_dist_backend = backend
    # Gloo's worker thread must not outlive the interpreter: left to exit on
    # its own it can still hold a tensor when Python finalises, take the GIL
    # and abort the process ("terminate called without an active exception",
    # seen here). atexit runs before mpi4py's MPI_Finalize (last in, first out).
    atexit.register(shutdown)


def gloo_supports(dtype: str) -> bool:
    return dtype in ("float16", "float32", "float64", "int32", "int64", "bfloat16")


def gloo_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """``torch.distributed.all_reduce`` over Gloo, on the same memory (CPU)."""
    import torch.distributed as dist

    check_op(op)
    flat = as_flat(buf)
    comm = private(comm)
    _ensure_process_group("gloo", comm)
    red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}[op]
    dist.all_reduce(_torch_view(flat), op=red)
    if op == "avg":
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    return buf


_hvd = None


def _horovod(comm: MPI.Intracomm):
    global _hvd
    if _hvd is None:
        try:
            import horovod.torch as hvd
        except ImportError as e:
            raise BaselineUnavailable(f"Horovod is not installed ({e}); run scripts/install_horovod.sh") from None
        if comm.Compare(MPI.COMM_WORLD) == MPI.UNEQUAL:
            raise BaselineUnavailable("the horovod baseline runs on COMM_WORLD only")
        os.environ.setdefault("HOROVOD_CONTROLLER", "mpi")
        os.environ.setdefault("HOROVOD_CPU_OPERATIONS", "mpi")
        hvd.init(comm=MPI.COMM_WORLD)
        atexit.register(shutdown)
        if hvd.size() != comm.Get_size():
            raise BaselineUnavailable(f"Horovod sees {hvd.size()} ranks, MPI {comm.Get_size()}")
        _hvd = hvd
    return _hvd


def horovod_supports(dtype: str) -> bool:
    # 0.28.1's torch binding raises "Tensor type torch.BFloat16Tensor is not supported".
    return dtype in ("float16", "float32", "float64", "int32", "int64")


def horovod_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """``horovod.torch.allreduce_`` (MPI controller), in place on the same memory."""
    check_op(op)
    flat = as_flat(buf)
    comm = private(comm)
    hvd = _horovod(comm)
    red = {"sum": hvd.Sum, "avg": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}[op]
    hvd.allreduce_(_torch_view(flat), op=red, name=f"hpcjobs.{flat.count}.{flat.dtype}")
    if op == "avg":
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    return buf


def shutdown() -> None:
    """Tear down the torch.distributed process group and Horovod, if started,
    so a long-lived process (a test session) stops paying for their threads."""
    global _torch_dist_backend, _hvd
    if _hvd is not None:
        _hvd.shutdown()
        _hvd = None
    if _torch_dist_backend is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
        _torch_dist_backend = None


# name -> (fn, supports(dtype)); "nccl" is known but has no CPU-buffer adapter.
BASELINES: dict[str, tuple[Callable, Callable[[str], bool]]] = {
    "mpi": (mpi_allreduce, mpi_supports),
    "gloo": (gloo_allreduce, gloo_supports),
    "horovod": (horovod_allreduce, horovod_supports),
}
KNOWN_BASELINES = ("mpi", "gloo", "nccl", "horovod")
# Measured after everything else: Horovod's coordinator thread burns about
# half a core on rank 0 from hvd.init() on (measured: 1.06 CPU-s in a 2 s
# sleep), which on a small node slows whatever is measured after it.
LATE_BASELINES = ("horovod",)


def available(name: str, comm: MPI.Intracomm) -> str | None:
    """None if baseline ``name`` can run here, else the reason it cannot.
    Collective: every rank gets the same answer."""
    reason = None
    if name not in KNOWN_BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(KNOWN_BASELINES)}")
    if name == "gloo":
        try:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_gloo_available():
                reason = "this torch has no Gloo backend"
        except ImportError as e:
            reason = f"torch is not importable: {e}"
    elif name == "nccl":
        reason = "the nccl baseline needs CUDA buffers; this suite measures CPU buffers here"
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            reason = "GPU found, but device-resident buffers are not wired into this benchmark yet"
    elif name == "horovod":
        try:
            import horovod.torch  # noqa: F401
        except ImportError as e:
            reason = f"Horovod is not installed ({e}); run scripts/install_horovod.sh"
    reasons = comm.allgather(reason)
    return next((r for r in reasons if r), None)
