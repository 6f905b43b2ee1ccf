"""``oneshot``: the small-message allreduce of one node -- one write, one wait,
one read, whatever the number of ranks.

Message-passing algorithms pay a few microseconds of Python and MPI per
round, and recursive doubling takes log2 P rounds. On one node no message
need be sent: every rank of the communicator owns a *segment* of one MPI-3
shared window (allocated once per communicator, :data:`MAX_BYTES` per slot),
holding a sequence number and two slots. Call number c on rank r:

1. Write: copy the buffer into slot c % 2 of rank r's segment, then store c
   into rank r's sequence number.
2. Wait until every rank's sequence number is at least c.
3. Read: reduce slot c % 2 of every segment into the buffer (``avg`` then
   divides once): below 4 ranks a chain of ufunc calls in rank order,
   from 4 one ``ufunc.reduce`` over the slots as the rows of one strided
   array, which sums in numpy's own order (pairwise over many rows; float16
   accumulated in float32).

Every rank reduces the same P slots with the same operations in the same
order, so every rank gets the same bits.

Why no second barrier, and why two slots. A rank may return from call c and
start call c+1 while a slower peer is still reading slot c % 2 in step 3 of
call c. Call c+1 writes the *other* slot, so nothing is overwritten. And
call c+2, which writes slot c % 2 again, cannot begin before this rank's
step 2 of call c+1 has seen every peer's sequence number reach c+1 -- which
each peer stored only after finishing call c, its reads included. One slot
would need a barrier after the reads; two slots and the sequence numbers
are that barrier, paid one call later for free. The counts are the same on
every rank (calls are collective), so each rank counts its calls itself.

Memory ordering. Step 1 relies on a peer that sees the new sequence number
also seeing the slot's bytes written before it, and step 3 on the slot's
bytes being read after the sequence number. x86-64 guarantees both in
hardware (stores are seen in program order, loads are not reordered with
older loads), and each step is a separate C call that no compiler can move
across another, so on x86-64 nothing more is needed. On other
architectures (ARM, POWER), whose memory models allow both reorderings, the
module calls ``MPI_Win_sync`` -- a full memory barrier on the window --
between the write and the store, and between the wait and the read.

Waiting. A rank spins on its peers' sequence numbers for :data:`SPIN` polls
(a few microseconds: the common case when every rank has a core), then
yields its core (``sched_yield``) between polls, and after
:data:`NAP_AFTER` seconds sleeps briefly between them. With more ranks than
cores (``mpirun --oversubscribe``) a spinning rank would take the core from
the rank it waits for; yielding gives it back, and oneshot stays the fastest
of ours there too (5, 8 and 16 ranks on 2 cores: docs/results/allreduce.md,
"Small messages: oneshot"), so ``auto`` measures it and the agreement check
uses it wherever the ranks share a node. A rank that never arrives leaves
the others waiting inside the collective, where the stall watchdog
(:mod:`~hpcjobs.collectives.watchdog`) ends the job with its usual report.

The agreement check. Each segment also holds two signature slots of
:data:`~hpcjobs.collectives.agreement.SIG_WORDS` int64s. With checks on, on
one node, the check itself is a call of this protocol (:func:`agree`): each
rank writes its call's signature into signature slot c % 2 -- and, where
the collective would run this step next on a message of one piece, the
message into data slot c % 2 -- stores c, waits, and compares every rank's
signature with its own. Equal: the message is reduced and the collective is
done, one wait for check and data together. Different: every rank sees a
difference (its own differs from some other's, or some other's from it),
nothing is reduced, and every rank raises the same error. Whether a rank
carries its message depends only on its signature and on state that is the
same on every rank, so ranks whose signatures are equal all carried or all
did not; ranks whose signatures differ raise before any data moves.

Larger messages go in pieces of :data:`MAX_BYTES`, each one call; beyond a
few kilobytes the P-fold read makes ``shm`` or the ring faster, and ``auto``
measures where. Needs every rank on one node (ValueError otherwise).

Cost per rank for N bytes: no messages; one copy of N, one store, a wait,
and a read of P·N (the P slots) with one write of N. References: NCCL's LL
protocol and PyTorch's ``one_shot_all_reduce`` do the same on GPUs, with a
flag per line in place of the sequence number.

Step: :func:`allreduce`.
"""

from __future__ import annotations

import os
import platform
import time

import numpy as np
from mpi4py import MPI

from ._buffers import Flat, OP_TABLE, _bf16, finish_avg
from .agreement import SIG_WORDS
from ._frame import run
from ._shared import allocate_shared, free_window, is_single_node

__all__ = ["MAX_BYTES", "SPIN", "NAP_AFTER", "oneshot_allreduce", "allreduce", "agree"]

