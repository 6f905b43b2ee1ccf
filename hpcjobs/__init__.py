"""hpcjobs: an MPI job suite for distributed deep-learning training."""

__version__ = "0.1.0"
__all__ = ["allreduce", "ring_allgather", "ring_allreduce", "ring_reduce_scatter", "world"]


def __getattr__(name: str):
    # Imported on first use, so that ``hpcjobs.cli`` loads without MPI and can
    # turn a bad HPCJOBS_* setting read at import into a usage error.
    if name == "world":
        from .comm import world

        return world
    if name in __all__:
        from . import collectives

        return getattr(collectives, name)
    raise AttributeError(f"module 'hpcjobs' has no attribute {name!r}")
