"""``cuda_ipc``: the allreduce of GPU buffers on one node, through CUDA IPC --
each rank reduces its shard straight out of its peers' device memory.

The GPU counterpart of :mod:`~hpcjobs.collectives.shm`. A process cannot
read another's device memory by address, but CUDA can export an allocation
as an IPC handle that another process on the node opens as a pointer into
the same memory (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``; torch
wraps them in ``torch.multiprocessing.reductions.reduce_tensor``). Each rank
keeps two device staging buffers per communicator, exports them once and
opens every peer's (an ``allgather`` of the handles over MPI), and from then
on every call is a "two-shot" allreduce over P ranks of N bytes:

1. copy the tensor into this rank's staging buffer;
2. *fence*; rank r reduces shard r (N/P bytes) of every rank's staging
   buffer, in rank order ``((b0 op b1) op b2) ...``, into its tensor's shard
   r and its staging buffer's;
3. *fence*; rank r copies every other shard q from rank q's staging buffer.

Each shard is reduced once, by one rank, and copied as it is, so every rank
ends with the same bits. The reduction is a chain of P-1 elementwise torch
ops, each reading two shards and writing one; ranks 0 and 1 read their own
shard from their tensor (it is an operand of the first op), the others from
their staging buffer. Through the HBM of P ranks sharing one GPU a call
moves, for N bytes: copy in 2PN less 2N/P for each of ranks 0 and 1; reduce
3(P-1)N; each reduced shard into its staging buffer 2N; copy out 2(P-1)N --
9N at 2 ranks, 24N at 4. With a GPU per rank each device moves about a P-th
of that, and (P-1)/P·N of it comes over the peer links.

One-shot, for messages up to :data:`ONE_SHOT_BYTES`: after step 1's fence
every rank reduces the *whole* buffer out of every peer's staging buffer, in
rank order, into its tensor -- P times the reads, but one fence instead of
two, and where ranks share a GPU each fence costs a turn of every process
on it. Every rank runs the same kernels on the same inputs in the same
order, so the results are bitwise the same everywhere.

A *fence* is the point after which a rank may read what every peer wrote
before it. ``HPCJOBS_CUDA_IPC_SYNC=events`` (the default): each rank records
an interprocess CUDA event on its stream, an ``MPI_Barrier`` tells every
rank that all events of this phase are recorded, and each rank's stream
waits for its peers' events on the device -- the host never waits for the
GPU. ``host``: each rank synchronises its stream, then the barrier; simpler,
and slower where ranks share a GPU (the host waits out every time slice).

Why two staging buffers, used in turn: in call n+1 the peers may still be
reading this rank's buffer of call n (step 3 is the last thing they do), so
call n+1 writes the other one; and before call n+2 writes the first again,
its step-1 fence has made this rank's stream wait for every peer's step 1 of
call n+1, which each peer queued after its step 3 of call n.

Messages larger than a staging buffer (:data:`CAPACITY`) go in pieces of
that size. dtypes: those torch reduces on CUDA
(:data:`~hpcjobs.collectives.device.DEVICE_REDUCE_DTYPES`); uint16/32/64
raise TypeError (``auto`` and the host algorithms stage them instead).

Placement. Several ranks may share one GPU (each its own process and
context; the GPU time-slices them) or each have its own: the peer's memory
then lies on another device, read over NVLink or PCIe where peer access is
enabled (a copy into this rank's device first). Every rank must be able to
open every peer's handles, so each rank must see all the node's GPUs
(select yours with ``torch.cuda.set_device``, not by hiding the others with
``CUDA_VISIBLE_DEVICES``). If any rank cannot open a handle, every rank
learns it at the exchange and raises :class:`IpcUnavailable`;
``allreduce(algorithm=...)`` then runs the staged transport on every rank
together.

With a CPU tensor the same steps run over an MPI-3 shared window instead of
IPC handles: that is how CI, without a GPU, tests the sharding, the fences'
placement and the buffer alternation.

References: PyTorch SymmetricMemory's ``two_shot_all_reduce_``, vLLM's
custom allreduce, NCCL's LL protocols (one-shot) and ring.

Steps: :func:`allreduce`, :func:`reduce_scatter`, :func:`allgather`.
"""

from __future__ import annotations

import atexit
import os
import time

from mpi4py import MPI

from ..comm import SAME_EVERYWHERE, setting
from ._buffers import OP_TABLE, chunk_bounds
from ._shared import free_window, is_single_node, shared_window
from .device import DEVICE_REDUCE_DTYPES, DeviceFlat, Stream, divide

