"""The process group behind :mod:`hpcjobs.torch_backend` (its docstring
says what runs on what): torch.distributed's calls queued to one worker
thread per group and run on hpcjobs' collectives or MPI."""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import weakref

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed import ReduceOp
from torch.futures import Future

from .collectives.agreement import agree_or_raise
from .collectives.watchdog import guard
from ._torch_mpi import MPIOps, _bytes, _cpu, _host, _into, _multiple, _real, _same_shapes, _Work
from .comm import closed_at_exit, private, setting

BACKEND = "hpcjobs"
_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
        ReduceOp.PRODUCT: "prod"}
_BITWISE = {ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR}
_UNSUPPORTED = ("allgather_coalesced", "monitored_barrier", "split_group", "merge_remote_group")


def _op_name(op) -> str:
    """An op as the collectives' agreement names it ("sum", "bor"; it had read "sum; RedOpType.BOR")."""
    return _OPS.get(op) or str(op).rsplit(".", 1)[-1].lower()


def _op_code(opts) -> object:
    if opts is None:
        return ReduceOp.SUM
    op = opts.reduceOp.op if hasattr(opts.reduceOp, "op") else opts.reduceOp
    if op not in _OPS and op not in _BITWISE:
        raise NotImplementedError(f"the hpcjobs backend does not implement ReduceOp {op}")
    return op


