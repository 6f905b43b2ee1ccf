"""Timing shared by every benchmark: per-iteration wall times in interleaved
rounds (:mod:`hpcjobs.timing`), summarised as each rank's median, then the
maximum over ranks (the slowest rank's; nccl-tests averages the ranks'
times instead)."""

from __future__ import annotations

import statistics
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..timing import Rounds

__all__ = ["auto_iters", "time_interleaved", "max_of_medians", "sum_over_ranks"]


def auto_iters(nbytes: int) -> int:
    """Timed iterations for a message size: many for small messages, where one
    sample is microseconds of noise, at least 10 for large ones. Depends only
    on ``nbytes`` so every rank runs the same number."""
    return max(10, min(200, (1 << 26) // max(nbytes, 1)))


def time_interleaved(runs: dict[str, Callable[[], object]], reset: Callable[[str], object],
                     check: Callable[[str], int], comm: MPI.Intracomm, iters: int, warmup: int, seed: object = 0,
                     check_every: bool = False) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Time several implementations of one operation in ``warmup + iters``
    interleaved rounds (:class:`hpcjobs.timing.Rounds`).

    Before each call ``reset(label)`` runs, untimed; ``check(label)``
    (untimed) counts this rank's wrong elements right after each
    implementation's final call. Both get the label, so an implementation
    that works on its own copy of the buffer (on a GPU, say) can be given
    its input and have its output read back outside the timed call.
    ``seed`` (the same on every rank: the size, the pass) picks the orders.
    ``check_every``: after every call instead (warmup too), the counts summed.

    Returns:
        (label -> this rank's ``iters`` durations in seconds,
         label -> this rank's wrong-element count)
    """
    labels = list(runs)
    rounds = Rounds(len(labels), warmup, iters, seed)
    wrong: dict[str, int] = {}
    while not rounds.done:
        label, last = labels[rounds.current], rounds.last_call
        reset(label)
        rounds.call(comm, runs[label])
        if check_every:
            wrong[label] = wrong.get(label, 0) + check(label)
        elif last:
            wrong[label] = check(label)
    return {label: rounds.times[:, j].tolist() for j, label in enumerate(labels)}, wrong


def max_of_medians(times: list[float], comm: MPI.Intracomm) -> float:
    """The slowest rank's median time, in seconds (the same on every rank)."""
    local = np.array([statistics.median(times)], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MAX)
    return float(local[0])


def sum_over_ranks(value: int, comm: MPI.Intracomm) -> int:
    total = np.array([value], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return int(total[0])
