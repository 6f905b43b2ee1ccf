"""Timing shared by every benchmark: per-iteration wall times, summarised the
nccl-tests way (each rank's median, then the maximum over ranks)."""

from __future__ import annotations

import statistics
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..collectives.select import shuffled_rounds


def auto_iters(nbytes: int) -> int:
    """Timed iterations for a message size: many for small messages, where one
    sample is microseconds of noise, at least 10 for large ones. Depends only
    on ``nbytes`` so every rank runs the same number."""
    return max(10, min(200, (1 << 26) // max(nbytes, 1)))


def time_interleaved(runs: dict[str, Callable[[], object]], reset: Callable[[str], object],
                     check: Callable[[str], int], comm: MPI.Intracomm, iters: int, warmup: int
                     ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Time several implementations of one operation, round-robin.

    Each of the ``warmup + iters`` rounds runs every implementation once:
    ``reset(label); barrier; run()``, timing only ``run``. Interleaving matters on
    a shared machine: load that comes and goes then hits every implementation
    alike instead of whichever ran its block of iterations at the time. The
    order is a fresh permutation every round
    (:func:`hpcjobs.collectives.select.shuffled_rounds`, as ``auto`` times its
    candidates: seeded, so every rank agrees),
    because what ran just before matters: a pipelined ring's segmented
    rendezvous sends slowed whatever followed by ~10% here, and the shared-
    memory algorithm ran 3-4x faster or slower depending on its predecessor.
    Merely rotating a fixed order keeps the same neighbours.
    ``check(label)`` (untimed) counts this rank's wrong elements right after
    each implementation's final run. Both get the label, so an implementation
    that works on its own copy of the buffer (on a GPU, say) can be given its
    input and have its output read back outside the timed call.

    Returns:
        (label -> this rank's ``iters`` durations in seconds,
         label -> this rank's wrong-element count)
    """
    times: dict[str, list[float]] = {label: [] for label in runs}
    wrong: dict[str, int] = {}
    labels = list(runs)
    for i, turn in enumerate(shuffled_rounds(len(labels), warmup + iters)):
        for j in turn:
            label = labels[j]
            reset(label)
            comm.Barrier()
            t0 = MPI.Wtime()
            runs[label]()
            t1 = MPI.Wtime()
            if i >= warmup:
                times[label].append(t1 - t0)
            if i == warmup + iters - 1:
                wrong[label] = check(label)
    return times, wrong


def max_of_medians(times: list[float], comm: MPI.Intracomm) -> float:
    """The slowest rank's median time, in seconds (the same on every rank)."""
    local = np.array([statistics.median(times)], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return float(local[0])


def sum_over_ranks(value: int, comm: MPI.Intracomm) -> int:
    total = np.array([value], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return int(total[0])
