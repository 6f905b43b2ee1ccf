"""The names the collectives are chosen by.

Here, apart from the code, so that the command line can offer and check them
without starting MPI (``hpcjobs slurm render`` checks a job's flags on a login
node). The registries behind them -- :data:`hpcjobs.collectives.select.REGISTRY`
and :data:`hpcjobs.collectives.messages.MESSAGE_PASSING` -- hold these names in
this order, and a test keeps them so.
"""

__all__ = ["ALGORITHMS", "DEVICE_ALGORITHMS", "MESSAGE_ALGORITHMS", "SHARED_MEMORY", "INTRA"]

# allreduce(algorithm=...): every algorithm, besides "auto".
ALGORITHMS = ("ring", "ring_pipelined", "recursive_doubling", "rabenseifner", "tree", "parameter_server",
              "hierarchical", "shm", "oneshot")
# allreduce(algorithm=...) on CUDA tensors only: the device transports
# (every name above also takes CUDA tensors, staged through host memory).
DEVICE_ALGORITHMS = ("cuda_ipc",)
# The algorithms that move data only in messages on the communicator they
# are given: they run across nodes, their bytes can be counted, and they
# carry compressed payloads and hierarchical's inter-node stage.
MESSAGE_ALGORITHMS = ("ring", "ring_pipelined", "recursive_doubling", "rabenseifner", "tree", "parameter_server")
# The algorithms that need every rank on one node (MPI-3 shared memory).
SHARED_MEMORY = ("shm", "oneshot")
# hierarchical_allreduce(intra=...): the reduce-scatter and allgather inside a
# node (cuda_ipc: CUDA tensors only).
INTRA = ("ring", "shm", "cuda_ipc")
