"""Timing several implementations of one operation, the one way the suite
does it: ``algorithm="auto"`` choosing online and every benchmark alike.

A measurement is rounds: each round runs every implementation once, in an
order shuffled afresh for the round, and each call starts from a barrier so
that a rank still finishing the call before does not count against this one.
Why:

- Rounds, not blocks: on a shared machine load comes and goes; measured one
  implementation after another, a spell of load lands on whichever was
  running then. Interleaved, it hits all alike.
- A fresh order each round: what ran just before changes a call's time. A
  pipelined ring's segmented rendezvous sends slowed whatever followed by
  ~10% here, and the shared-memory algorithm ran 3-4x faster or slower
  depending on its predecessor; it lost measurements at 4 and 64 MB in a
  fixed order that it won in a shuffled one. Rotating a fixed order keeps
  the same neighbours.
- Seeded: every rank shuffles alike, so all ranks run the same
  implementation at each turn.
- Medians, not the best call: a busy spell makes one call in three or four
  2-3x slow, and the best call would hide that.

:class:`Rounds` is driven one turn at a time: ``auto`` takes one turn per
user call, and :func:`hpcjobs.bench.harness.time_interleaved` loops over all.
"""

from __future__ import annotations

import random

import numpy as np
from mpi4py import MPI

__all__ = ["shuffled_rounds", "Rounds"]


def shuffled_rounds(n: int, rounds: int, seed: object = 0) -> list[list[int]]:
    """``rounds`` orders of ``range(n)``, each shuffled afresh by one
    generator seeded with ``n`` and ``seed`` (the same on every rank: the
    message size, the pass), so every rank gets the same ones and another
    size or pass other ones. Seeded by ``n`` alone, every size and pass had
    the same orders, and an implementation's time after another's (shm's
    swings 3-4x with the call before) was the same bias everywhere."""
    shuffle, orders = random.Random(f"{n}/{seed}").shuffle, []
    for _ in range(rounds):
        turn = list(range(n))
        shuffle(turn)
        orders.append(turn)
    return orders


class Rounds:
    """One measurement of ``n`` implementations: ``warmup`` untimed rounds,
    then ``rounds`` timed ones, each in its own order.

    ``current`` names the implementation whose turn it is; :meth:`call`
    runs it (a barrier first, timed once past the warmup) and moves on;
    ``done`` says the measurement is complete. ``times[i, j]`` is this
    rank's time of implementation j in timed round i, in seconds.
    """

    __slots__ = ("n", "warmup", "order", "times", "turn")

    def __init__(self, n: int, warmup: int, rounds: int, seed: object = 0):
        self.n, self.warmup = n, warmup
        self.order = [j for turn in shuffled_rounds(n, warmup + rounds, seed) for j in turn]
        self.times = np.zeros((rounds, n))
        self.turn = 0

    @property
    def current(self) -> int:
        return self.order[self.turn]

    @property
    def last_call(self) -> bool:
        """Whether this turn is the current implementation's final call."""
        return self.turn >= len(self.order) - self.n

    @property
    def done(self) -> bool:
        return self.turn == len(self.order)

    @property
    def calls(self) -> int:
        """Calls the whole measurement takes."""
        return len(self.order)

    def call(self, comm: MPI.Intracomm, fn, *args) -> None:
        """This turn: barrier, ``fn(*args)``, timed after the warmup rounds."""
        k = self.turn
        self.turn += 1
        round_ = k // self.n
        comm.Barrier()
        t0 = MPI.Wtime()
        fn(*args)
        if round_ >= self.warmup:
            self.times[round_ - self.warmup, self.order[k]] = MPI.Wtime() - t0
