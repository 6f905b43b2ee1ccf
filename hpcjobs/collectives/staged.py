"""The staged transport: device buffers reduced by the host algorithms,
through pinned host memory, in a pipeline.

Where the MPI library cannot read device memory (an Open MPI built
``--without-cuda``, as the PyPI wheel is) and the ranks are not all on one
node, a GPU's gradients must cross host memory. Copying the whole tensor to
the host, reducing it and copying it back (Horovod's ``DoAllreduceCudaOnCPU``)
leaves the copy engines idle while the network works and the network idle
while the copies run. Cut into chunks, the three overlap:

    copy engine   D→H c0 | D→H c1 |          | H→D c0 D→H c2 |        | H→D c1 ...
    host (MPI)             | reduce c0       | reduce c1     | reduce c2 ...

Chunk i+1 is copied device→host while the host algorithm reduces chunk i
across the ranks, and chunk i is copied back while chunk i+1 is reduced.
With chunks of C bytes the time is about ``max(copies, host) + one chunk's
copies`` instead of their sum; C trades the pipeline's fill (one chunk)
against the per-chunk cost of the host algorithm (its α terms, paid once per
chunk). :data:`CHUNK_BYTES` is measured (docs/results/gpu.md, "Staging
chunk size"), as MVAPICH2's ``MV2_CUDA_BLOCK_SIZE`` and UCX's
``RNDV_FRAG_SIZE`` are set from measurements.

Memory: :data:`SLOTS` pinned host chunks per communicator, allocated on
first use, reused by every call and freed with the communicator: three so
that the chunk being copied in, the one being reduced and the one being
copied back never share a slot. Every copy runs on the transports' one
stream (:class:`~hpcjobs.collectives.device.Stream`) in the order issued, so
a slot is refilled only after the copy that emptied it, and each call's
first copy into the slots waits for an event recorded after the previous
call's last copy out of them, whichever stream that ran on; the host waits
for each chunk's arrival with an event, never for the whole device.

A message of one chunk has nothing to overlap: it is copied out and back on
the caller's stream, without the second stream's events.

Any host step runs per chunk (every chunk has the same count on every rank,
so the ranks stay in step); allreduce is elementwise, so reducing chunk by
chunk gives the same answer as one call and the same bits on every rank,
but not the same bits as one call of the whole message on the host: ring
and shm add a float element's P values in an order set by which of the P
pieces it falls in, and chunking moves those bounds (at 3 ranks, 524 of
4,000 float32 sums differed in their last bits). Collectives that are not
elementwise (reduce-scatter, allgather) are staged whole by :func:`whole`.

Steps: :func:`allreduce`, :func:`whole`.
"""

from __future__ import annotations

from mpi4py import MPI

from ._buffers import as_flat
from .device import DeviceFlat, Stream

__all__ = ["CHUNK_BYTES", "SLOTS", "allreduce", "whole", "pinned_bytes"]

# Bytes per pipelined chunk (docs/results/gpu.md, "Staging chunk size"):
# 4 MiB took 0.78x the time of its parts at 64 MB, 1 MiB 0.91x, 16 MiB 0.87x.
CHUNK_BYTES = 4 << 20
SLOTS = 3


class _Pool:
    """A communicator's pinned slots (uint8 tensors of ``nbytes`` each)."""

    def __init__(self):
        self.slots: list = []
        self.nbytes = 0
        self.device_type = None
        self.released = None  # event after the last copy out of the slots (None: none pending)

    def get(self, nbytes: int, device_type: str) -> list:
        if nbytes > self.nbytes or device_type != self.device_type:
            import torch

            pin = device_type == "cuda"
            self.slots = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(SLOTS)]
            self.nbytes, self.device_type = nbytes, device_type
        return self.slots


def _release(comm, keyval, pool):
    pool.slots = []


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_release)


def _pool(comm: MPI.Intracomm) -> _Pool:
    pool = comm.Get_attr(_KEYVAL)
    if pool is None:
        pool = _Pool()
        comm.Set_attr(_KEYVAL, pool)
    return pool


def pinned_bytes(comm: MPI.Intracomm) -> int:
    """Pinned host memory the staged transport holds for ``comm`` now."""
    pool = comm.Get_attr(_KEYVAL)
    return 0 if pool is None else pool.nbytes * len(pool.slots)


def allreduce(dflat: DeviceFlat, op: str, comm: MPI.Intracomm, step, chunk_bytes: int | None = None) -> None:
    """Allreduce the device buffer with the host step ``step(flat, op,
    comm)`` run on each pinned chunk, pipelined (module docstring)."""
    import torch

    t, itemsize = dflat.tensor, dflat.itemsize
    per = max(1, (chunk_bytes or CHUNK_BYTES) // itemsize)
    n = dflat.count
    bounds = list(range(0, n, per)) + [n]
    chunks = len(bounds) - 1
    dtype = getattr(torch, dflat.dtype)
    slots = [s[:per * itemsize].view(dtype) for s in _pool(comm).get(per * itemsize, t.device.type)]
    pool = _pool(comm)
    if chunks == 1:  # nothing to overlap: copy out and back on the caller's stream
        host = slots[0][:n]
        cuda = t.device.type == "cuda"
        if cuda and pool.released is not None:  # the last copy out of slot 0, on whichever stream
            torch.cuda.current_stream(t.device).wait_event(pool.released)
        host.copy_(t)  # waits for the copy (and the caller's queued work before it)
        step(as_flat(host), op, comm)
        t.copy_(host, non_blocking=True)
        if cuda:
            pool.released = torch.cuda.current_stream(t.device).record_event()
        return
    with Stream.of(t) as stream:
        if stream.cuda and pool.released is not None:
            stream.stream.wait_event(pool.released)
        arrived = [None] * chunks

        def fetch(i: int) -> None:
            lo, hi = bounds[i], bounds[i + 1]
            slots[i % SLOTS][:hi - lo].copy_(t[lo:hi], non_blocking=True)
            arrived[i] = stream.event()

        fetch(0)
        if chunks > 1:
            fetch(1)
        for i in range(chunks):
            lo, hi = bounds[i], bounds[i + 1]
            host = slots[i % SLOTS][:hi - lo]
            arrived[i].synchronize()
            arrived[i] = None
            step(as_flat(host), op, comm)
            t[lo:hi].copy_(host, non_blocking=True)
            if i + 2 < chunks:
                fetch(i + 2)
        if stream.cuda:
            pool.released = stream.stream.record_event()


def whole(dflat: DeviceFlat, op: str, comm: MPI.Intracomm, step, **options) -> None:
    """Run a host step that is not elementwise (reduce-scatter, allgather,
    broadcast) on a host copy of the whole device buffer, and copy the
    result back: ``step(flat, op, comm, **options)``."""
    t = dflat.tensor
    with Stream.of(t) as stream:
        host = t.to("cpu", non_blocking=False)
        stream.synchronize()
        step(as_flat(host), op, comm, **options)
        t.copy_(host)
