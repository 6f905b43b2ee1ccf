"""Sharding: which samples each rank takes at each step.

Every epoch one permutation of the training set is drawn from
``(seed, epoch)`` -- the same on every rank, no communication. Step ``s``
uses global batch ``perm[s*B:(s+1)*B]`` with ``B = P*b``; rank ``r`` takes
its ``b`` samples ``[r*b:(r+1)*b]`` of it. The last partial global batch of
an epoch is dropped. The test set is cut in contiguous slices, one a rank.
"""

from __future__ import annotations

import numpy as np

__all__ = ["steps_per_epoch", "rank_batches", "eval_shard"]


def steps_per_epoch(num_train: int, global_batch: int) -> int:
    """Full global batches in one epoch (the partial last one is dropped)."""
    if global_batch <= 0:
        raise ValueError(f"global batch must be positive, got {global_batch}")
    steps = num_train // global_batch
    if steps == 0:
        raise ValueError(f"global batch {global_batch} is larger than the training set ({num_train} samples)")
    return steps


def rank_batches(num_train: int, batch_per_rank: int, rank: int, size: int, epoch: int, seed: int) -> np.ndarray:
    """This rank's sample indices for every step of ``epoch``: shape (steps, b).

    One permutation from ``(seed, epoch)``, identical on all ranks, cut into
    global batches of ``size * batch_per_rank``; rank ``rank`` takes slice
    ``[rank*b:(rank+1)*b]`` of each.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} not in [0, {size})")
    global_batch = batch_per_rank * size
    steps = steps_per_epoch(num_train, global_batch)
    perm = np.random.default_rng([seed, epoch, 0xDA7A]).permutation(num_train)
    batches = perm[: steps * global_batch].reshape(steps, size, batch_per_rank)
    return np.ascontiguousarray(batches[:, rank, :])


def eval_shard(num_test: int, rank: int, size: int) -> np.ndarray:
    """A contiguous slice of the test set for ``rank``; together the ranks
    cover every test sample exactly once."""
    lo = num_test * rank // size
    hi = num_test * (rank + 1) // size
    return np.arange(lo, hi)
