"""Shared-memory allreduce for the ranks of one node, through MPI-3 shared windows.

Instead of sending messages, the ranks of a node reduce straight out of each
other's memory. Each rank owns a small window (``MPI.Win.Allocate_shared``)
holding two *stages* of ``block_bytes``; the buffer is processed block by
block, and a block is made of one piece of each rank's shard (shard r is
``chunk_bounds(count, L)[r:r+2]``), so rank r always reduces inside its own
shard. Per block, on rank r of L:

1. Publish: copy the pieces the other ranks will reduce (every piece but r)
   from the user buffer into this rank's current stage.
2. Barrier.
3. Reduce piece r in place in the user buffer, adding the peers' staged
   copies of it (in rank order, so the bits do not depend on timing); for
   avg, divide it; then publish the result into this rank's stage.
4. Barrier.
5. Copy every other piece's result out of its owner's stage into the user
   buffer.

The stages alternate between blocks, so a stage is rewritten only after
every rank has passed a barrier that follows its last read: two barriers per
block suffice, also across calls. Blocks are small enough (512 KiB by default)
that the stages stay in the shared last-level cache: main memory sees each
user buffer read once and written once, and all cross-rank traffic is cache
to cache. That is why this beats message passing on one node, where every
byte is also copied through a kernel (CMA) or a shared FIFO. The price: every
line of a stage was read by a peer two blocks before, so a store into it
must first take the line out of that peer's cache. What that costs depends
on where the host runs the ranks' cores; in the CI VM's slow spells those
stores took 7x longer and this algorithm fell to a quarter of its speed,
while a kernel copy, which reads the sender's memory and writes only the
receiver's, slowed far less (docs/results/allreduce.md, "Shared memory,
staged"). Streaming (non-temporal) stores into the stages cut that toll
about 3x but were 1.4-1.9x slower in calm spells, and still trailed the
ring in slow ones (where ``auto`` picks the ring): ordinary stores it is.

Cost per rank for N bytes over L ranks: 2⌈N/block_bytes⌉ barriers, no
messages. Each rank reads N from its own buffer and 2(L-1)/L·N from peers'
stages (their copies of its piece, then the other pieces' results), and
writes N into its stage and N into its own buffer. (One
barrier per block, staging block k's result with block k+1's pieces,
measured no faster: the barriers are not what costs.)

The same stages give :func:`shm_reduce_scatter` and :func:`shm_allgather`,
the intra-node halves used by ``hierarchical_allreduce(intra="shm")``; their
steps are :func:`reduce_scatter`, :func:`allgather` and :func:`allreduce`.
Windows are allocated on first use per communicator, reused by every later
call, and freed when the communicator is freed.

**Zero-copy, on symmetric buffers.** The staging above exists because the
user's buffer is private memory. A buffer from
:func:`hpcjobs.collectives.symmetric.symmetric_empty` already lies in a shared
window, so when every rank passes one at the same offset of the same
allocation, on rank r of L:

1. Agree: one small ``MPI_Allreduce`` of (allocation, offset, bytes) tells every
   rank that every rank holds one; it is also the barrier after which every
   rank's input is in place. (Skipped, on every rank alike, where no live
   allocation spans the communicator: the staged path's cost is unchanged.)
2. Reduce shard r in place, adding the peers' shard r straight out of their
   buffers (the same order as the staged path, so the same bits); for avg,
   divide it.
3. Barrier.
4. Copy every other shard from its owner's buffer.
5. Barrier: no peer is still reading this rank's buffer when the call returns.

Cost per rank: 1 small allreduce and 2 barriers, no messages; each rank
reads (L-1)/L·N from its peers twice and N/L of its own, and writes N into its
own buffer, against 2N stores for the staged path. At 2 ranks on the CI
machine (``bench allreduce --buffers symmetric``) that was 2.1-2.2x
``MPI_Allreduce``'s busbw at 16 MB and 3.0x at 64 MB, against 1.2x and 2.0x
staged (docs/results/allreduce.md, "Symmetric buffers"). Anything else (one
rank with a private array, another offset) runs the staged path on every
rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..comm import extremes
from . import symmetric
from ._buffers import Flat, chunk_bounds, finish_avg, reducer
from ._frame import checked, run
from ._shared import free_window, is_single_node, shared_window

__all__ = ["DEFAULT_BLOCK_BYTES", "shm_allreduce", "shm_reduce_scatter", "shm_allgather", "reduce_scatter",
           "allgather", "allreduce"]

# Measured at 2 ranks (docs/results/allreduce.md, "Shared memory, staged"), blocks of
# 256 KiB to 2 MiB side by side, 12 runs: 512 KiB was 7-30% ahead of 2 MiB at
# 2-16 MB (a rank's piece, stage and peer's piece then fit its 1 MiB L2), level
# at 64 MB, and 5-10% behind at 1 MB (two blocks' barriers instead of one);
# 256 KiB pays too many barriers. 4 MiB blocks no longer stay in cache at all.
DEFAULT_BLOCK_BYTES = 512 << 10


@dataclass
class _Windows:
    """One communicator's shared window and the views of every rank's stages."""

    win: MPI.Win
    capacity: int  # bytes per stage; a call may use any block_bytes up to this
    stages: list  # stages[p][s]: rank p's stage s, as raw uint8
    next_stage: int = 0  # alternates across blocks *and* calls (module docstring)

    def free(self) -> None:
        free_window(self.win)
        self.stages = []


def _free_windows(comm, keyval, state):
    if not MPI.Is_finalized():
        state.free()


_WIN_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_windows)


def _windows(comm: MPI.Intracomm, block_bytes: int) -> _Windows:
    state = comm.Get_attr(_WIN_KEYVAL)
    if state is not None and block_bytes <= state.capacity:
        return state
    if not is_single_node(comm):
        raise ValueError(
            "the shm allreduce needs every rank of the communicator on one node "
            "(shared memory); across nodes use algorithm='hierarchical'"
        )
    if state is not None:
        # Grow only: frees the old window (collective; block_bytes is the same on every rank).
        comm.Delete_attr(_WIN_KEYVAL)
    win, segments = shared_window(2 * block_bytes, comm)
    stages = [(raw[:block_bytes], raw[block_bytes:]) for raw in segments]
    state = _Windows(win, block_bytes, stages)
    comm.Set_attr(_WIN_KEYVAL, state)
    return state


class _Plan:
    """Where block k's pieces lie: piece q of block k is elements
    ``[shard_q + k·piece, min(shard_q + (k+1)·piece, shard_end_q))``."""

    def __init__(self, flat: Flat, comm: MPI.Intracomm, block_bytes: int):
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.shard = chunk_bounds(flat.count, self.size)
        self.piece = max(1, block_bytes // (self.size * flat.itemsize))
        longest = self.shard[1] - self.shard[0]
        self.blocks = -(-longest // self.piece)

    def piece_range(self, q: int, k: int) -> tuple[int, int]:
        lo = min(self.shard[q] + k * self.piece, self.shard[q + 1])
        return lo, min(lo + self.piece, self.shard[q + 1])

    def staged(self, stage: np.ndarray, flat: Flat, q: int, n: int) -> np.ndarray:
        """Piece q's slot (n elements) in a stage, typed like ``flat.data``."""
        dtype = flat.data.dtype
        start = q * self.piece * dtype.itemsize
        return stage[start:start + n * dtype.itemsize].view(dtype)


