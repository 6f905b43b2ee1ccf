"""torch.distributed backend ``"hpcjobs"``: DDP and every torch.distributed
call on hpcjobs' collectives, under mpirun or srun.

Importing this module registers the backend::

    import torch.distributed as dist
    import hpcjobs.torch_backend  # noqa: F401  registers "hpcjobs"

    dist.init_process_group("hpcjobs")       # rank and size from MPI
    model = torch.nn.parallel.DistributedDataParallel(model)

How it works:

1. **Rendezvous.** ``init_process_group`` with no ``init_method`` uses
   ``env://``, which wants ``MASTER_ADDR``. This backend needs no TCP
   store: where ``MASTER_ADDR`` is unset, the ``env://`` handler installed
   here takes rank and size from ``MPI_COMM_WORLD`` and gives torch a
   process-local store (which nothing of ours reads; asked for a key only
   another rank could set, as a Gloo side group's rendezvous does, it says
   at once that MASTER_ADDR is needed). Where it is set,
   torch's own handler runs, so Gloo or NCCL groups beside ours keep working.
   Without ``MASTER_ADDR`` only this backend can start: ``init_process_group``
   with another (gloo, nccl, none named) raises ValueError at once saying
   so, where a Gloo group had waited on the local store for its timeout
   (30 minutes) and then failed naming a store key.
2. **One process group = one MPI communicator.** The default group is
   ``COMM_WORLD``; ``new_group(ranks)`` builds ``MPI_Comm_create_group`` over
   those world ranks (only the members call the creator, as torch does).
   Every group reduces on its own private duplicate, so no message of ours
   meets a user's MPI traffic.
3. **Asynchronous work.** Each group has one worker thread; a call queues
   its operation and returns a ``Work`` carrying a ``torch.futures.Future``
   that the worker completes (DDP calls ``allreduce`` from autograd's thread
   and chains ``then`` callbacks on the future). One worker per group runs
   the operations in the order they were issued, which is the same on every
   rank, so the collectives match. This needs ``MPI_THREAD_MULTIPLE``
   (mpi4py's default); a lower level is refused when the group starts.
4. **What runs on what.** allreduce (sum, avg, min, max, product) and its
   coalesced form on :func:`hpcjobs.collectives.allreduce` (``algorithm``:
   ``HPCJOBS_TORCH_ALGORITHM``, default ``auto``); reduce-scatter on
   :func:`ring_reduce_scatter`; allgather on :func:`ring_allgather` (equal
   sizes) or :func:`ring_allgatherv`; broadcast, reduce, gather, scatter,
   all-to-all, send/recv, barrier and the bitwise reductions on MPI. Shapes,
   dtypes and ops are agreed across the ranks first: a rank that differs
   gets :class:`~hpcjobs.collectives.agreement.MismatchError` on every rank
   (from ``work.wait()``), never a wrong answer.
5. **CUDA tensors** are reduced where they live (the GPU transports of
   :mod:`hpcjobs.collectives`); the caller's stream is synchronized before
   the worker reads them, and the worker's after it writes them.

6. **Timeouts.** A call waits for the other ranks as long as its group's
   timeout (``init_process_group(timeout=...)`` or
   ``new_process_group(timeout=...)``; torch's default, 30 minutes, and
   none given leave ``HPCJOBS_TIMEOUT``, 300 s), then the stall watchdog
   ends the job naming the ranks that never came; ``work.wait(timeout)``
   raises once its own timeout has passed.

A call this backend does not implement raises ``NotImplementedError``
naming it.
"""

from __future__ import annotations

import importlib
import os
import sys
from datetime import timedelta

import torch.distributed as dist
from mpi4py import MPI
from torch.distributed import constants

from ._torch_group import BACKEND, HpcjobsProcessGroup

__all__ = ["BACKEND", "HpcjobsProcessGroup", "new_process_group"]


def new_process_group(comm: MPI.Intracomm | None = None, algorithm: str | None = None,
                      timeout: timedelta | float | None = None) -> HpcjobsProcessGroup:
    """A process group over ``comm`` (default COMM_WORLD) without making it
    torch's default group: ``DistributedDataParallel(model,
    process_group=new_process_group())`` beside a Gloo default group.
    ``timeout``: how long a call may wait for the other ranks before the
    job ends (default HPCJOBS_TIMEOUT)."""
    return HpcjobsProcessGroup(comm, algorithm, timeout=timeout)


def _create(opts, backend_options=None) -> HpcjobsProcessGroup:
    """torch's creator hook (extended API): the group's world ranks give its
    MPI communicator."""
    world = MPI.COMM_WORLD
    ranks = list(opts.global_ranks_in_group) or list(range(world.Get_size()))
    if ranks == list(range(world.Get_size())):
        comm = world
    else:
        comm = world.Create_group(world.Get_group().Incl(ranks))  # the group's own: freed at its shutdown
    if comm.Get_rank() != opts.group_rank or comm.Get_size() != opts.group_size:
        if comm is not world:
            comm.Free()
        raise RuntimeError(f"the hpcjobs backend: torch gives this rank {opts.group_rank} of {opts.group_size}, "
                           f"MPI {comm.Get_rank()} of {comm.Get_size()} (torch's ranks must be COMM_WORLD's)")
    # init_process_group(timeout=...): a call waits that long, where HPCJOBS_TIMEOUT (300 s) had ended a job
    # whose rank 0 evaluated for 6 minutes before the timeout it asked for. torch's default (30 min, which
    # torch passes whether asked or not) leaves HPCJOBS_TIMEOUT: a lost rank ends the job in minutes
    timeout = getattr(opts, "timeout", None)
    if timeout is not None and timeout == constants.default_pg_timeout:
        timeout = None
    return HpcjobsProcessGroup(comm, owned=comm is not world, timeout=timeout)


