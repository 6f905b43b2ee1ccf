"""``hpcjobs train --mode``: which loop trains (docs/algorithms.md,
"Asynchronous and local SGD").

==========  =======================================================================
sync        allreduce of the gradients every step (:mod:`hpcjobs.training.loop`)
async       sharded parameter server (:mod:`hpcjobs.training.paramserver`)
local       local SGD and post-local SGD (:mod:`hpcjobs.training.averaging`)
easgd       elastic averaging SGD: synchronous form (same), asynchronous form on the
            parameter server's ranks (``--easgd-form async``; paramserver)
hogwild     lock-free updates to parameters in shared memory, one node (same)
==========  =======================================================================
"""

from __future__ import annotations

import sys
import traceback

from mpi4py import MPI

from .config import TrainConfig

__all__ = ["train_mode"]


def train_mode(cfg: TrainConfig, comm: MPI.Intracomm, on_epoch=None) -> list[dict]:
    """Train ``cfg`` (its mode other than sync) on ``comm``; the records of
    each epoch, and ``on_epoch(record)`` for each at the end.

    Raises:
        ValueError: a layout the mode cannot take; CheckpointError: a
            checkpoint it cannot resume; Stopped: stopped by a signal after a
            checkpoint (local, easgd, hogwild, async). On every rank.
    """
    if cfg.mode == "async" or cfg.easgd_form == "async":
        from .paramserver import train_async as run
    else:
        from .averaging import train_averaging as run
    from .checkpoint import CheckpointError
    from .preempt import Stopped

    try:
        history = run(cfg, comm)
    except (ValueError, CheckpointError, Stopped):
        raise  # raised alike on every rank: a layout refused, a checkpoint it cannot resume, a signal's stop
    except Exception:
        if comm.Get_size() > 1:  # the others would wait for this rank: end the job, saying why
            traceback.print_exc()
            print(f"hpcjobs: rank {comm.Get_rank()} failed in training (mode {cfg.mode}); aborting the job",
                  file=sys.stderr, flush=True)
            comm.Abort(1)
        raise
    for record in history if on_epoch is not None else ():
        on_epoch(record)
    return history
