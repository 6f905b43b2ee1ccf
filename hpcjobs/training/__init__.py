"""Data-parallel training on hpcjobs' collectives: the optimizer wrapper,
learning-rate schedules (linear scaling, warmup), data shards and models."""

from . import schedule
from .distributed import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters", "schedule"]
