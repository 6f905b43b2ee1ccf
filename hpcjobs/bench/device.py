"""The allreduce benchmark on device buffers (``--device cuda``).

Every row reduces the same CUDA tensor: ours through their transports
(``cuda_ipc``, ``staged`` host algorithms, ``auto``), and the baselines as a
user of each library would:

- ``nccl``: ``torch.distributed.all_reduce`` with NCCL (one GPU per rank;
  NCCL refuses two ranks on one GPU, so there the row is skipped with that
  reason).
- ``gloo``: ``torch.distributed.all_reduce`` on the CUDA tensor with a Gloo
  group (Gloo copies it through host memory itself).
- ``mpi``: ``MPI_Allreduce`` on the device buffer where the MPI is
  CUDA-aware; otherwise the tensor is copied to the host, reduced with
  ``MPI_Allreduce`` and copied back, all inside the timed call, as a user
  would have to.

Every timed call ends with the device waited for (``torch.cuda.synchronize``):
the collectives return before their GPU work is done, and the row must
include it. The input is uploaded before each call and the result read
back after each row's last call, untimed.
"""

from __future__ import annotations

import ctypes
import functools

from mpi4py import MPI

from ..collectives._buffers import OP_TABLE, check_op
from ..comm import private
from ..topology import detect_private
from .baselines import (_dist_op, ensure_process_group, gloo_group, gloo_supports, mpi_allreduce, mpi_supports,
                        nccl_supports)
from .baselines import tensor_allreduce

__all__ = ["DEVICE_ADAPTERS", "cuda_aware_mpi", "device_unavailable", "gpu_for_rank", "no_gpu_reason",
           "pinned_host_copy", "waited"]


def no_gpu_reason() -> str | None:
    """Why ``--device cuda`` cannot run in this process, or None."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable: {e}"
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch {torch.__version__} here (torch.cuda.is_available() is False)"
    return None


def gpu_for_rank(comm: MPI.Intracomm) -> str:
    """This rank's GPU, made current: local rank modulo the GPUs it sees
    (with ``HPCJOBS_BIND_GPU=1`` each rank sees only its own). Collective."""
    import torch

    index = detect_private(comm).local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


@functools.lru_cache(maxsize=1)
def cuda_aware_mpi() -> bool | None:
    """Whether the loaded MPI library can read device memory:
    ``MPIX_Query_cuda_support()`` (Open MPI, MPICH, MVAPICH), looked up in
    the loaded libmpi through ctypes, as mpi4py has no wrapper for it. None
    where the library has no such query."""
    path = _loaded_libmpi()
    try:
        query = ctypes.CDLL(path).MPIX_Query_cuda_support
    except (OSError, AttributeError, TypeError):
        return None
    query.restype = ctypes.c_int
    return bool(query())


def _loaded_libmpi() -> str | None:
    """The path of the libmpi this process loaded (mpi4py's), from its maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "/libmpi.so" in path or "/libmpi_" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return None


def waited(fn):
    """``fn(tensor, op, comm)`` followed by a device synchronize."""

    @functools.wraps(fn)
    def call(tensor, op, comm):
        out = fn(tensor, op, comm)
        if tensor.is_cuda:
            import torch

            torch.cuda.synchronize(tensor.device)
        return out

    return call


def mpi_device_allreduce(tensor, op: str = "sum", comm: MPI.Comm | None = None):
    """``MPI_Allreduce`` of a CUDA tensor: on the device memory itself when
    the MPI is CUDA-aware, else through a host copy (in the call)."""
    check_op(op)
    if cuda_aware_mpi():
        import torch

        torch.cuda.current_stream().synchronize()  # MPI reads the memory, not the stream
        comm = private(comm)
        comm.Allreduce(MPI.IN_PLACE, tensor, op=getattr(MPI, OP_TABLE[op].mpi))
        if op == "avg" and comm.Get_size() > 1:
            tensor.div_(comm.Get_size()) if tensor.is_floating_point() else tensor.div_(comm.Get_size(),
                                                                                        rounding_mode="floor")
        return tensor
    host = pinned_host_copy(tensor)
    mpi_allreduce(host, op, comm)
    tensor.copy_(host.view_as(tensor))
    return tensor


_PINNED: dict = {}  # (elements, dtype) -> the pinned host buffer of the size last reduced


def pinned_host_copy(tensor):
    """``tensor``'s values in a page-locked host buffer kept between calls,
    as a user staging through the host would (and as our staged transport
    does): ``tensor.cpu()`` made fresh pageable memory each call, inside the
    baseline's timed call, where our rows reuse pinned chunks."""
    import torch

    if not tensor.is_cuda:
        return tensor  # (what tensor.cpu() gave)
    key = (tensor.numel(), tensor.dtype)
    if key not in _PINNED:
        _PINNED.clear()  # one size at a time: a sweep's 64 MB buffers would pile up
        _PINNED[key] = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
    host = _PINNED[key]
    host.copy_(tensor.reshape(-1))  # synchronous: MPI reads it next
    return host


def gloo_device_allreduce(tensor, op: str = "sum", comm: MPI.Comm | None = None):
    """``torch.distributed.all_reduce`` of the CUDA tensor over Gloo."""
    import torch.distributed as dist

    check_op(op)
    comm = private(comm)
    ensure_process_group(comm)
    dist.all_reduce(tensor, op=_dist_op(op), group=gloo_group())
    size = comm.Get_size()
    if op == "avg" and size > 1:
        tensor.div_(size) if tensor.is_floating_point() else tensor.div_(size, rounding_mode="floor")
    return tensor


# name -> (fn on a CUDA tensor, supports(dtype))
DEVICE_ADAPTERS = {
    "mpi": (mpi_device_allreduce, mpi_supports),
    "gloo": (gloo_device_allreduce, gloo_supports),
    "nccl": (tensor_allreduce, nccl_supports),
}


def device_unavailable(name: str) -> str | None:
    """Why baseline ``name`` has no row on device buffers, or None."""
    if name in DEVICE_ADAPTERS:
        return None
    return "not measured on device buffers (the Horovod built here reduces host memory)"
