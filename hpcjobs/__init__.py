"""hpcjobs: an MPI job suite for distributed deep-learning training.

``hpcjobs.collectives`` (allreduce algorithms), ``hpcjobs.compression``,
``hpcjobs.training`` and ``hpcjobs.topology`` are the library;
``hpcjobs.cli`` is the command line on top of it, which the library never
imports.
"""

from ._lazy import exports

__version__ = "0.1.0"
__all__, __getattr__, __dir__ = exports(__name__, {
    "allreduce": "collectives", "ring_allgather": "collectives", "ring_allreduce": "collectives",
    "ring_reduce_scatter": "collectives", "world": "comm",
})
