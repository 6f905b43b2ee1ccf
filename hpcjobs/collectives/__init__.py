"""Hand-written collectives. Each takes the buffer first, works in place and
returns the same buffer; see each module's docstring for its steps and cost."""

from ._buffers import DTYPES, OPS, chunk_bounds
from .ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from .select import ALGORITHMS, allreduce

__all__ = [
    "ALGORITHMS", "DTYPES", "OPS", "allreduce", "chunk_bounds",
    "ring_allgather", "ring_allreduce", "ring_reduce_scatter",
]
