"""Ring allreduce: a reduce-scatter then an allgather around a ring of P ranks.

The bandwidth-optimal allreduce popularised for deep learning by Baidu
(Gibiansky, "Bringing HPC techniques to deep learning", 2017) and used by
NCCL and Horovod. Rank ``r`` sends only to ``r+1`` and receives only from
``r-1`` (mod P), so every link carries the same load.

Steps, for a buffer of N bytes cut into P chunks (chunk ``i`` is
``chunk_bounds(count, P)[i:i+2]``):

1. Reduce-scatter, P-1 rounds. In round ``s`` rank ``r`` sends chunk
   ``r-s-1`` to its right neighbour and receives chunk ``r-s-2`` from its
   left neighbour, reducing it into its own copy. After the last round rank
   ``r`` holds chunk ``r`` reduced over all ranks (for ``op="avg"`` it then
   divides that chunk, once, by P).
2. Allgather, P-1 rounds. In round ``s`` rank ``r`` sends chunk ``r-s`` and
   receives chunk ``r-s-1`` straight into place. After the last round every
   rank holds every reduced chunk.

Cost: 2(P-1) rounds; each rank sends (and receives) 2(P-1)/P·N bytes and
reduces (P-1)/P·N bytes -- independent of P for large N, which is why the ring
wins on bandwidth and loses on latency (see ``recursive_doubling`` for the
latency-optimal variant). Model (``costs.COSTS["ring"]``):
2(P-1)α + 2(P-1)/P·Nβ + (P-1)/P·Nγ.

Pipelined mode (``pipeline=True``): each round's chunk is cut into segments
of ``segment_bytes``; the next segment's receive is posted (``Irecv``, double
buffered) before the current one is reduced, so a segment is reduced while
it is still in cache and while the next one is on the wire. The allgather
has nothing to overlap and receives whole chunks in place in both modes.

Only buffer-based MPI calls are used (``Sendrecv``, ``Isend``/``Irecv``, ``Recv``) on
the suite's private duplicate of the communicator. At 2 ranks each round swaps
messages with one partner, through :func:`hpcjobs.comm.exchange`, which
posts a long message's send before its receive (see there).

Steps (``hpcjobs.collectives._frame``), which other modules compose:
:func:`reduce_scatter`, :func:`allgather`, :func:`allreduce` and
:func:`allgatherv`.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..comm import exchange, private
from ._buffers import Flat, as_flat, chunk_bounds, finish_avg, reducer, scratch
from ._frame import checked, run
from .agreement import agree_or_raise
from .watchdog import guard

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "ring_allreduce",
    "ring_reduce_scatter",
    "ring_allgather",
    "ring_allgatherv",
    "reduce_scatter",
    "allgather",
    "allgatherv",
    "allreduce",
]

# Measured with `hpcjobs bench allreduce --segment-bytes 64K,256K,1M,4M` at 2
# ranks (docs/results/allreduce.md, "Pipelined ring"): 1 MiB was the best of the
# pipelined variants from 8 MB up; 64-128 KiB lose to the per-message
# rendezvous cost, 4 MiB segments are whole chunks and pipeline nothing.
DEFAULT_SEGMENT_BYTES = 1 << 20

_TAG = 7


def reduce_scatter(flat: Flat, op: str, comm: MPI.Intracomm, segment_bytes: int | None = None) -> None:
    """Step 1: rank r ends with chunk r reduced over all ranks (divided, for
    avg); the rest of ``flat`` holds partial results. ``segment_bytes``
    pipelines each round in segments of that size (None: whole chunks)."""
    segment_count = None if segment_bytes is None else max(1, segment_bytes // flat.itemsize)
    size, rank = comm.Get_size(), comm.Get_rank()
    bounds = chunk_bounds(flat.count, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    reduce = reducer(op, flat.dtype)
    data, wire = flat.data, flat.wire
    largest = bounds[1] - bounds[0]
    if segment_count is not None and largest <= segment_count:
        segment_count = None  # one segment per round: nothing to overlap, skip the requests
    if segment_count is None:
        tmp = scratch(largest, data.dtype)
    else:
        seg = min(segment_count, max(largest, 1))
        tmp = scratch(2 * seg, data.dtype)
        halves = (tmp[:seg], tmp[seg:])
    for s in range(size - 1):
        send_c, recv_c = (rank - s - 1) % size, (rank - s - 2) % size
        slo, shi = bounds[send_c], bounds[send_c + 1]
        rlo, rhi = bounds[recv_c], bounds[recv_c + 1]
        if segment_count is None:
            n = rhi - rlo
            exchange(comm, wire[slo:shi], right, tmp[:n].view(wire.dtype), left, _TAG)
            reduce(data[rlo:rhi], tmp[:n])
            continue
        sends = [comm.Isend(wire[a:min(a + seg, shi)], right, _TAG) for a in range(slo, shi, seg)]
        starts = range(rlo, rhi, seg)

        def post(k: int):
            a = starts[k]
            n = min(a + seg, rhi) - a
            return comm.Irecv(halves[k % 2][:n].view(wire.dtype), left, _TAG), a, n

        pending = post(0) if starts else None
        for k in range(len(starts)):
            req, a, n = pending
            # The other half was reduced in iteration k-1 and is free again.
            pending = post(k + 1) if k + 1 < len(starts) else None
            req.Wait()
            reduce(data[a:a + n], halves[k % 2][:n])
        MPI.Request.Waitall(sends)
    if op == "avg":
        finish_avg(data[bounds[rank]:bounds[rank + 1]], flat.dtype, size)


def allgather(flat: Flat, comm: MPI.Intracomm) -> None:
    """Step 2: every rank receives every chunk from the rank that owns it."""
    size, rank = comm.Get_size(), comm.Get_rank()
    bounds = chunk_bounds(flat.count, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    wire = flat.wire
    for s in range(size - 1):
        send_c, recv_c = (rank - s) % size, (rank - s - 1) % size
        exchange(comm, wire[bounds[send_c]:bounds[send_c + 1]], right,
                 wire[bounds[recv_c]:bounds[recv_c + 1]], left, _TAG)


def allgatherv(parts: list[np.ndarray], comm: MPI.Intracomm) -> list[list[np.ndarray]]:
    """The step of :func:`ring_allgatherv`: no check, on a private communicator
    of two or more ranks (``compressed_allreduce`` runs it through a
    byte-counting proxy)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    parts = [np.ascontiguousarray(p).reshape(-1) for p in parts]
    n = len(parts)
    # 1. sizes first: row r of a P x n table holds rank r's part sizes in
    #    bytes; the equal-block ring allgather fills the other rows.
    sizes = np.zeros((size, n), dtype=np.int64)
    sizes[rank] = [p.nbytes for p in parts]
    if n:
        allgather(as_flat(sizes), comm)
    # 2. the blobs, rank after rank, in one byte buffer; round s moves the
    #    blob of rank r-s to the right neighbour, as in the equal-block ring.
    #    Each array starts on an 8-byte boundary, so the views stay aligned.
    padded = (sizes + 7) // 8 * 8
    ends = np.concatenate([[0], np.cumsum(padded.sum(axis=1))]).astype(np.int64)
    buf = np.empty(int(ends[-1]), dtype=np.uint8)
    lo = int(ends[rank])
    for p, pad in zip(parts, padded[rank]):
        buf[lo:lo + p.nbytes] = p.view(np.uint8)
        lo += int(pad)
    right, left = (rank + 1) % size, (rank - 1) % size
    for s in range(size - 1):
        send_c, recv_c = (rank - s) % size, (rank - s - 1) % size
        exchange(comm, buf[ends[send_c]:ends[send_c + 1]], right,
                 buf[ends[recv_c]:ends[recv_c + 1]], left, _TAG)
    out = []
    for q in range(size):
        lo, row = int(ends[q]), []
        for p, nb, pad in zip(parts, sizes[q], padded[q]):
            row.append(buf[lo:lo + int(nb)].view(p.dtype))
            lo += int(pad)
        out.append(row)
    return out