class HpcjobsProcessGroup(MPIOps, dist.ProcessGroup):
    """A torch.distributed process group whose collectives are hpcjobs'
    (module docstring). ``comm``: the MPI communicator of the group's ranks,
    in group-rank order."""

    def __init__(self, comm: MPI.Intracomm | None = None, algorithm: str | None = None, *, owned: bool = False,
                 timeout: float | None = None):
        comm = comm if comm is not None else MPI.COMM_WORLD
        # how long a call may wait for the other ranks before the job is ended (init_process_group's timeout:
        # torch's default 30 min, as Gloo waits); None: HPCJOBS_TIMEOUT
        self._limit = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        super().__init__(comm.Get_rank(), comm.Get_size())
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("the hpcjobs backend needs MPI_THREAD_MULTIPLE (torch calls it from several "
                               f"threads); this MPI gives level {MPI.Query_thread()}")
        # Collective, here on the creating thread. A communicator of the group's own (``owned``: made for it),
        # freed at shutdown with what the library made on it: two groups' worker threads on one could cross.
        if comm is MPI.COMM_WORLD:  # its duplicate attaches the stall watchdog, whose report names the ranks
            private(comm)
        self._own = comm if owned else comm.Dup()
        self._comm = private(self._own, free_if_refused=True)
        self._algorithm = algorithm or setting("HPCJOBS_TORCH_ALGORITHM")
        self._queue: queue.Queue = queue.Queue()
        self._group_name = self._group_desc = ""
        self._closed = False  # shutdown() ran: nothing queued after it would run
        self._worker = threading.Thread(target=self._serve, name="hpcjobs-torch-backend", daemon=True)
        self._worker.start()
        _live.append(weakref.ref(self))

    # -- plumbing -----------------------------------------------------------

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(*item)

    def _run(self, fn, fut: Future, result, what: str) -> None:
        try:
            # watched as a whole, the agreement check and any MPI call
            # included: a rank that never arrives ends the job at
            # HPCJOBS_TIMEOUT instead of leaving the others blocked in MPI
            # grad mode is per thread: a copy into a Parameter (a broadcast's result) as on the caller's, under no_grad
            with guard(what, self._comm, self._limit), torch.no_grad():
                fn()
        except BaseException as e:  # noqa: BLE001 -- the caller's wait() raises it
            fut.set_exception(e)
        else:
            fut.set_result(result)

    def _submit(self, fn, result, tensors=()) -> dist.Work:
        """Queue ``fn`` for the worker; a Work whose future gives ``result``."""
        what = f"torch.distributed {sys._getframe(1).f_code.co_name} (hpcjobs backend)"  # the calling op
        self._check_open(what)
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        for d in devices:
            torch.cuda.current_stream(d).synchronize()
        def on_devices():  # the op's GPU work is done when its future completes
            # on the tensors' GPU: a new thread's current device is 0, and the collectives take the current one
            # for this rank's (DDP after set_device(local_rank) failed on every GPU but the first)
            with torch.cuda.device(next(iter(devices))) if len(devices) == 1 else contextlib.nullcontext():
                fn()
            for d in devices:
                torch.cuda.current_stream(d).synchronize()

        run = on_devices if devices else fn
        fut: Future = Future()
        if threading.current_thread() is self._worker:
            # Called from a callback chained on one of this group's futures
            # (they run on the worker that completes them): DDP's PowerSGD
            # hook issues and waits on collectives there. Run it now, in the
            # same order on every rank; queued, it would wait for itself.
            self._run(run, fut, result, what)
        else:
            self._queue.put((run, fut, result, what))
        return _Work(fut, self)

    def _submit_requests(self, post, result, tensors=(), finish=None, statuses=None) -> dist.Work:
        """Queue ``post`` (it starts nonblocking MPI requests and returns them)
        in order with the collectives; the Work completes when the requests
        have (their ``statuses`` filled, where given), then ``finish()``,
        waited for on a thread of its own. Blocking
        there instead would let a queued isend hold the worker while the
        matching irecv waits behind it: an exchange both ways deadlocked."""
        what = f"torch.distributed {sys._getframe(1).f_code.co_name} (hpcjobs backend)"
        self._check_open(what)
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        for d in devices:  # on the caller's thread and stream, as _submit does
            torch.cuda.current_stream(d).synchronize()
        fut: Future = Future()

        def complete(reqs):
            MPI.Request.Waitall(reqs, statuses)
            if finish is not None:
                with torch.cuda.device(next(iter(devices))) if len(devices) == 1 else contextlib.nullcontext():
                    finish()
            for d in devices:
                torch.cuda.current_stream(d).synchronize()

        def start():
            try:
                reqs = post()
            except BaseException as e:  # noqa: BLE001 -- the caller's wait() raises it
                fut.set_exception(e)
                return
            threading.Thread(target=self._run, args=(lambda: complete(reqs), fut, result, what),
                             name="hpcjobs-torch-p2p", daemon=True).start()

        if threading.current_thread() is self._worker:
            start()
        else:
            self._queue.put((start, Future(), None, what))
        return _Work(fut)

    def _check_open(self, what: str) -> None:
        if self._closed and threading.current_thread() is not self._worker:  # queued, it would wait forever
            raise RuntimeError(f"{what}: the process group was shut down (destroy_process_group); "
                               "init_process_group again to go on")

    def _agree(self, what: str, check=None, **fields) -> None:
        """Every rank has the same ``fields`` and passed ``check`` (a callable
        raising ValueError/TypeError/NotImplementedError on bad input), or
        every rank raises (collective)."""
        error = None
        if check is not None:
            try:
                check()
            except (ValueError, TypeError, NotImplementedError) as e:
                error = e
        # on the communicator hpcjobs' collectives agree on (theirs of self._comm), so that a rank here and a
        # rank in their check (an allreduce of another op or dtype: a bitwise one here, a sum there) meet
        agree_or_raise(private(self._comm), what, fields, error)

    def getBackendName(self) -> str:  # noqa: N802 -- torch's name
        return BACKEND

    # torch keeps a group's name and description in its backends, and a
    # Python group has none: without these, ``group_name`` raises "ProcessGroup
    # name not set" and ``destroy_process_group(subgroup)`` fails.
    def getGroupName(self) -> str:  # noqa: N802 -- torch's name
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 -- torch's name
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802 -- torch's name
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 -- torch's name
        self._group_desc = desc

    def __repr__(self) -> str:
        return f"HpcjobsProcessGroup(rank={self.rank()}, size={self.size()}, algorithm={self._algorithm!r})"

    def shutdown(self) -> None:
        """Run what is queued, stop the worker, free the group's communicator
        (collective: ``destroy_process_group`` calls it on the group's ranks;
        at exit, every group in the order made, before MPI_Finalize)."""
        self._closed = True
        if self._worker.is_alive():
            self._queue.put(None)
            if threading.current_thread() is self._worker:
                return
            self._worker.join()
        if self._own != MPI.COMM_NULL and not MPI.Is_finalized():
            self._own.Free()  # collective: its duplicate's windows go with it

    # -- reductions ---------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op = _op_code(opts)
        return self._submit(lambda: [self._allreduce_one(t, op) for t in tensors], tensors, tensors)

    def _allreduce_one(self, t: torch.Tensor, op) -> None:
        if t.dtype == torch.bool:  # as torch's NCCL backend: sum is any (max), product all (min), on the bytes
            def check():
                if op == ReduceOp.AVG:
                    raise NotImplementedError("all_reduce of bool tensors with AVG: there is no bool average")
            self._agree("allreduce", check, dtype="bool", op=_op_name(op))  # (spelt as the collectives spell them)
            op = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN}.get(op, op)
            t = t.view(torch.uint8)
        if op in _BITWISE:
            def bits():  # on a float's bits they give nonsense; Gloo refuses them too
                if t.dtype.is_floating_point or t.dtype.is_complex:
                    raise TypeError(f"all_reduce with {op}: bitwise, for integer and bool tensors, not {t.dtype}")
            self._agree("allreduce", bits, count=t.numel(), dtype=str(t.dtype).removeprefix("torch."), op=_op_name(op))
            work = _cpu(t)
            self._comm.Allreduce(MPI.IN_PLACE, _host(work), op=_BITWISE[op])
            _into(t, work)
            return
        from .collectives import allreduce

        # count, dtype and op are agreed inside; CUDA tensors stay on the GPU
        work = t if t.is_contiguous() else t.contiguous()
        allreduce(work, _OPS[op], self._algorithm, self._comm)
        _into(t, work)

    def allreduce_coalesced(self, tensors, opts=None):
        op = _op_code(opts)

        def run():
            self._agree("allreduce_coalesced", count=len(tensors),
                        dtypes=",".join(str(t.dtype) for t in tensors))
            by_kind: dict = {}
            for t in tensors:
                by_kind.setdefault((t.dtype, t.device), []).append(t)
            for group in by_kind.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                self._allreduce_one(flat, op)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        return self._submit(run, tensors, tensors)

    def reduce(self, tensors, opts):
        op, root = _op_code(opts), opts.rootRank

        def run():
            # an allreduce whose result only the root keeps: the other
            # ranks' tensors are left as they were (the root agreed first: a rank naming another kept the sum)
            self._agree("reduce", root=root)
            for t in tensors:
                t = _real(t, op)
                keep = None if self.rank() == root else t.detach().clone()
                self._allreduce_one(t, op)
                if keep is not None:
                    t.copy_(keep)
        return self._submit(run, tensors, tensors)

    def _reduce_scatter_flat(self, out: torch.Tensor, flat: torch.Tensor, op) -> None:
        from .collectives import ring_reduce_scatter

        if flat.is_complex() and out.is_complex():
            flat, out = _real(flat, op).reshape(-1), _real(out, op)

        def check():
            if flat.numel() != out.numel() * self.size():
                raise ValueError(f"rank {self.rank()}: the input holds {flat.numel()} elements, not "
                                 f"{self.size()} x the output's {out.numel()}")
            if op in _BITWISE or flat.dtype == torch.bool:
                raise NotImplementedError(f"the hpcjobs backend does not implement reduce_scatter with {op} "
                                          f"on {flat.dtype}")
            if out.dtype != flat.dtype:  # (it was cast silently; Gloo refuses)
                raise TypeError(f"rank {self.rank()}: reduce_scatter's output is {out.dtype}, its input "
                                f"{flat.dtype}")
        self._agree("reduce_scatter", check, count=flat.numel(), dtype=str(flat.dtype), op=str(op))
        work = flat.detach().to("cpu", copy=True).contiguous()  # a copy: the input is not ours to change
        ring_reduce_scatter(work, _OPS[op], self._comm)
        n = out.numel()
        out.copy_(work[self.rank() * n:(self.rank() + 1) * n].view_as(out))

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        op = _op_code(opts)

        def run():
            for out, parts in zip(output_tensors, input_lists):
                self._agree("reduce_scatter", lambda: _same_shapes(parts, out, self.size()), parts=len(parts))
                self._reduce_scatter_flat(out, torch.cat([p.reshape(-1) for p in parts]), op)
        return self._submit(run, output_tensors, [*output_tensors, *[p for ps in input_lists for p in ps]])

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 -- torch's name
        op = _op_code(opts)
        return self._submit(lambda: self._reduce_scatter_flat(output, input.reshape(-1), op), output,
                            [output, input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = _op_code(opts)

        def run():
            for out, inp in zip(outputs, inputs):
                self._reduce_scatter_flat(out, inp.reshape(-1), op)
        return self._submit(run, outputs, [*outputs, *inputs])

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- gathers ------------------------------------------------------------

    def _allgather_into(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        from .collectives import ring_allgather, ring_allgatherv

        if inp.dtype == torch.bool and all(o.dtype == torch.bool for o in outs):
            outs, inp = [_bytes(o) for o in outs], _bytes(inp)

        def check():
            if len(outs) != self.size():
                raise ValueError(f"rank {self.rank()}: {len(outs)} output tensors for {self.size()} ranks")
            if outs[self.rank()].numel() != inp.numel():
                raise ValueError(f"rank {self.rank()}: its output holds {outs[self.rank()].numel()} elements, "
                                 f"its input {inp.numel()}")
            if any(o.dtype != inp.dtype for o in outs):
                raise TypeError(f"rank {self.rank()}: outputs and input differ in dtype")
        equal = len(outs) == self.size() and all(o.numel() == inp.numel() for o in outs)
        self._agree("allgather", check, dtype=str(inp.dtype), equal=equal,
                    sizes=",".join(str(o.numel()) for o in outs))
        src = _cpu(inp).reshape(-1)
        if equal:
            n = inp.numel()
            buf = torch.empty(self.size() * n, dtype=inp.dtype)
            buf[self.rank() * n:(self.rank() + 1) * n] = src
            ring_allgather(buf, self._comm)
            parts = [buf[q * n:(q + 1) * n] for q in range(self.size())]
        else:
            got = ring_allgatherv([_host(src)], self._comm)
            parts = []
            for g in got:
                part = torch.empty(g[0].size, dtype=inp.dtype)
                _host(part)[:] = g[0]
                parts.append(part)
        for o, part in zip(outs, parts):
            o.copy_(part.view_as(o))

    def allgather(self, output_lists, input_tensors, opts=None):
        def run():
            for outs, inp in zip(output_lists, input_tensors):
                self._allgather_into(list(outs), inp)
        return self._submit(run, output_lists, [*input_tensors, *[o for os_ in output_lists for o in os_]])

    def _gather_into_tensor(self, output: torch.Tensor, inp: torch.Tensor) -> None:
        self._agree("all_gather_into_tensor", lambda: _multiple(output, inp, self.size()))
        # chunks of a view: a non-contiguous output would reshape to a copy, and the results land there
        flat = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        self._allgather_into(list(flat.reshape(-1).chunk(self.size())), inp)
        if flat is not output:
            output.copy_(flat)

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 -- torch's name
        return self._submit(lambda: self._gather_into_tensor(output, input), output, [output, input])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        def run():
            for o, i in zip(outputs, inputs):
                self._gather_into_tensor(o, i)
        return self._submit(run, outputs, [*outputs, *inputs])

    all_gather_single_coalesced = allgather_into_tensor_coalesced


def _refuse(name: str):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"the hpcjobs backend does not implement {name}")
    refuse.__name__ = name
    return refuse


for _name in _UNSUPPORTED:
    setattr(HpcjobsProcessGroup, _name, _refuse(_name))


_live = closed_at_exit("shutdown")  # weak references to every group, in the order made
