"""Timing shared by every benchmark: per-iteration wall times, summarised the
nccl-tests way (each rank's median, then the maximum over ranks)."""

from __future__ import annotations

import statistics
from typing import Callable

import numpy as np
from mpi4py import MPI


def auto_iters(nbytes: int) -> int:
    """Timed iterations for a message size: many for small messages, where one
    sample is microseconds of noise, at least 10 for large ones. Depends only
    on ``nbytes`` so every rank runs the same number."""
    return max(10, min(200, (1 << 26) // max(nbytes, 1)))


def time_iterations(run: Callable[[], object], reset: Callable[[], object], comm: MPI.Intracomm,
                    iters: int, warmup: int) -> list[float]:
    """Run ``reset(); barrier; run()`` ``warmup + iters`` times; return the
    ``iters`` timed durations in seconds on this rank. ``reset`` (restoring
    the input of an in-place collective) is not timed."""
    times = []
    for i in range(warmup + iters):
        reset()
        comm.Barrier()
        t0 = MPI.Wtime()
        run()
        t1 = MPI.Wtime()
        if i >= warmup:
            times.append(t1 - t0)
    return times


def max_of_medians(times: list[float], comm: MPI.Intracomm) -> float:
    """The slowest rank's median time, in seconds (the same on every rank)."""
    local = np.array([statistics.median(times)], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return float(local[0])


def sum_over_ranks(value: int, comm: MPI.Intracomm) -> int:
    total = np.array([value], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return int(total[0])
