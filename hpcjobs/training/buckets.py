"""Fused gradient buckets: how ``DistributedOptimizer`` lays the parameters
out, and how a bucket is filled from the gradients and emptied back into them.

Parameters go into flat buckets of at most ``fusion_bytes`` per dtype, in
reverse order of ``named_parameters`` (roughly the order backward produces
their gradients), as DDP and Horovod's tensor fusion do: one allreduce per
bucket instead of one per tensor. :func:`check_layout` makes sure every rank
built the same buckets before any is reduced.

Parameters on a GPU get buckets on their device (a bucket holds one device
and one dtype). The copies in run on the stream of the thread that makes
them (autograd's, in a hook), the reduction on another thread's: each copy
records a CUDA event that the reducing thread's stream waits for, and the
reduction records one that the stream copying the averages back waits for.
Nothing waits on the host, and the device is never synchronized whole.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from ..comm import agree, signature

__all__ = ["Slot", "Bucket", "layout", "check_layout", "changed_grads", "stray_grads"]


PROBES = 8  # values of each gradient compared before it is overwritten with the average (Bucket.edited)
# what synchronize() raises where .grad changed after it was copied in (Bucket.edited)
EDITED = ("the gradient of {names} changed between backward and step() (a GradScaler's unscale_, which "
          "scaler.step(opt) calls, or clip_grad_norm_?); the average was taken of the gradients backward made and "
          "would overwrite the change. Change the averages instead: call opt.synchronize() after backward, then "
          "unscale or clip, then opt.step() or scaler.step(opt), which reduce no second time (docs/training.md)")
# and where a parameter it does not reduce has a gradient (stray_grads)
STRAY = ("{names} got a gradient that this DistributedOptimizer does not average: they did not require grad when "
         "it was made (unfrozen since?), and each rank would step on its own gradient, the replicas drifting apart "
         "silently; make the DistributedOptimizer again after changing which parameters train")


def listed(names: list[str]) -> str:
    """Up to three of ``names``, or, where this rank has none, that another rank found them."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") if names else "a parameter on another rank"


def stray_grads(param_groups: list[dict], reduced: dict, names: dict) -> list[str]:
    """The optimizer's parameters that require grad and have one but no place in a bucket (``reduced``: by
    ``id``): unfrozen after the buckets were laid out, so Horovod, too, never averages them."""
    return [names.get(id(p), "a parameter") for g in param_groups for p in g["params"]
            if p.requires_grad and p.grad is not None and id(p) not in reduced]


@dataclass
class Slot:
    """One parameter's place in a bucket: elements ``[offset, offset + numel)``."""

    name: str
    param: torch.Tensor
    offset: int
    numel: int
    probe: torch.Tensor | None = None  # PROBES evenly spaced positions, whose values tell a change (Bucket.edited)

    def __post_init__(self):
        if self.probe is None:  # in integers: linspace's float32 put the last one past the end above 2**24
            count = min(self.numel, PROBES)
            self.probe = torch.arange(count, device=self.param.device) * (self.numel - 1) // max(count - 1, 1)


@dataclass
class Bucket:
    index: int
    dtype: torch.dtype
    slots: list[Slot]
    buffer: torch.Tensor
    pending: set = field(default_factory=set)  # slot positions whose gradient has not arrived
    done: threading.Event = field(default_factory=threading.Event)  # reduced (the communication thread's)
    copied: list = field(default_factory=list)  # CUDA events: the copies in, on their streams
    reduced: object = None  # CUDA event: the reduction, on the reducing thread's stream
    seen: dict = field(default_factory=dict)  # slot position -> (its .grad when copied in, version, probed values)

    def view(self, slot: Slot) -> torch.Tensor:
        return self.buffer[slot.offset:slot.offset + slot.numel]

    def reset(self) -> None:
        """Before a step: every gradient still to come."""
        self.pending = set(range(len(self.slots)))
        self.done.clear()
        self.copied.clear()
        self.reduced = None
        self.seen.clear()

    def _event(self):
        """A CUDA event recorded on this thread's current stream (None on the CPU)."""
        if not self.buffer.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.buffer.device))
        return event

    def fill(self, pos: int) -> None:
        """Copy slot ``pos``'s gradient in; it has arrived."""
        slot = self.slots[pos]
        grad = slot.param.grad
        flat = grad.reshape(-1)
        self.view(slot).copy_(flat)
        self.seen[pos] = (grad, grad._version, flat[slot.probe])
        self.pending.discard(pos)
        if self.buffer.is_cuda:
            self.copied.append(self._event())

    def before_reduce(self) -> None:
        """On the reducing thread: make the bucket's GPU current there (a
        thread starts on device 0), and its stream wait for the copies in."""
        if self.buffer.is_cuda:
            torch.cuda.set_device(self.buffer.device)
        for event in self.copied:
            torch.cuda.current_stream(self.buffer.device).wait_event(event)
        self.copied.clear()

    @contextlib.contextmanager
    def on_host(self):
        """The buffer on the CPU for the reduction inside (a copy of a GPU's,
        copied back after): for the host algorithms that count bytes."""
        if not self.buffer.is_cuda:
            yield self.buffer
            return
        host = self.buffer.cpu()
        yield host
        self.buffer.copy_(host)

    def after_reduce(self) -> None:
        """On the reducing thread: mark the reduction for :meth:`unpack`."""
        self.reduced = self._event()

    def fill_missing(self) -> None:
        """The gradients that never arrived: their ``.grad`` if they have
        one, else zeros."""
        for pos in list(self.pending):
            slot = self.slots[pos]
            if slot.param.grad is None:
                self.view(slot).zero_()
                if self.buffer.is_cuda:
                    self.copied.append(self._event())
            else:
                self.fill(pos)
        self.pending.clear()

    def edited(self) -> tuple[list[str], list[tuple[str, torch.Tensor, torch.Tensor]]]:
        """What changed ``.grad`` since it was copied in: the names of those
        replaced or changed in place as torch counts (``_version``), and for
        the rest each one's probed values then and now, as bytes (bitwise:
        a NaN equals itself). GradScaler's ``unscale_`` and a write through
        ``.data`` are not counted; their change shows in the probes."""
        counted, probes = [], []
        for pos, (grad, version, then) in self.seen.items():
            slot = self.slots[pos]
            if slot.param.grad is not grad or grad._version != version:
                counted.append(slot.name)
            else:
                probes.append((slot.name, then.view(torch.uint8), grad.reshape(-1)[slot.probe].view(torch.uint8)))
        return counted, probes

    def unpack(self) -> None:
        """Copy the reduced values back into every parameter's ``.grad``."""
        if self.reduced is not None:
            torch.cuda.current_stream(self.buffer.device).wait_event(self.reduced)
        for slot in self.slots:
            avg = self.view(slot).view_as(slot.param)
            if slot.param.grad is None:
                slot.param.grad = avg.clone()
            else:
                slot.param.grad.copy_(avg)

    def zero_unused_grads(self) -> None:
        """Alone, with nothing to reduce: parameters without a gradient get
        zeros, as they would from the ranks' average."""
        for slot in self.slots:
            if slot.param.grad is None:
                slot.param.grad = torch.zeros_like(slot.param)

    def nonfinite_grads(self) -> list[str]:
        """Names of the parameters whose ``.grad`` holds a NaN or an Inf."""
        return [s.name for s in self.slots if s.param.grad is not None and not torch.isfinite(s.param.grad).all()]

    def nonfinite(self) -> list[str]:
        """Names of the parameters whose values here hold a NaN or an Inf."""
        if torch.isfinite(self.buffer).all():
            return []
        return [s.name for s in self.slots if not torch.isfinite(self.view(s)).all()]