__all__ = ["CAPACITY", "ONE_SHOT_BYTES", "SYNC_MODES", "IpcUnavailable", "allreduce", "reduce_scatter", "allgather",
           "device_bytes", "sync_mode", "unavailable"]

# Largest staging buffer, in bytes (two per communicator and rank).
CAPACITY = 256 << 20
# Messages up to this size take the one-shot path (docs/results/gpu.md);
# HPCJOBS_CUDA_IPC_ONE_SHOT=<bytes> overrides it, 0 turns it off. A bad one
# is not raised here at import, on this rank alone: hpcjobs.comm reports
# ENV_ERROR on every rank as the communicators are made.
try:
    ONE_SHOT_BYTES, ENV_ERROR = int(setting("HPCJOBS_CUDA_IPC_ONE_SHOT")), None
    if ONE_SHOT_BYTES < 0:
        raise ValueError
except ValueError:
    ONE_SHOT_BYTES = int(SAME_EVERYWHERE["HPCJOBS_CUDA_IPC_ONE_SHOT"])
    ENV_ERROR = (f"HPCJOBS_CUDA_IPC_ONE_SHOT={os.environ['HPCJOBS_CUDA_IPC_ONE_SHOT']!r} is not a number of bytes "
                 ">= 0 (0: no one-shot)")
_MIN_BYTES = 1 << 20
SYNC_MODES = ("events", "host")
HOST_BUFFER = "cuda_ipc reduces CUDA tensors; this buffer is in host memory (use shm or auto)"


class IpcUnavailable(RuntimeError):
    """Some rank could not open its peers' IPC handles; raised on every rank
    with the same message."""


def sync_mode() -> str:
    """The fence (module docstring): ``HPCJOBS_CUDA_IPC_SYNC``, "events" by
    default."""
    mode = setting("HPCJOBS_CUDA_IPC_SYNC")
    if mode not in SYNC_MODES:
        raise ValueError(f"HPCJOBS_CUDA_IPC_SYNC={mode!r}; choose one of {', '.join(SYNC_MODES)}")
    return mode


class _Buffers:
    """Two staging buffers of ``nbytes`` on every rank, each rank's opened
    by every other: ``views[k][q]`` is rank q's buffer k (uint8)."""

    def __init__(self, comm: MPI.Intracomm, nbytes: int, like):
        import torch

        self.nbytes, self.win, self.views, self.events = nbytes, None, [], []
        self.cuda = like.device.type == "cuda"
        rank, size = comm.Get_rank(), comm.Get_size()
        error = None
        if not self.cuda:  # the CI stand-in: a shared window
            self.win, segments = shared_window(2 * nbytes, comm)
            whole = [torch.from_numpy(s) for s in segments]
            self.views = [[w[k * nbytes:(k + 1) * nbytes] for w in whole] for k in range(2)]
            return
        from torch.multiprocessing.reductions import reduce_tensor

        own, events, exported = [], [], None
        try:  # a failure here (out of memory, no IPC) must still reach the allgather
            own = [torch.empty(nbytes, dtype=torch.uint8, device=like.device) for _ in range(2)]
            events = [torch.cuda.Event(interprocess=True) for _ in range(2)]
            for e in events:  # a handle needs a recorded event
                e.record()
            exported = ([reduce_tensor(b) for b in own], [e.ipc_handle() for e in events])
        except Exception as e:
            error = f"rank {rank} cannot export its staging buffers: {type(e).__name__}: {e}"
        handles = comm.allgather(exported)
        views = [[None] * size for _ in range(2)]
        peer_events = [[None] * size for _ in range(2)]
        for q, theirs in enumerate(handles):
            if theirs is None or exported is None:
                continue
            bufs, evs = theirs
            for k in range(2):
                if q == rank:
                    views[k][q], peer_events[k][q] = own[k], events[k]
                    continue
                try:
                    fn, args = bufs[k]
                    views[k][q] = fn(*args)
                    peer_events[k][q] = torch.cuda.Event.from_ipc_handle(like.device, evs[k])
                except Exception as e:  # a container without IPC, no peer access, ...
                    error = error or f"rank {rank} cannot open rank {q}'s CUDA IPC handle: {type(e).__name__}: {e}"
        reasons = [r for r in comm.allgather(error) if r]
        if reasons:
            raise IpcUnavailable("; ".join(reasons))
        self.views, self.events, self.own = views, peer_events, own

    def free(self) -> None:
        self.views, self.events = [], []
        if self.win is not None:
            free_window(self.win)
            self.win = None


