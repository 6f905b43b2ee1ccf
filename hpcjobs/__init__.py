"""hpcjobs: an MPI job suite for distributed deep-learning training."""

from .collectives import allreduce, ring_allgather, ring_allreduce, ring_reduce_scatter
from .comm import world

__version__ = "0.1.0"
__all__ = ["allreduce", "ring_allgather", "ring_allreduce", "ring_reduce_scatter", "world"]
