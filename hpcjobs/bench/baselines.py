"""Baselines measured in the same run as our own collectives.

Each adapter has our contract: ``fn(buf, op, comm) -> buf``, in place.
"""

from __future__ import annotations

from mpi4py import MPI

from ..collectives._buffers import as_flat, check_op, finish_avg
from ..comm import private

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}


def mpi_supports(dtype: str) -> bool:
    """Whether ``MPI_Allreduce`` of this MPI can reduce ``dtype``. No MPI has
    bfloat16; float16 is an Open MPI extension (MPIX_C_FLOAT16)."""
    if dtype == "bfloat16":
        return False
    if dtype == "float16":
        return MPI.Get_library_version().startswith("Open MPI")
    return True


def mpi_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """The MPI library's own ``MPI_Allreduce``, in place (``MPI_IN_PLACE``).

    ``avg`` is a sum followed by a local division, as Horovod does it over MPI.
    """
    check_op(op)
    flat = as_flat(buf)
    if not mpi_supports(flat.dtype):
        raise TypeError(f"MPI_Allreduce of this MPI has no {flat.dtype} type")
    comm = private(comm)
    comm.Allreduce(MPI.IN_PLACE, flat.data, op=_MPI_OPS[op])
    if op == "avg":
        finish_avg(flat.data, flat.dtype, comm.Get_size())
    return buf


BASELINES = {"mpi": mpi_allreduce}