MAX_BYTES = 64 << 10  # per slot: the largest piece
SPIN = 200  # polls before yielding the core
NAP_AFTER = 0.001  # seconds of waiting before sleeping between polls
_HEADER = 64  # the sequence number, alone on its cache line
_SIG = 8 * SIG_WORDS  # bytes of one signature slot (the agreement check's, two of them)
_DATA = _HEADER + 2 * _SIG  # where the two data slots begin
_STACKED_FROM = 4  # ranks from which one ufunc.reduce over all slots beats a chain of ufunc calls
# x86 orders stores and loads as the protocol needs; elsewhere MPI_Win_sync does.
_WIN_SYNC = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686")


class _Segments:
    """One communicator's window: every rank's sequence number and slots."""

    def __init__(self, comm: MPI.Intracomm):
        size, rank = comm.Get_size(), comm.Get_rank()
        seg = -(-(_DATA + 2 * MAX_BYTES) // 4096) * 4096
        self.win = allocate_shared(seg, comm)  # contiguous where MPI can: see self.block
        raw = [np.frombuffer(self.win.Shared_query(q)[0], dtype=np.uint8, count=seg) for q in range(size)]
        # MPI lays the segments out one after another unless told otherwise;
        # then every rank's slot k is one strided 2-D array, reduced in one call.
        base = raw[0].__array_interface__["data"][0]
        contiguous = all(r.__array_interface__["data"][0] == base + q * seg for q, r in enumerate(raw))
        self.block = MPI.buffer.fromaddress(base, size * seg) if contiguous else None
        self.seg = seg
        self.seqs = [memoryview(r[:8]).cast("q") for r in raw]
        self.slots = [[r[_DATA + k * MAX_BYTES:_DATA + (k + 1) * MAX_BYTES] for r in raw] for k in range(2)]
        # signature slot k of every rank, as int64 memoryviews (compared in C, no numpy call)
        sigs = [[memoryview(r[_HEADER + k * _SIG:_HEADER + (k + 1) * _SIG].view(np.int64)) for r in raw]
                for k in range(2)]
        self.my_sig = [sigs[k][rank] for k in range(2)]
        self.other_sigs = [[v for q, v in enumerate(sigs[k]) if q != rank] for k in range(2)]
        self.seqs[rank][0] = 0
        self.calls = 0
        self.rank, self.size = rank, size
        self.plans: dict = {}  # (nbytes, dtype, op, k) -> plan()
        self.others = [self.seqs[q] for q in range(size) if q != rank]
        self.my_seq = self.seqs[rank]
        self.win.Sync()
        comm.Barrier()

    def plan(self, nbytes: int, dtype: str, np_dtype, op: str, k: int) -> tuple:
        """(this rank's slot k, every rank's slot k, the reduction) typed
        for one message shape, made once and kept (up to 64 shapes)."""
        views = [s[:nbytes].view(np_dtype) for s in self.slots[k]]
        mine = views[self.rank]
        if dtype == "bfloat16":
            import torch

            views = [_bf16(v) for v in views]
            fn = getattr(torch, OP_TABLE[op].torch)

            def reduce(out, views=views, fn=fn):
                out = _bf16(out)
                fn(views[0], views[1], out=out)
                for v in views[2:]:
                    fn(out, v, out=out)
        else:
            reduce = OP_TABLE[op].ufunc
            if self.block is not None and self.size >= _STACKED_FROM:
                # every rank's slot k as rows of one array: ufunc.reduce adds the rows in order
                rows = np.ndarray((self.size, nbytes // np_dtype.itemsize), dtype=np_dtype, buffer=self.block,
                                  offset=_DATA + k * MAX_BYTES, strides=(self.seg, np_dtype.itemsize))
                views = [rows]
        if len(self.plans) > 64:
            self.plans.clear()
        # how step 3 reduces: 0 two slots, 1 the rows of one array, 2 a chain, 3 bfloat16 via torch
        kind = 3 if dtype == "bfloat16" else 0 if len(views) == 2 else 1 if len(views) == 1 else 2
        plan = self.plans[(nbytes, dtype, op, k)] = (mine, views, reduce, kind)
        return plan

    def free(self) -> None:
        self.seqs, self.slots, self.plans, self.others, self.block, self.my_seq = [], [], {}, [], None, None
        self.my_sig, self.other_sigs = [], []
        free_window(self.win)


def _free(comm, keyval, segments):
    global _last
    if _last[1] is segments:
        _last = (None, None)
    if not MPI.Is_finalized():
        segments.free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free)


_last: tuple = (None, None)  # (communicator, its segments) of the last call: no attribute lookup per call


def _segments(comm: MPI.Intracomm) -> _Segments:
    """``comm``'s segments, made on first use (collective then), and kept as
    :data:`_last`, which the steps check before calling this."""
    global _last
    segments = comm.Get_attr(_KEYVAL)
    if segments is None:
        if not is_single_node(comm):
            raise ValueError("the oneshot allreduce needs every rank of the communicator on one node (shared "
                             "memory); across nodes use recursive_doubling or auto")
        segments = _Segments(comm)
        comm.Set_attr(_KEYVAL, segments)
    _last = (comm, segments)
    return segments


def _wait(seq, call: int) -> None:
    """Until the peer's sequence number ``seq[0]`` reaches ``call`` (module
    docstring)."""
    polls = 0
    while seq[0] < call:
        polls += 1
        if polls > SPIN:
            if polls == SPIN + 1:
                start = time.monotonic()
            os.sched_yield()
            if polls & 63 == 0 and time.monotonic() - start > NAP_AFTER:
                time.sleep(0.0001)


def _one(s: _Segments, data: np.ndarray | None, nbytes: int, dtype: str, op: str, sig: memoryview | None = None
         ) -> bool:
    """One call on ``data`` (at most MAX_BYTES; the steps in the docstring).
    With ``sig`` (the agreement check's SIG_WORDS int64s) every rank's
    signature goes in the same call, and ``data`` (None: none) is reduced
    only if all equal this one's. Returns whether they did (True without
    ``sig``)."""
    s.calls += 1
    call = s.calls
    k = call & 1
    if data is not None:
        plan = s.plans.get((nbytes, dtype, op, k)) or s.plan(nbytes, dtype, data.dtype, op, k)
        mine, views, reduce, kind = plan
        mine[...] = data  # 1. write
    if sig is not None:
        s.my_sig[k][:] = sig
    if _WIN_SYNC:
        s.win.Sync()
    s.my_seq[0] = call
    for seq in s.others:  # 2. wait
        if seq[0] < call:
            _wait(seq, call)
    if _WIN_SYNC:
        s.win.Sync()
    if sig is not None:
        for other in s.other_sigs[k]:
            if other != sig:
                return False
        if data is None:
            return True
    if kind == 0:  # 3. read
        reduce(views[0], views[1], out=data)
    elif kind == 1:  # the rows of one array
        reduce.reduce(views[0], axis=0, out=data)
    elif kind == 3:
        reduce(data)
    else:
        reduce(views[0], views[1], out=data)
        for v in views[2:]:
            reduce(data, v, out=data)
    return True


def allreduce(flat: Flat, op: str, comm: MPI.Intracomm) -> None:
    """The oneshot step (module docstring)."""
    last_comm, s = _last
    if last_comm is not comm:
        s = _segments(comm)
    data = flat.data
    stage = "sum" if op == "avg" else op
    if data.nbytes <= MAX_BYTES:
        _one(s, data, data.nbytes, flat.dtype, stage)
    else:
        per = MAX_BYTES // data.itemsize
        for lo in range(0, data.size, per):
            piece = data[lo:lo + per]
            _one(s, piece, piece.nbytes, flat.dtype, stage)
    if op == "avg":
        finish_avg(data, flat.dtype, s.size)


def _oneshot_next(flat: Flat, op: str, comm: MPI.Intracomm):
    """The step's answer to the frame's "would you run oneshot's step in one
    piece?" (:func:`hpcjobs.collectives.auto.oneshot_next` gives auto's):
    a function to call once the check carried the message, or None."""
    return _nothing if flat.data.nbytes <= MAX_BYTES else None


def _nothing() -> None:
    pass


allreduce.oneshot_next = _oneshot_next


def agree(comm: MPI.Intracomm, sig: memoryview, flat: Flat | None = None, op: str | None = None) -> bool:
    """The agreement check's exchange on the segment (module docstring, "The
    agreement check"): every rank's signature ``sig`` (SIG_WORDS int64s) in
    one call, with ``flat`` (at most MAX_BYTES) allreduced in the same call
    if given. Returns whether every rank's signature equals this one's;
    ``flat`` is reduced only then. Collective; every rank must pass a
    ``flat`` or none, which equal signatures guarantee where the caller
    offers one only when the step it would run next is this module's."""
    last_comm, s = _last
    if last_comm is not comm:
        s = _segments(comm)
    if flat is None:
        return _one(s, None, 0, "", "", sig)
    data = flat.data
    agreed = _one(s, data, data.nbytes, flat.dtype, "sum" if op == "avg" else op, sig)
    if agreed and op == "avg":
        finish_avg(data, flat.dtype, s.size)
    return agreed


def oneshot_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place through one shared segment per rank (module
    docstring): for small messages on one node.

    Args:
        buf: numpy array or torch tensor (CPU or CUDA, which is staged),
            contiguous and writable; same count and dtype on every rank.
        op: "sum", "avg", "min", "max" or "prod".
        comm: intracommunicator whose ranks all share one node; None for
            COMM_WORLD.

    Returns:
        ``buf``, reduced in place, bitwise identical on every rank.

    Raises:
        ValueError: the ranks are not all on one node, or a bad buffer or op
            (TypeError: an unsupported dtype).
    """
    return run(buf, op, comm, "oneshot_allreduce", allreduce)
