"""``allreduce(buf, algorithm=...)``: one entry point over every algorithm.

:data:`REGISTRY` holds every algorithm by name
(:data:`~hpcjobs.collectives.names.ALGORITHMS`): the message-passing ones
(:mod:`~hpcjobs.collectives.messages`), the shared-memory one and the
two-level one. ``algorithm="auto"`` chooses among them
(:mod:`~hpcjobs.collectives.auto`).

On CUDA tensors every one of them runs through the staged transport
(:mod:`~hpcjobs.collectives.staged`: pinned host chunks, the host algorithm
per chunk), and :data:`DEVICE_REGISTRY` adds the device transports by name
(:data:`~hpcjobs.collectives.names.DEVICE_ALGORITHMS`): ``cuda_ipc`` on one
node (:mod:`~hpcjobs.collectives.cuda_ipc`; where a rank cannot open its
peers' IPC handles every rank falls back to staged together). ``auto``
chooses between them by measuring, as it does among the host algorithms.
"""

from __future__ import annotations

import functools

from mpi4py import MPI

from . import auto, cuda_ipc, hierarchical, oneshot, shm, staged
from ._frame import Algorithm, refuse, run
from .device import DeviceFlat, is_device_buffer
from .messages import MESSAGE_PASSING
from .names import ALGORITHMS, DEVICE_ALGORITHMS

__all__ = ["REGISTRY", "DEVICE_REGISTRY", "AUTO", "allreduce", "lookup", "cuda_ipc_allreduce"]

REGISTRY: dict[str, Algorithm] = {
    **MESSAGE_PASSING,
    # with the public functions' defaults, so that both calls agree across ranks
    "hierarchical": Algorithm("hierarchical", "hierarchical_allreduce", hierarchical.allreduce,
                              {"inter": "ring", "intra": "ring"}),
    "shm": Algorithm("shm", "shm_allreduce", shm.allreduce, {"block_bytes": shm.DEFAULT_BLOCK_BYTES}),
    "oneshot": Algorithm("oneshot", "oneshot_allreduce", oneshot.allreduce),
}
# The public name of auto's calls: what the agreement check and the watchdog say.
AUTO = "allreduce_auto"


_host_auto = functools.partial(auto.step, REGISTRY, None)  # auto's step on host memory (a staged chunk)


def _staged_auto(dflat: DeviceFlat, op: str, comm) -> None:
    """The staged transport with ``auto`` choosing the host algorithm per chunk."""
    staged.allreduce(dflat, op, comm, _host_auto)


def _cuda_ipc(dflat: DeviceFlat, op: str, comm) -> None:
    """cuda_ipc, or on every rank together the staged transport where some
    rank cannot open its peers' IPC handles (the first call says why)."""
    try:
        cuda_ipc.allreduce(dflat, op, comm)
    except cuda_ipc.IpcUnavailable as e:
        warn_once(f"cuda_ipc is unavailable here, so the staged transport runs instead: {e}")
        _staged_auto(dflat, op, comm)


_cuda_ipc.takes_device = True
_staged_auto.takes_device = True
# The device transports by name (auto's device candidates among them).
DEVICE_REGISTRY: dict[str, Algorithm] = {
    "cuda_ipc": Algorithm("cuda_ipc", "cuda_ipc_allreduce", _cuda_ipc),
    "staged": Algorithm("staged", AUTO, _staged_auto),
    "hierarchical": Algorithm("hierarchical", "hierarchical_allreduce", hierarchical.allreduce,
                              {"inter": "ring", "intra": "cuda_ipc"}),
}


def lookup(name: str) -> Algorithm:
    """The algorithm ``name`` (one of :data:`ALGORITHMS`, "cuda_ipc" or
    "auto"): ``lookup(name).run(buf, op, comm)`` is the call
    ``allreduce(buf, op, name, comm)`` makes.

    Raises:
        ValueError: an unknown name; TypeError: not a name.
    """
    if not isinstance(name, str):  # allreduce(buf, "sum", comm): the communicator where the name goes
        raise TypeError(f"algorithm must be a name, got {type(name).__name__} (a communicator goes in comm=)")
    if name == "auto":
        return _AUTO_ALGORITHM
    try:
        return REGISTRY[name] if name not in DEVICE_ALGORITHMS else DEVICE_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of "
                         f"{', '.join(['auto', *ALGORITHMS, *DEVICE_ALGORITHMS])}") from None


def allreduce(buf, op: str = "sum", algorithm: str = "auto", comm: MPI.Comm | None = None):
    """Allreduce ``buf`` in place with the named algorithm.

    Args:
        buf: numpy array, torch CPU tensor or CUDA tensor (on this rank's
            current device), contiguous and writable; the same count, dtype
            and device type on every rank.
        op: "sum", "avg", "min", "max" or "prod".
        algorithm: one of :data:`ALGORITHMS`, "cuda_ipc" (CUDA tensors, one
            node), or "auto" (tuning table on host memory; measured between
            the device transports on CUDA tensors).
        comm: intracommunicator; None for COMM_WORLD.

    Returns:
        ``buf``, reduced in place.

    Raises:
        ValueError: unknown algorithm or op, an unreadable tuning table, or a
            bad buffer (TypeError: unsupported buffer type or dtype).
    """
    if algorithm == "auto":
        return run(buf, op, comm, AUTO, _auto)
    try:
        found = lookup(algorithm)
    except (TypeError, ValueError) as e:  # the others, calling a known one, wait in its check: raised there too
        refuse(buf, op, comm, f"allreduce(algorithm={algorithm!r})", e)
    if found.name == "cuda_ipc":
        _device_only(buf, op, comm)
    return found.run(buf, op, comm)


def _device_only(buf, op: str, comm) -> None:
    """cuda_ipc's refusal of a host buffer, on every rank (:func:`refuse`)
    and on one rank too, where the step itself never runs."""
    if not is_device_buffer(buf):
        refuse(buf, op, comm, "cuda_ipc_allreduce", ValueError(cuda_ipc.HOST_BUFFER))


# auto's step on either kind of buffer, the registries bound: a partial, so
# no Python call between the frame and auto's own step on small messages.
_auto = functools.partial(auto.step, REGISTRY, DEVICE_REGISTRY)
_auto.takes_device = True
_auto.oneshot_next = auto.oneshot_next  # (the frame's check carries the message where it can)
_AUTO_ALGORITHM = Algorithm("auto", AUTO, _auto)


def cuda_ipc_allreduce(buf, op: str = "sum", comm: MPI.Comm | None = None):
    """Allreduce the CUDA tensor ``buf`` in place over CUDA IPC, every rank
    of ``comm`` on one node (:mod:`hpcjobs.collectives.cuda_ipc`); the
    staged transport on every rank where IPC is unavailable.

    Raises:
        ValueError: a host buffer, ranks on several nodes, or a bad buffer
            (TypeError: a dtype torch cannot reduce on CUDA, e.g. uint32).
    """
    _device_only(buf, op, comm)
    return DEVICE_REGISTRY["cuda_ipc"].run(buf, op, comm)


_warned: set = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)
