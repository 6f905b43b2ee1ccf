"""Hand-written collectives. Each takes the buffer first, works in place and
returns the same buffer; see each module's docstring for its steps and cost."""

from ._buffers import DTYPES, OPS, chunk_bounds
from .hierarchical import hierarchical_allreduce
from .parameter_server import parameter_server_allreduce
from .rabenseifner import rabenseifner_allreduce
from .recursive_doubling import recursive_doubling_allreduce
from .ring import ring_allgather, ring_allgatherv, ring_allreduce, ring_reduce_scatter
from .select import ALGORITHMS, allreduce
from .shm import shm_allgather, shm_allreduce, shm_reduce_scatter
from .symmetric import symmetric_empty, symmetric_free
from .tree import tree_allreduce

__all__ = [
    "ALGORITHMS", "DTYPES", "OPS", "allreduce", "chunk_bounds",
    "hierarchical_allreduce", "parameter_server_allreduce", "rabenseifner_allreduce",
    "recursive_doubling_allreduce", "ring_allgather", "ring_allgatherv", "ring_allreduce", "ring_reduce_scatter",
    "shm_allgather", "shm_allreduce", "shm_reduce_scatter", "symmetric_empty", "symmetric_free", "tree_allreduce",
]
