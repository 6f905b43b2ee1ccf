"""The MPI half of :mod:`hpcjobs.torch_backend`'s process group: the calls
that move data without reducing it (broadcast, scatter, all-to-all,
send/recv, barrier), on the group's private communicator, and the buffer
helpers both halves use, and the Work both return."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed import ReduceOp
from torch.futures import Future

from .collectives._buffers import as_flat


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``, a bool tensor as its bytes (uint8, the same memory): moving
    data, a bool is a byte (DDP broadcasts bool buffers)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _host(t: torch.Tensor) -> np.ndarray:
    """The bytes MPI moves for a contiguous CPU tensor: the collectives'
    wire view (bfloat16 and bool too), without a copy."""
    return as_flat(_bytes(t)).wire


def _real(t: torch.Tensor, op) -> torch.Tensor:
    """A complex tensor as its real pairs where ``op`` sums them (as torch's all_reduce hands them to a backend;
    its reduce and reduce_scatter do not, and Gloo takes them); else ``t``."""
    return torch.view_as_real(t) if t.is_complex() and op in (ReduceOp.SUM, ReduceOp.AVG) else t


def _cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where it is a contiguous CPU tensor, else a CPU copy."""
    return t if t.device.type == "cpu" and t.is_contiguous() else t.detach().to("cpu").contiguous()


def _into(t: torch.Tensor, work: torch.Tensor) -> None:
    """Copy a result back where ``work`` is a copy of ``t``."""
    if work is not t:
        t.copy_(work.view_as(t))


def _same_shapes(parts, out: torch.Tensor, size: int) -> None:
    if len(parts) != size or any(p.shape != out.shape for p in parts):
        raise ValueError(f"{size} input tensors shaped like the output {tuple(out.shape)} are needed, got "
                         f"{[tuple(p.shape) for p in parts]}")


def _multiple(output: torch.Tensor, input: torch.Tensor, size: int) -> None:  # noqa: A002
    if output.numel() != input.numel() * size:
        raise ValueError(f"the output holds {output.numel()} elements, not {size} x the input's {input.numel()}")


def _counts(tensors, size: int) -> None:
    if len(tensors) != size:
        raise ValueError(f"{size} tensors (one per rank) are needed, got {len(tensors)}")


class _Work(dist._Work):
    """A queued operation: ``wait()`` blocks until the worker has run it and
    raises what it raised (torch's future-wrapping Work does not)."""

    def __init__(self, fut: Future, group=None):
        super().__init__()
        self._fut, self._group = fut, group  # group: whose worker runs it (a collective's, not a send's)

    def wait(self, timeout=None) -> bool:
        """Block until done (raising the operation's error); with a
        ``timeout`` (a timedelta or seconds, 0: none), raise RuntimeError if
        it is not done by then (the operation itself goes on). Called on the
        group's worker (a callback chained on another of its futures), first
        run what is queued up to it, in order: the worker had waited for
        itself, with no collective in flight for the watchdog to see."""
        group = self._group
        while group is not None and threading.current_thread() is group._worker and not self._fut.done():
            try:
                item = group._queue.get_nowait()
            except queue.Empty:
                raise RuntimeError("the hpcjobs backend: a callback waits on its group's worker for an operation "
                                   "that worker is not running") from None
            if item is None:  # shut down behind it
                group._queue.put(None)
                raise RuntimeError("the hpcjobs backend: the process group was shut down before the operation ran")
            group._run(*item)
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if seconds:
            deadline = time.monotonic() + seconds
            while not self._fut.done():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the hpcjobs backend: an operation did not complete within {seconds:g} s")
                time.sleep(0.001)
        self._fut.wait()  # raises the operation's error
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> Future:
        # chained: DDP reads an error set on a Python future as a tensor ("Unable to cast ... to Tensor"),
        # and a callback's error as itself
        return self._fut.then(future_value)

    def result(self) -> list:
        """The operation's tensors, once it is done (as Gloo's Work gives them)."""
        self.wait()
        return self._fut.value()

    source = None  # a receive from any source: () -> the rank it came from

    def _source_rank(self) -> int:
        """The rank a receive from any source came from, once it is done (``dist.recv`` reads it)."""
        if self.source is None:
            raise ValueError("_source_rank: this Work is not a receive from any source")
        self.wait()
        return self.source()

    source_rank = _source_rank