def _check_segment_bytes(pipeline: bool, segment_bytes) -> int | None:
    if not pipeline:
        return None
    if isinstance(segment_bytes, bool) or int(segment_bytes) != segment_bytes or segment_bytes <= 0:
        raise ValueError(f"segment_bytes must be a positive integer, got {segment_bytes!r}")
    return int(segment_bytes)


def allreduce(flat: Flat, op: str, comm: MPI.Intracomm, segment_bytes: int | None = None) -> None:
    """The ring allreduce's step: :func:`reduce_scatter`, then :func:`allgather`."""
    reduce_scatter(flat, op, comm, segment_bytes)
    allgather(flat, comm)


def _allgather_step(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    allgather(flat, comm)  # moves, does not reduce: op is not used


def ring_reduce_scatter(buf, op: str = "sum", comm: MPI.Comm | None = None, *,
                        pipeline: bool = False, segment_bytes: int = DEFAULT_SEGMENT_BYTES):
    """Reduce ``buf`` across ranks so that rank ``r`` holds reduced chunk ``r``.

    Chunk ``r`` is elements ``b[r]:b[r+1]`` in memory order (``buf.flat``
    for a C-order array, ``buf.ravel("K")`` for a Fortran-order one) with
    ``b = hpcjobs.collectives.chunk_bounds(buf.size, comm.size)``; the rest
    of ``buf`` holds partial sums afterwards (it is scratch space).

    Args:
        buf: numpy array or torch CPU tensor, contiguous and writable; the
            same count and dtype on every rank.
        op: "sum", "avg", "min", "max" or "prod".
        comm: intracommunicator; None for COMM_WORLD. The call runs on a
            private duplicate of it.
        pipeline: cut each round into ``segment_bytes`` segments and overlap
            the reduction of one with the transfer of the next.
        segment_bytes: segment size for ``pipeline=True``.

    Returns:
        ``buf``, reduced in place.

    Raises:
        TypeError, ValueError: unsupported buffer, dtype, op or segment size.
    """
    name = "ring_reduce_scatter"
    return run(buf, op, comm, name, reduce_scatter,
               segment_bytes=checked(buf, op, comm, name, _check_segment_bytes, pipeline, segment_bytes))


def ring_allgather(buf, comm: MPI.Comm | None = None):
    """Fill every chunk of ``buf`` from the rank that owns it, around the ring.

    Rank ``r`` contributes chunk ``r`` (bounds as in :func:`ring_reduce_scatter`);
    afterwards every rank holds all P chunks. This is the second half of the
    ring allreduce, and the ``allgather`` of equal-sized blocks in place.

    Args:
        buf: numpy array or torch CPU tensor, contiguous and writable.
        comm: intracommunicator; None for COMM_WORLD.

    Returns:
        ``buf``, filled in place.
    """
    return run(buf, "sum", comm, "ring_allgather", _allgather_step)


def ring_allgatherv(parts, comm: MPI.Comm | None = None) -> list[list[np.ndarray]]:
    """Allgather payloads whose sizes differ between ranks, around the ring.

    Each rank gives a list of 1-D numpy arrays (the same number of arrays
    with the same dtypes on every rank; their lengths may differ). The sizes
    go first, as one small equal-block ring allgather of a P x len(parts)
    table; then each rank's arrays travel as one blob in P-1 ring rounds.
    Each rank sends (P-1)/P of the total, like the equal-block allgather.

    Returns:
        ``out[q][i]``: rank q's array i (views into one receive buffer;
        ``out[rank]`` is a copy of this rank's own).
    """
    comm = private(comm)
    parts = list(parts)
    if comm.Get_size() == 1:
        return [[np.array(p, copy=True).reshape(-1) for p in parts]]
    with guard("ring_allgatherv", comm):
        # lengths may differ; the number of arrays and their dtypes may not. A part that is no array (a bfloat16
        # or grad-requiring tensor, a ragged list) is an error on every rank, not this rank's alone
        error, dtypes = None, None
        try:
            dtypes = ",".join(str(np.asarray(p).dtype) for p in parts)
        except (TypeError, ValueError, RuntimeError) as e:
            error = TypeError(f"ring_allgatherv takes parts numpy can read as arrays: {e}")
        agree_or_raise(comm, "ring_allgatherv", {"arrays": len(parts), "dtypes": dtypes}, error)
        return allgatherv(parts, comm)


def ring_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None, *,
                   pipeline: bool = False, segment_bytes: int = DEFAULT_SEGMENT_BYTES):
    """Allreduce ``buf`` in place with the ring algorithm (module docstring).

    Args:
        buf: numpy array or torch CPU tensor, contiguous and writable; the
            same count and dtype on every rank. float16/32/64, (u)int8-64,
            and torch bfloat16.
        op: "sum", "avg", "min", "max" or "prod". ``avg`` of integers is
            floor division of the sum.
        comm: intracommunicator; None for COMM_WORLD.
        pipeline: overlap reduction with transfer in segments (see module).
        segment_bytes: segment size for ``pipeline=True``.

    Returns:
        ``buf``, holding the reduction over all ranks, bitwise identical on
        every rank.

    Raises:
        TypeError, ValueError: unsupported buffer, dtype, op or segment size.
    """
    name = "ring_allreduce"
    return run(buf, op, comm, name, allreduce,
               segment_bytes=checked(buf, op, comm, name, _check_segment_bytes, pipeline, segment_bytes))