class _State:
    def __init__(self):
        self.buffers: _Buffers | None = None
        self.turn = 0
        # why the buffers could not be opened, by kind (True: CUDA IPC, False:
        # the host stand-in); kept, so every later call falls back at once
        self.failed: dict[bool, str] = {}


def _free(comm, keyval, state):
    if not MPI.Is_finalized() and state.buffers is not None:
        state.buffers.free()
    _LIVE.pop(id(state), None)


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free)
_LIVE: dict = {}  # id(state) -> (comm, state), every communicator with buffers


@atexit.register
def _release_at_exit() -> None:
    """Close the peers' buffers, wait (up to 2 s, never hanging on a rank
    that died) until every peer has closed this rank's, then free them: a
    process that exits while peers hold its memory makes torch warn
    "Producer process has been terminated before all shared CUDA tensors
    released". Runs before mpi4py's MPI_Finalize (atexit is last in, first out)."""
    for comm, state in list(_LIVE.values()):
        b = state.buffers
        if b is None or not b.cuda or MPI.Is_finalized():
            continue
        rank = comm.Get_rank()
        b.views = [[v if q == rank else None for q, v in enumerate(row)] for row in b.views]
        b.events = []
        request = comm.Ibarrier()
        deadline = time.monotonic() + 2.0
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(0.001)
        state.buffers = None
    _LIVE.clear()


def _state(comm: MPI.Intracomm, nbytes: int, like) -> tuple[_State, _Buffers]:
    """The communicator's buffers, (re)made collectively when too small.
    Every rank sees the same ``nbytes`` (the agreed count), so every rank
    grows its buffers in the same call."""
    state = comm.Get_attr(_KEYVAL)
    if state is None:
        state = _State()
        comm.Set_attr(_KEYVAL, state)
    cuda = like.device.type == "cuda"
    if cuda in state.failed:  # a CUDA failure says nothing about the host stand-in, nor the other way round
        raise IpcUnavailable(state.failed[cuda])
    b = state.buffers
    if b is None or b.nbytes < nbytes or b.cuda != cuda:
        if b is not None:
            b.free()
            state.buffers = None
        size = min(CAPACITY, max(_MIN_BYTES, 1 << (max(nbytes, 1) - 1).bit_length()))
        try:
            state.buffers = _Buffers(comm, size, like)
        except IpcUnavailable as e:
            state.failed[cuda] = str(e)
            raise
        _LIVE[id(state)] = (comm, state)
    return state, state.buffers


def unavailable(comm: MPI.Intracomm, nbytes: int, like) -> str | None:
    """Make this communicator's buffers for ``nbytes`` (collective over
    ``comm``) and return why they cannot be opened, or None: for callers
    that must agree on a fallback over a wider communicator than ``comm``
    (``hierarchical`` across nodes)."""
    try:
        _state(comm, min(nbytes, CAPACITY), like)
    except IpcUnavailable as e:
        return str(e)
    return None


def device_bytes(comm: MPI.Intracomm) -> int:
    """Device memory this transport holds for ``comm`` on this rank now."""
    state = comm.Get_attr(_KEYVAL)
    return 0 if state is None or state.buffers is None else 2 * state.buffers.nbytes


def _check(dflat: DeviceFlat, comm: MPI.Intracomm, op: str | None) -> None:
    if op is not None and dflat.dtype not in DEVICE_REDUCE_DTYPES:
        raise TypeError(f"cuda_ipc reduces {', '.join(DEVICE_REDUCE_DTYPES)} on the device, not {dflat.dtype} "
                        "(torch has no CUDA arithmetic for it); use algorithm='auto' or a host algorithm, "
                        "which stage it through host memory")
    if not is_single_node(comm):
        raise ValueError("cuda_ipc needs every rank of the communicator on one node; across nodes use "
                         "hierarchical (intra='cuda_ipc') or auto")


def _fence(buffers: _Buffers, k: int, comm: MPI.Intracomm, stream: Stream, mode: str) -> None:
    """After this, every peer's work queued before its fence is visible here."""
    if not buffers.cuda:
        comm.Barrier()
        return
    if mode == "host":
        stream.synchronize()
        comm.Barrier()
        return
    rank = comm.Get_rank()
    buffers.events[k][rank].record(stream.stream)
    comm.Barrier()
    for q, e in enumerate(buffers.events[k]):
        if q != rank:
            stream.stream.wait_event(e)


def _typed(buffers: _Buffers, k: int, dflat: DeviceFlat) -> list:
    import torch

    dtype = getattr(torch, dflat.dtype)
    n = dflat.nbytes
    return [v[:n].view(dtype) for v in buffers.views[k]]