def changed_grads(buckets: list[Bucket]) -> list[str]:
    """The parameters whose ``.grad`` changed since backward copied it in (:meth:`Bucket.edited`): one
    comparison per device of every gradient's probed values (one wait for a GPU, not one per tensor)."""
    names, by_device = [], {}
    for bucket in buckets:
        counted, probes = bucket.edited()
        names += counted
        for probe in probes:
            by_device.setdefault(probe[1].device, []).append(probe)
    for probes in by_device.values():
        if not torch.equal(torch.cat([then for _, then, _ in probes]), torch.cat([now for _, _, now in probes])):
            names += [name for name, then, now in probes if not torch.equal(then, now)]
    return names


def layout(named: list[tuple[str, torch.Tensor]], fusion_bytes: int, fused: bool = True) -> list[Bucket]:
    """The buckets for ``named`` parameters: up to ``fusion_bytes`` each, per
    device and dtype, or one per parameter with ``fused=False``.

    Raises:
        ValueError: a parameter on a device other than the CPU or a GPU.
    """
    buckets: list[Bucket] = []
    open_: dict[tuple, list[Slot]] = {}  # the bucket being filled, per (device, dtype)

    def close(key):
        slots = open_.pop(key)
        count = slots[-1].offset + slots[-1].numel
        buckets.append(Bucket(len(buckets), key[1], slots, torch.zeros(count, dtype=key[1], device=key[0])))

    for name, p in reversed(named):
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameter {name} is on {p.device}; DistributedOptimizer reduces CPU and CUDA "
                             "tensors")
        key = (p.device, p.dtype)
        slots = open_.setdefault(key, [])
        offset = slots[-1].offset + slots[-1].numel if slots else 0
        slots.append(Slot(name, p, offset, p.numel()))
        if not fused or (offset + p.numel()) * p.element_size() >= fusion_bytes:
            close(key)
    for key in list(open_):
        close(key)
    return buckets


def check_layout(comm: MPI.Intracomm, named: list, buckets: list[Bucket], settings: dict) -> None:
    """Check that every rank of ``comm`` has the same parameters, buckets and
    ``settings`` (name -> value: fusion_bytes, algorithm, ...); collective.

    Raises:
        ValueError: on every rank, naming what differs and each rank's values.
    """
    params = "|".join(f"{n}:{p.dtype}:{tuple(p.shape)}:{p.device.type}" for n, p in named)
    places = "|".join(",".join(s.name for s in b.slots) for b in buckets)
    numel = sum(p.numel() for _, p in named)
    same = agree(signature([len(named), numel, params, places, *settings.values()]), comm)
    if same.all():
        return
    what = ["number of parameters", "number of elements", "parameter names/shapes/dtypes", "bucket layout",
            *settings]
    differ = [w for w, ok in zip(what, same) if not ok]
    everyone = comm.allgather((len(named), numel, *map(str, settings.values())))
    raise ValueError(f"DistributedOptimizer: ranks disagree on {', '.join(differ)}; per rank "
                     f"(params, elements, {', '.join(settings)}): "
                     + "; ".join(f"rank {r}: {v}" for r, v in enumerate(everyone)))
