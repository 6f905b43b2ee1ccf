"""Hand-written collectives. Each takes the buffer first, works in place and
returns the same buffer; each module's docstring gives its steps and cost,
and ``docs/algorithms.md`` puts them side by side."""

from .._lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    "ALGORITHMS": "names", "DEVICE_ALGORITHMS": "names", "MESSAGE_ALGORITHMS": "names", "DTYPES": "_buffers", "OPS": "_buffers",
    "chunk_bounds": "_buffers", "allreduce": "select", "cuda_ipc_allreduce": "select",
    "ring_allreduce": "ring", "ring_reduce_scatter": "ring", "ring_allgather": "ring", "ring_allgatherv": "ring",
    "recursive_doubling_allreduce": "recursive_doubling", "rabenseifner_allreduce": "rabenseifner",
    "tree_allreduce": "tree", "parameter_server_allreduce": "parameter_server",
    "hierarchical_allreduce": "hierarchical",
    "shm_allreduce": "shm", "shm_reduce_scatter": "shm", "shm_allgather": "shm",
    "oneshot_allreduce": "oneshot",
    "symmetric_empty": "symmetric", "symmetric_free": "symmetric",
})
