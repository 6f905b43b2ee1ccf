"""Data-parallel training on hpcjobs' collectives: the optimizer wrapper,
learning-rate schedules (linear scaling, warmup), data shards, models and
the training loop."""

from .._lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    "DistributedOptimizer": "distributed", "NonFiniteGradientError": "distributed",
    "broadcast_parameters": "broadcast", "broadcast_optimizer_state": "broadcast",
    "TrainConfig": "config", "train": "loop", "schedule": None,
})