def _near(view, like):
    """``view`` where torch can reduce it with ``like``: itself on the same
    device, else a copy over the peer link."""
    return view if view.device == like.device else view.to(like.device, non_blocking=True)


def _pieces(dflat: DeviceFlat):
    per = max(1, CAPACITY // dflat.itemsize)
    for lo in range(0, dflat.count, per):
        yield dflat.slice(lo, min(lo + per, dflat.count))


def _reduce_shard(t, peers: list, lo: int, hi: int, op: str) -> None:
    """``t[lo:hi] = peers[0][lo:hi] op peers[1][lo:hi] op ...``, in rank order."""
    import torch

    fn = getattr(torch, OP_TABLE[op].torch)
    acc = t[lo:hi]
    fn(_near(peers[0][lo:hi], acc), _near(peers[1][lo:hi], acc), out=acc)
    for q in range(2, len(peers)):
        fn(acc, _near(peers[q][lo:hi], acc), out=acc)


def _phases(dflat: DeviceFlat, op: str | None, comm: MPI.Intracomm, gather: bool) -> None:
    """One piece: copy in, fence, reduce own shard (op not None), fence,
    copy the others' shards out (gather)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return
    state, buffers = _state(comm, dflat.nbytes, dflat.tensor)
    k = state.turn
    state.turn ^= 1
    mode = sync_mode()
    t = dflat.tensor
    peers = _typed(buffers, k, dflat)
    b = chunk_bounds(dflat.count, size)
    lo, hi = b[rank], b[rank + 1]
    one_shot = op is not None and gather and dflat.nbytes <= ONE_SHOT_BYTES
    # Ranks 0 and 1 read their own shard where it is: it is an operand of the
    # chain's first op, before that op overwrites it. The others copy it too.
    own_in_place = op is not None and not one_shot and rank < 2
    with Stream.of(t) as stream:
        if op is None:  # allgather: only this rank's shard is valid
            peers[rank][lo:hi].copy_(t[lo:hi])
        elif own_in_place:  # the peers read every shard but this one
            peers[rank][:lo].copy_(t[:lo])
            peers[rank][hi:].copy_(t[hi:])
        else:
            peers[rank].copy_(t)
        _fence(buffers, k, comm, stream, mode)
        if one_shot:  # every shard here
            lo, hi, gather = 0, dflat.count, False
        if op is not None and hi > lo:
            sources = [t if q == rank and own_in_place else p for q, p in enumerate(peers)]
            _reduce_shard(t, sources, lo, hi, "sum" if op == "avg" else op)
            if op == "avg":
                divide(t[lo:hi], dflat.dtype, size)
            if gather:
                peers[rank][lo:hi].copy_(t[lo:hi])
        if gather:
            if op is not None:
                _fence(buffers, k, comm, stream, mode)
            for q in range(size):
                if q != rank and b[q + 1] > b[q]:
                    t[b[q]:b[q + 1]].copy_(peers[q][b[q]:b[q + 1]])


def _device_flat(flat) -> DeviceFlat:
    if not isinstance(flat, DeviceFlat):
        raise ValueError(HOST_BUFFER)
    return flat


def allreduce(dflat: DeviceFlat, op: str, comm: MPI.Intracomm) -> None:
    """The two-shot allreduce (module docstring), in place."""
    _check(_device_flat(dflat), comm, op)
    for piece in _pieces(dflat):
        _phases(piece, op, comm, gather=True)


def reduce_scatter(dflat: DeviceFlat, op: str, comm: MPI.Intracomm) -> None:
    """Steps 1-2 only: rank r ends with shard r (``chunk_bounds(count, P)``)
    of the reduction in place; the other shards are left as they were.
    ``avg`` divides the shard by the size of ``comm``."""
    _check(_device_flat(dflat), comm, op)
    if dflat.count > max(1, CAPACITY // dflat.itemsize):
        raise ValueError(f"cuda_ipc reduce_scatter takes up to {CAPACITY} bytes, got {dflat.nbytes}")
    _phases(dflat, op, comm, gather=False)


def allgather(dflat: DeviceFlat, comm: MPI.Intracomm) -> None:
    """Every rank's shard r (``chunk_bounds(count, P)``) to every rank."""
    _check(_device_flat(dflat), comm, None)
    if dflat.count > max(1, CAPACITY // dflat.itemsize):
        raise ValueError(f"cuda_ipc allgather takes up to {CAPACITY} bytes, got {dflat.nbytes}")
    _phases(dflat, None, comm, gather=True)


allreduce.takes_device = reduce_scatter.takes_device = allgather.takes_device = True