def future_value(fut: Future):
    """A future's value, as a callback: ``fut.then(future_value)`` makes DDP
    see an error set on ``fut`` as itself (shared with :mod:`hpcjobs.ddp_hooks`)."""
    return fut.value()


class MPIOps:
    """Mixed into :class:`~hpcjobs._torch_group.HpcjobsProcessGroup`, which
    provides ``_submit``, ``_agree``, ``_comm``, ``rank()`` and ``size()``."""

    def scatter(self, output_tensors, input_lists, opts):
        root = opts.rootRank

        def run():
            out = output_tensors[0]

            def check():
                if self.rank() == root:
                    _same_shapes(input_lists[0], out, self.size())
            self._agree("scatter", check, count=out.numel(), dtype=str(out.dtype), root=root)
            work = _cpu(out)
            send = None
            if self.rank() == root:
                send = _host(torch.cat([_cpu(p).reshape(-1) for p in input_lists[0]]))
            self._comm.Scatter(send, _host(work), root=root)
            _into(out, work)
        return self._submit(run, output_tensors, [*output_tensors])

    def gather(self, output_lists, input_tensors, opts):
        """MPI_Gatherv to the root, the ranks' sizes as they are (it had been
        an allgather that only the root kept: every rank held every rank's
        tensor, and a ``dst`` the ranks disagreed on passed)."""
        root = opts.rootRank

        def run():
            inp = input_tensors[0]
            outs = list(output_lists[0]) if self.rank() == root else []

            self._agree("gather", dtype=str(inp.dtype).removeprefix("torch."), root=root)
            counts = self._comm.allgather(inp.numel())
            problem = None  # the root's alone, said on every rank (with the checks off too)
            if self.rank() == root and len(outs) != self.size():
                problem = f"gather: the root has {len(outs)} output tensors for {self.size()} ranks"
            elif self.rank() == root and any(o.dtype != inp.dtype for o in outs):
                problem = f"gather: the root's outputs and its input differ in dtype ({inp.dtype})"
            elif self.rank() == root and [o.numel() for o in outs] != counts:
                problem = (f"gather: the root's output tensors hold {[o.numel() for o in outs]} elements, the "
                           f"ranks' inputs {counts}")
            problem = self._comm.bcast(problem, root=root)
            if problem:
                raise ValueError(problem)
            got = torch.empty(sum(counts) if self.rank() == root else 0, dtype=inp.dtype)
            self._comm.Gatherv(_host(_cpu(inp).reshape(-1)), [_host(got), counts] if self.rank() == root else None,
                               root=root)
            offset = 0
            for o, n in zip(outs, counts):
                o.copy_(got[offset:offset + n].view_as(o))
                offset += n
        return self._submit(run, output_lists, [*input_tensors, *(output_lists[0] if output_lists else [])])

    def broadcast(self, tensors, opts):
        root = opts.rootRank

        def run():
            for t in tensors:
                self._agree("broadcast", count=t.numel(), dtype=str(t.dtype), root=root)
                work = _cpu(t)
                self._comm.Bcast(_host(work), root=root)
                _into(t, work)
        return self._submit(run, tensors, tensors)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        def run():
            self._agree("alltoall", lambda: _counts(input_tensors, self.size()),
                        dtype=str(input_tensors[0].dtype))
            send = torch.cat([_cpu(t).reshape(-1) for t in input_tensors])
            recv = torch.empty(sum(o.numel() for o in output_tensors), dtype=send.dtype)
            self._alltoallv(send, [t.numel() for t in input_tensors], recv, [o.numel() for o in output_tensors])
            off = 0
            for o in output_tensors:
                o.copy_(recv[off:off + o.numel()].view_as(o))
                off += o.numel()
        return self._submit(run, output_tensors, [*output_tensors, *input_tensors])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        def run():
            size = self.size()
            row = input[0].numel() if input.dim() > 1 and input.shape[0] else max(1, int(np.prod(input.shape[1:])))
            ins = list(input_split_sizes) or [input.shape[0] // size] * size
            outs = list(output_split_sizes) or [output.shape[0] // size] * size

            def check():  # as torch checks: rows left unsent, or splits past the tensor's end
                for what, t, given, splits in (("input", input, input_split_sizes, ins),
                                               ("output", output, output_split_sizes, outs)):
                    rows = t.shape[0] if t.dim() else 1
                    if not given and rows % size:
                        raise ValueError(f"all_to_all_single: the {what}'s {rows} rows do not divide by {size} "
                                         f"ranks: give {what}_split_sizes")
                    if len(splits) != size or min(splits) < 0 or sum(splits) != rows:
                        raise ValueError(f"all_to_all_single: {what}_split_sizes {list(splits)} must be {size} "
                                         f"sizes >= 0 that add up to the {what}'s {rows} rows")
                    if t.numel() != rows * row:
                        raise ValueError(f"all_to_all_single: the {what}'s rows hold {t.numel() // max(1, rows)} "
                                         f"elements, the input's {row}")
            self._agree("all_to_all_single", check, dtype=str(input.dtype), row=row)
            recv = torch.empty(output.numel(), dtype=output.dtype)
            self._alltoallv(_cpu(input).reshape(-1), [n * row for n in ins], recv, [n * row for n in outs])
            output.copy_(recv.view_as(output))
        return self._submit(run, output, [output, input])

    alltoall_base = all_to_all_single

    def _alltoallv(self, send: torch.Tensor, scounts, recv: torch.Tensor, rcounts) -> None:
        # every rank must expect what the others send it: one allgather of
        # the send counts checks the whole matrix on every rank
        matrix = np.array(self._comm.allgather(list(scounts)), dtype=np.int64)
        expected = matrix[:, self.rank()].tolist()
        mismatch = self._comm.allreduce(int(expected != list(rcounts)), op=MPI.MAX)
        if mismatch:
            raise ValueError(f"all_to_all: the ranks' send and receive sizes do not match (rank {self.rank()} "
                             f"expects {list(rcounts)}, is sent {expected})")
        sdispl = np.concatenate([[0], np.cumsum(scounts)[:-1]]).astype(int).tolist()
        rdispl = np.concatenate([[0], np.cumsum(rcounts)[:-1]]).astype(int).tolist()
        self._comm.Alltoallv([_host(send), (list(scounts), sdispl)], [_host(recv), (list(rcounts), rdispl)])

    def barrier(self, opts=None):
        return self._submit(self._comm.Barrier, None)

    # -- point to point -----------------------------------------------------

    # Nonblocking, completed off the worker (``_submit_requests``): isend and
    # irecv both ways between two ranks, as batch_isend_irecv posts them,
    # would otherwise block each worker in its Send.
    def send(self, tensors, dst: int, tag: int):
        bufs = []  # host copies made on the worker, after the ops queued before; alive until sent

        def post():
            bufs.extend(_cpu(t) for t in tensors)
            return [self._comm.Isend(_host(b), dest=dst, tag=tag) for b in bufs]
        return self._submit_requests(post, None, tensors)

    def recv(self, tensors, src: int, tag: int):
        works = []

        def post():
            works.extend(_cpu(t) for t in tensors)
            return [self._comm.Irecv(_host(w), source=src, tag=tag) for w in works]

        def finish():
            for t, work in zip(tensors, works):
                _into(t, work)
        return self._submit_requests(post, tensors, tensors, finish)

    def recv_anysource(self, tensors, tag: int):
        """``dist.recv(t)`` without ``src``: from whichever rank sends first;
        the Work's ``_source_rank()`` names it (it had raised on this rank
        alone, and the sender's message went to the next receive)."""
        works, statuses = [], []

        def post():
            works.extend(_cpu(t) for t in tensors)
            statuses.extend(MPI.Status() for _ in works)
            return [self._comm.Irecv(_host(w), source=MPI.ANY_SOURCE, tag=tag) for w in works]

        def finish():
            for t, work in zip(tensors, works):
                _into(t, work)
        work = self._submit_requests(post, tensors, tensors, finish, statuses)
        work.source = lambda: statuses[0].Get_source()
        return work