def _zero_copy(flat: Flat, comm: MPI.Intracomm):
    """Step 1 of the zero-copy path: ``(allocation, every rank's buffer as
    typed views in comm's rank order)`` if every rank holds its buffer at the
    same place of one symmetric allocation spanning ``comm``, else None (the
    same answer on every rank)."""
    if not symmetric.spans(comm):
        return None
    found = symmetric.locate(flat.data, comm)
    alloc_id, offset = (found[0].id, found[1]) if found is not None else (-1, -1)
    if found is not None:
        found[0].win.Sync()  # my input's stores visible before the others may read it
    # The byte count too: with the agreement check off, ranks could differ in
    # it, and a view sliced past a peer's segment would come out short.
    dtype, n = flat.data.dtype, flat.nbytes
    lo, hi = extremes(np.array([alloc_id, offset, n], dtype=np.int64), comm)  # also the opening barrier
    if lo[0] < 0 or (lo != hi).any():
        return None
    alloc = found[0]
    alloc.win.Sync()
    return alloc, [seg[offset:offset + n].view(dtype) for seg in symmetric.peer_segments(alloc, comm)]


def _two_shot(flat: Flat, op: str, comm: MPI.Intracomm, win: MPI.Win, bufs: list, block_bytes: int,
              reduce_only: bool, gather_only: bool) -> None:
    """Steps 2-5 of the zero-copy path (module docstring); ``bufs[p]`` is
    rank p's buffer, ``bufs[rank]`` this rank's own."""
    size, r = comm.Get_size(), comm.Get_rank()
    bounds, data = chunk_bounds(flat.count, size), flat.data
    others = [q for q in range(size) if q != r]
    if not gather_only:
        reduce = reducer(op, flat.dtype)
        step = max(1, block_bytes // flat.itemsize)  # a block stays in cache across the peers' adds
        for lo in range(bounds[r], bounds[r + 1], step):
            hi = min(lo + step, bounds[r + 1])
            own = data[lo:hi]
            for p in others:
                reduce(own, bufs[p][lo:hi])
            if op == "avg":
                finish_avg(own, flat.dtype, size)
        if not reduce_only:
            _sync_win(comm, win)
    if not reduce_only:
        for q in others:
            data[bounds[q]:bounds[q + 1]] = bufs[q][bounds[q]:bounds[q + 1]]
    _sync_win(comm, win)


def _sync_win(comm: MPI.Intracomm, win: MPI.Win) -> None:
    # MPI-3 shared-memory idiom: make my stores visible, meet, see theirs.
    win.Sync()
    comm.Barrier()
    win.Sync()


def _shm(flat: Flat, op: str, comm: MPI.Intracomm, block_bytes: int = DEFAULT_BLOCK_BYTES,
         reduce_only: bool = False, gather_only: bool = False) -> None:
    zero_copy = _zero_copy(flat, comm)
    if zero_copy is not None:
        alloc, bufs = zero_copy
        _two_shot(flat, op, comm, alloc.win, bufs, block_bytes, reduce_only, gather_only)
        return
    # a stage holds one piece per rank, a piece at least one element: a smaller block_bytes
    # (9 float64 ranks at 64) left the last rank's slot empty and its reduce failing alone
    block_bytes = max(block_bytes, -(-comm.Get_size() * flat.itemsize // 8) * 8)
    state = _windows(comm, block_bytes)
    plan = _Plan(flat, comm, block_bytes)
    r, data = plan.rank, flat.data
    reduce = reducer(op, flat.dtype)
    others = [q for q in range(plan.size) if q != r]
    for k in range(plan.blocks):
        s = state.next_stage
        state.next_stage ^= 1
        mine = state.stages[r][s]
        lo, hi = plan.piece_range(r, k)
        own = data[lo:hi]
        if not gather_only:
            for q in others:  # 1. publish what the others reduce
                qlo, qhi = plan.piece_range(q, k)
                plan.staged(mine, flat, q, qhi - qlo)[...] = data[qlo:qhi]
            _sync_win(comm, state.win)
            for p in others:  # 3. reduce my piece out of their stages
                reduce(own, plan.staged(state.stages[p][s], flat, r, hi - lo))
            if op == "avg":
                finish_avg(own, flat.dtype, plan.size)
            if reduce_only:
                continue
        plan.staged(mine, flat, r, hi - lo)[...] = own
        _sync_win(comm, state.win)
        for q in others:  # 5. fetch the others' results
            qlo, qhi = plan.piece_range(q, k)
            data[qlo:qhi] = plan.staged(state.stages[q][s], flat, q, qhi - qlo)


def allreduce(flat: Flat, op: str, comm: MPI.Intracomm, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
    """The shm allreduce's step (module docstring)."""
    _shm(flat, op, comm, block_bytes)


def reduce_scatter(flat: Flat, op: str, comm: MPI.Intracomm, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
    """Steps 1-3 alone: rank r ends with shard r (``chunk_bounds(count, P)[r:r+2]``)
    reduced; the rest of ``flat`` is left as it was."""
    _shm(flat, op, comm, block_bytes, reduce_only=True)


def allgather(flat: Flat, comm: MPI.Intracomm, block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
    """Steps 4-5 alone: every rank copies shard r from rank r."""
    _shm(flat, "sum", comm, block_bytes, gather_only=True)


def _allgather_step(flat: Flat, op: str, comm: MPI.Intracomm, block_bytes: int) -> None:
    allgather(flat, comm, block_bytes)  # moves, does not reduce: op is not used


def _check_block_bytes(block_bytes) -> int:
    if isinstance(block_bytes, bool) or int(block_bytes) != block_bytes or block_bytes < 64:
        raise ValueError(f"block_bytes must be an integer >= 64, got {block_bytes!r}")
    return int(block_bytes) // 8 * 8


def shm_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None, *,
                  block_bytes: int = DEFAULT_BLOCK_BYTES):
    """Allreduce ``buf`` in place through shared-memory windows (module docstring).

    Args:
        buf: numpy array or torch CPU tensor, contiguous and writable; same
            count and dtype on every rank.
        op: "sum", "avg", "min", "max" or "prod".
        comm: intracommunicator whose ranks all share one node; None for
            COMM_WORLD (a private Dup is used).
        block_bytes: bytes of the buffer reduced per step (the stage size).

    Returns:
        ``buf``, reduced in place, bitwise identical on every rank.

    Raises:
        ValueError: the ranks of ``comm`` are not all on one node; a bad
            buffer, op or block size (TypeError for an unsupported dtype).
    """
    return run(buf, op, comm, "shm_allreduce", allreduce,
               block_bytes=checked(buf, op, comm, "shm_allreduce", _check_block_bytes, block_bytes))


def shm_reduce_scatter(buf, op: str = "sum", comm: MPI.Comm | None = None, *,
                       block_bytes: int = DEFAULT_BLOCK_BYTES):
    """Leave shard r (``chunk_bounds(count, P)[r:r+2]``) reduced on rank r,
    through shared memory; the rest of ``buf`` is left as it was.

    Same arguments as :func:`shm_allreduce`; returns ``buf``.
    """
    return run(buf, op, comm, "shm_reduce_scatter", reduce_scatter,
               block_bytes=checked(buf, op, comm, "shm_reduce_scatter", _check_block_bytes, block_bytes))


def shm_allgather(buf, comm: MPI.Comm | None = None, *, block_bytes: int = DEFAULT_BLOCK_BYTES):
    """Copy shard r of rank r's ``buf`` into every rank's ``buf``, through
    shared memory (the inverse of :func:`shm_reduce_scatter`); returns ``buf``."""
    return run(buf, "sum", comm, "shm_allgather", _allgather_step,
               block_bytes=checked(buf, "sum", comm, "shm_allgather", _check_block_bytes, block_bytes))