def _env_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """``env://`` without ``MASTER_ADDR``: rank and size from MPI, a local
    store (module docstring, 1.); with it, torch's own handler."""
    if os.environ.get("MASTER_ADDR"):
        yield from _torch_env_rendezvous(url, timeout=timeout, **kwargs)
        return
    backend = _backend_asked()
    # "hpcjobs", or a device map of it alone ("cpu:hpcjobs,cuda:hpcjobs"); "undefined" where none was named
    named = {part.rsplit(":", 1)[-1].strip().lower() for part in str(backend).split(",")} if backend else set()
    if backend is not None and named != {BACKEND}:
        raise ValueError(f"init_process_group(backend={str(backend)!r}) without MASTER_ADDR: with "
                         f"hpcjobs.torch_backend imported only the {BACKEND!r} backend starts without it (rank and "
                         "size from MPI, no store); gloo and nccl need MASTER_ADDR and MASTER_PORT (rank 0's host and "
                         "a free port there, e.g. mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500)")
    world = MPI.COMM_WORLD
    if world.Get_size() > 1 and os.environ.get("TORCH_DIST_INIT_BARRIER", "0") not in ("", "0"):
        # (its barrier waits on torch's store for keys from the other ranks: it spun a core for the timeout)
        raise ValueError("TORCH_DIST_INIT_BARRIER asks for a barrier on torch's store, and without MASTER_ADDR the "
                         "hpcjobs backend's store is each process's alone: unset it (the ranks meet over MPI), or "
                         "set MASTER_ADDR and MASTER_PORT")
    store = _LocalStore()
    _stores.append(store)  # torch holds the C++ side only: its calls find the Python methods while this lives
    yield store, world.Get_rank(), world.Get_size()
    raise RuntimeError("the hpcjobs env:// rendezvous cannot re-rendezvous")


class _LocalStore(dist.Store):
    """The store of a job started without ``MASTER_ADDR``: this process's
    alone, which says so when asked for a key only another rank could have
    set. A Gloo side group (``new_group(backend="gloo")``) or a ``get``
    between ranks had waited on a process-local HashStore for its timeout,
    30 minutes by default, and then failed naming a store key."""

    def __init__(self):
        super().__init__()
        self._keys: dict[str, bytes] = {}

    def _missing(self, keys) -> RuntimeError:
        return RuntimeError(
            f"the hpcjobs backend started without MASTER_ADDR, so torch's store is this process's alone, and "
            f"{', '.join(map(repr, keys))} could only come from another rank: a gloo or nccl group "
            "(new_group(backend=...)) or the store between ranks needs MASTER_ADDR and MASTER_PORT (rank 0's host "
            "and a free port there, e.g. mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500)")

    def set(self, key, value):
        self._keys[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        if key not in self._keys:
            raise self._missing([key])
        return self._keys[key]

    def add(self, key, value):
        total = int(self._keys.get(key, b"0")) + value
        self._keys[key] = str(total).encode()
        return total

    def compare_set(self, key, expected, desired):
        current = self._keys.get(key)
        if current == (expected if isinstance(expected, bytes) else str(expected).encode()) or (
                current is None and not expected):
            self._keys[key] = desired if isinstance(desired, bytes) else str(desired).encode()
            return self._keys[key]
        return current if current is not None else expected

    def wait(self, keys, timeout=None):
        missing = [k for k in keys if k not in self._keys]
        if missing:
            raise self._missing(missing)

    def check(self, keys):
        return all(k in self._keys for k in keys)

    def delete_key(self, key):
        return self._keys.pop(key, None) is not None

    def num_keys(self):
        return len(self._keys)

    def set_timeout(self, timeout):
        pass  # (nothing waits: a missing key is said at once)

    def clone(self):
        return self  # (Gloo takes a clone for its own threads: the same keys)

    def multi_get(self, keys):
        return [self.get(key) for key in keys]

    def multi_set(self, keys, values):
        for key, value in zip(keys, values):
            self.set(key, value)

    def append(self, key, value):
        self._keys[key] = self._keys.get(key, b"") + (value if isinstance(value, bytes) else str(value).encode())

    def has_extended_api(self):
        return True

    def list_keys(self):
        return list(self._keys)

    # torch's C++ side looks these up by its own names
    getNumKeys = num_keys  # noqa: N815
    deleteKey = delete_key  # noqa: N815
    listKeys = list_keys  # noqa: N815


_stores: list = []


def _backend_asked():
    """The backend the ``init_process_group`` this rendezvous runs for was
    asked for (torch's ``Backend``, "undefined" where none was named), or
    None where the rendezvous was called otherwise (``dist.rendezvous``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "init_process_group" and "backend" in frame.f_locals:
            return frame.f_locals["backend"]
        frame = frame.f_back
    return None


def _register() -> None:
    # the module, which torch.distributed's function of the same name hides
    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    global _torch_env_rendezvous
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    handlers = rendezvous._rendezvous_handlers
    if handlers.get("env") is not _env_rendezvous:
        _torch_env_rendezvous = handlers["env"]
        handlers["env"] = _env_rendezvous


_torch_env_rendezvous = None
_register()
