"""The sweep engine behind ``hpcjobs bench allreduce``, ``tune`` and ``model``:
every implementation, same buffers, one run.

For each message size, every implementation runs ``warmup + iters`` times on
the same buffer, in interleaved rounds (:class:`hpcjobs.timing.Rounds`; its
input restored before each call, untimed); the time is the slowest rank's
median. Inputs are crafted so that the exact result is known: rank ``r``
holds small integers hashed from ``r`` and the element's place in a period
of 251 (:func:`_pattern`: 0 or 1 to sum, 1 or 2 to multiply, 0..27 for min
and max), so every partial sum is exact in every dtype and reduction order
up to 256 ranks (bfloat16's integers), every rank's input differs from
every other's, and so do the results along the buffer. Calls take turns
among three variants of the inputs (the pattern turned by 0, 1, 2 places),
so a result left from an earlier call differs from this one's. ``#wrong``
counts elements that differ from the expected, after every call (warmup
too, untimed), summed over calls and ranks.

A row of ours makes the call ``allreduce(buf, op, algorithm, comm)``
makes, without the name's lookup (:func:`hpcjobs.collectives.select.lookup`,
``.run``: for ``oneshot`` the same as ``oneshot_allreduce(buf, op,
comm)``); the ``mpi`` row calls ``MPI_Allreduce`` through mpi4py after the
same check of the buffer (:func:`hpcjobs.bench.baselines.mpi_allreduce`).

``auto`` times its candidates on its first calls at a size
(:mod:`hpcjobs.collectives.auto`); those calls run untimed before the
warmup, so its row shows the algorithm it settles on, as a training job
sees it between two measurements.

Several passes of one sweep (``bench allreduce --passes N``) end with each
row's median over the passes (:func:`median_records`).

Baselines that reduce device memory (nccl) work on a copy of the buffer in
their GPU instead: the input is uploaded before each call and the result
read back after the last, both untimed, so their rows time the collective
alone, as training on GPUs would see it.

With ``device="cuda"`` the size's buffer lives on this rank's GPU and every
row reduces that one CUDA tensor (:mod:`hpcjobs.bench.device`): the input
is uploaded before each call and read back after a row's last, untimed,
and each timed call waits for the device.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time and
busbw = algbw · 2(P-1)/P, the per-link rate a ring would need, comparable
across P.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import numpy as np
from mpi4py import MPI

from ..collectives import (ALGORITHMS, DEVICE_ALGORITHMS, hierarchical_allreduce, ring_allreduce, symmetric_empty,
                           symmetric_free)
from ..collectives import auto as auto_
from ..collectives._buffers import as_flat
from ..collectives.agreement import set_checks
from ..collectives.select import lookup
from . import doors
from .baselines import ADAPTERS, LATE_BASELINES, DeviceStage, mpi_label
from .harness import auto_iters, max_of_medians, sum_over_ranks, time_interleaved
from .inputs import VARIANTS, expected_output, make_input
from .names import BASELINES, BUFFERS

@dataclass
class Record:
    size_bytes: int
    count: int
    dtype: str
    op: str
    impl: str
    ranks: int
    iters: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    # Across hosts (hpcjobs.bench.wire): bytes each host sent per call, in
    # node order; the busiest host's; what the formula says a node sends.
    wire_hosts: list[float] | None = None
    wire_bytes: float | None = None
    wire_model: float | None = None
    # A late row (Horovod, in a pass of its own): MPI_Allreduce's time beside it over its first-pass time at
    # this size, how far conditions drifted between the passes (the verdicts correct by it)
    anchor_drift: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Impl:
    """One column of the table: ``fn(buf, op, comm)`` and which dtypes it has."""

    fn: Callable
    supports: Callable[[str], bool] = lambda dtype: True
    # stage(host_buf, comm) -> DeviceStage: fn reduces that copy (on a GPU)
    # instead of the host buffer; filled before and read after, untimed.
    stage: Callable | None = None
    # Measured in a pass of its own after the others: once initialised it
    # keeps costing CPU that every other implementation would pay for.
    late: bool = False
    # settled(buf, op, comm) -> bool, the same on every rank: False while its
    # first calls at a size are still measuring (auto), which run untimed
    # before the table's warmup, so that its row times what it settles on.
    settled: Callable | None = None
    # With the agreement check on ("<algorithm>+check"): turned on before
    # each of its calls, untimed, and off before every other row's.
    checks: bool = False

    def __call__(self, buf, op, comm):
        return self.fn(buf, op, comm)


def implementations(names: Iterable[str], segment_sizes: Iterable[int] = (), device: str = "cpu"
                    ) -> dict[str, Impl]:
    """Map table labels to ``fn(buf, op, comm)`` for the requested names.

    Names are our algorithms (:data:`hpcjobs.collectives.ALGORITHMS`; on
    ``device="cuda"`` also :data:`~hpcjobs.collectives.DEVICE_ALGORITHMS`),
    "auto" and the baselines (on a device, their device adapters:
    :mod:`hpcjobs.bench.device`). ``ring_pipelined`` appears once per
    segment size; with several sizes the label carries the size, e.g.
    ``ring_pipelined/64K``. With segment sizes, ``hierarchical`` appears once
    per size too, always labelled (``hierarchical/1M``; ``hierarchical/0``:
    not pipelined).
    """
    ours = (*ALGORITHMS, *DEVICE_ALGORITHMS) if device != "cpu" else ALGORITHMS
    segment_sizes = list(segment_sizes)
    impls: dict[str, Callable] = {}
    for name in names:
        base, checks = name.removesuffix(CHECKED), name.endswith(CHECKED)  # a +check row: its segments too
        tail = CHECKED if checks else ""
        if base == "ring_pipelined" and segment_sizes:
            if 0 in segment_sizes:
                raise ValueError("segment size 0 (not pipelined) is for hierarchical; ring_pipelined needs > 0")
            for seg in segment_sizes:
                label = name if len(segment_sizes) == 1 else f"{base}/{format_bytes(seg)}{tail}"
                impls[label] = Impl(functools.partial(_ring_pipelined, segment_bytes=seg), checks=checks)
        elif base == "hierarchical" and segment_sizes:  # one row per segment size: hierarchical/1M, hierarchical/0
            for seg in segment_sizes:
                impls[f"{base}/{format_bytes(seg)}{tail}"] = Impl(functools.partial(_hierarchical, segment_bytes=seg),
                                                                   checks=checks)
        elif base in ours or base == "auto":
            # the call allreduce(buf, op, algorithm, comm) makes, as the mpi row calls MPI_Allreduce
            impls[name] = Impl(lookup(base).run, settled=auto_.settled if base == "auto" else None, checks=checks)
        elif name in BASELINES and device != "cpu":
            from .device import DEVICE_ADAPTERS

            if name not in DEVICE_ADAPTERS:
                raise ValueError(f"baseline {name!r} has no device-buffer adapter")
            impls[mpi_label() if name == "mpi" else name] = Impl(*DEVICE_ADAPTERS[name])
        elif name in BASELINES:
            impls[mpi_label() if name == "mpi" else name] = Impl(*ADAPTERS[name], late=name in LATE_BASELINES)
        else:
            raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(IMPLS)}")
    return impls


# "<algorithm>+check": the same with the cross-rank agreement check, which the
# benchmarks otherwise turn off (unchecked_benchmarks), to show what it costs.
CHECKED = "+check"


def unchecked_benchmarks() -> None:
    """Benchmarks compare our algorithms as algorithms, against
    MPI_Allreduce, which checks nothing either: the agreement check
    (:mod:`hpcjobs.collectives.agreement`) is off while they run, and
    ``<algorithm>+check`` rows measure it."""
    set_checks(False)


def _ring_pipelined(buf, op, comm, *, segment_bytes):
    return ring_allreduce(buf, op, comm, pipeline=True, segment_bytes=segment_bytes)


def _hierarchical(buf, op, comm, *, segment_bytes):
    return hierarchical_allreduce(buf, op, comm, segment_bytes=segment_bytes)


IMPLS = (*ALGORITHMS, "auto", *BASELINES)


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min_bytes, min_bytes·factor, ... up to max_bytes (the --min/--max/--factor
    flags of every sweeping command).

    Raises:
        ValueError: min_bytes > max_bytes, or factor < 2.
    """
    if min_bytes > max_bytes:
        raise ValueError(f"the smallest size ({min_bytes} B) is larger than the largest ({max_bytes} B)")
    if factor < 2:
        raise ValueError(f"the factor between sizes must be at least 2, got {factor}")
    sizes, n = [], min_bytes
    while n <= max_bytes:
        sizes.append(n)
        n *= factor
    return sizes


def format_bytes(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _make_buffer(count: int, dtype: str, framework: str, buffers: str = "private", comm=None):
    """The size's one buffer, which every row reduces: private memory, or
    (``buffers="symmetric"``, collective) a symmetric allocation, on which
    shm takes its zero-copy path and the rest run as on any memory."""
    torch_buffer = framework == "torch" or dtype == "bfloat16"
    if torch_buffer:
        import torch
    if buffers == "symmetric":
        return symmetric_empty(count, getattr(torch, dtype) if torch_buffer else dtype, comm)
    return torch.empty(count, dtype=getattr(torch, dtype)) if torch_buffer else np.empty(count, dtype=dtype)


def run(comm: MPI.Intracomm, sizes: Iterable[int], impls: dict[str, Callable], dtype: str = "float32",
        op: str = "sum", iters: int | None = None, warmup: int = 3, framework: str = "numpy",
        on_record: Callable[[Record], None] | None = None, buffers: str = "private", device: str = "cpu",
        wire=None, pass_index: int = 0) -> list[Record]:
    """Measure every implementation at every size; return one Record each.

    Args:
        comm: communicator to measure on (every rank calls this).
        sizes: message sizes in bytes; each is rounded down to whole elements
            and skipped if that leaves none.
        impls: label -> ``fn(buf, op, comm)``, e.g. from :func:`implementations`.
        iters: timed iterations per (size, impl); None picks by size.
        warmup: untimed iterations first.
        framework: "numpy" or "torch" buffers (bfloat16 is always torch).
        on_record: called with each record as soon as it is measured.
        buffers: "private" (ordinary arrays) or "symmetric" (every size's
            buffer from :func:`hpcjobs.collectives.symmetric_empty`, freed
            after it: needs one node).
        device: "cpu", or a CUDA device ("cuda:0") holding every row's
            buffer (module docstring).
        wire: a :class:`hpcjobs.bench.wire.WireMeter` (runs across hosts):
            after the timed calls, each row's bytes on each host's uplink,
            counted in an untimed pass of its own.
        pass_index: which of several passes this is: with the size, it
            seeds the order the implementations take turns in.
    """
    if buffers not in BUFFERS:
        raise ValueError(f"buffers must be one of {', '.join(BUFFERS)}, got {buffers!r}")
    size, rank = comm.Get_size(), comm.Get_rank()
    records = []
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    for nbytes in sizes:
        count = nbytes // itemsize
        if count == 0:
            continue
        buf = flat = pristine = want = runs = on_device = target = None  # the last size's copies go first
        buf = _make_buffer(count, dtype, framework, buffers, comm)
        flat = as_flat(buf)
        # every call's input is the next variant's, and every call is checked: a result left by an earlier
        # call (a stale slot) counts as wrong, as it would not with one input for all
        pristine = [make_input(count, dtype, op, rank, v) for v in range(VARIANTS)]
        want = [expected_output(count, dtype, op, size, v) for v in range(VARIANTS)]
        calls: dict = {}  # label -> its calls so far: the variant of its next
        n_iters = iters or auto_iters(count * itemsize)
        checked = {label for label, fn in impls.items() if isinstance(fn, Impl) and fn.checks}
        chosen = {label: fn for label, fn in impls.items() if not isinstance(fn, Impl) or fn.supports(dtype)}
        if device != "cpu":  # one device copy for every row, each call waited for
            from .device import waited

            on_device = DeviceStage(buf, device)
            stages = dict.fromkeys(chosen, on_device)
            chosen = {label: waited(fn) for label, fn in chosen.items()}
        else:
            stages = {label: fn.stage(buf, comm) for label, fn in chosen.items()
                      if isinstance(fn, Impl) and fn.stage is not None}
        runs = {label: functools.partial(fn, stages[label].buf if label in stages else buf, op, comm)
                for label, fn in chosen.items()}

        def reset(label):
            if checked:  # untimed: a +check row's calls check, and no other row's
                set_checks(label in checked)
            calls[label] = calls.get(label, -1) + 1
            np.copyto(flat.data, pristine[calls[label] % VARIANTS])
            if label in stages:
                stages[label].upload()

        def check(label) -> int:
            if label in stages:
                stages[label].download()
            return int(np.count_nonzero(flat.data != want[calls[label] % VARIANTS]))

        for label, fn in impls.items():  # auto's measuring calls, untimed
            if label not in runs:
                continue
            target = stages[label].buf if label in stages else buf
            while isinstance(fn, Impl) and fn.settled is not None and not fn.settled(target, op, comm):
                reset(label)
                runs[label]()
        calls.clear()  # (auto's measuring calls above took turns too)
        times, wrong = time_interleaved(runs, reset, check, comm, n_iters, warmup, seed=(nbytes, pass_index),
                                        check_every=True)
        on_wire = wire.measure_rows(runs, reset) if wire is not None else {}
        if checked:
            set_checks(False)  # as the benchmarks run (unchecked_benchmarks)
        stages.clear()  # frees the device copies before the next size
        for label in runs:
            rec = _record(count * itemsize, count, dtype, op, label, size, n_iters,
                          max_of_medians(times[label], comm) * 1e6, sum_over_ranks(wrong[label], comm),
                          on_wire.get(label), _wire_model(wire, label, impls[label], count * itemsize, dtype, op,
                                                          comm, device) if label in on_wire else None)
            records.append(rec)
            if on_record is not None:
                on_record(rec)
        if buffers == "symmetric":
            symmetric_free(buf)  # collective; nothing here uses buf after
    return records


def _wire_model(wire, label: str, impl, nbytes: int, dtype: str, op: str, comm, device: str) -> float | None:
    """What the uplink formula says a node sends for a row (for auto: for
    the algorithm it kept)."""
    auto = isinstance(impl, Impl) and impl.settled is not None
    return wire.model(label, nbytes, auto_.kept(nbytes, dtype, op, comm, device != "cpu") if auto else None)


def _record(nbytes: int, count: int, dtype: str, op: str, impl: str, ranks: int, iters: int, time_us: float,
            wrong: int, wire_hosts: list[float] | None = None, wire_model: float | None = None) -> Record:
    """A Record with its bandwidths: algbw = bytes / time, busbw = algbw·2(P-1)/P
    (at one rank algbw itself, where nccl-tests' factor would give 0)."""
    algbw = nbytes / time_us / 1e3
    return Record(nbytes, count, dtype, op, impl, ranks, iters, time_us, algbw,
                  algbw * (2 * (ranks - 1) / ranks if ranks > 1 else 1.0), wrong, wire_hosts,
                  max(wire_hosts) if wire_hosts else None, wire_model)


def median_records(passes: list[list[Record]]) -> list[Record]:
    """One record per (size, implementation) over several passes of one
    sweep: the median of the passes' times (for an even number, the mean of
    the middle two), bandwidths from that time, ``#wrong`` summed. In the
    first pass's order."""
    grouped: dict[tuple[int, str], list[Record]] = {}
    for records in passes:
        for r in records:
            grouped.setdefault((r.size_bytes, r.impl), []).append(r)
    out = []
    for recs in grouped.values():
        r = recs[0]
        hosts = [x.wire_hosts for x in recs if x.wire_hosts]
        drifts = [x.anchor_drift for x in recs if x.anchor_drift is not None]
        out.append(dataclasses.replace(
            _record(r.size_bytes, r.count, r.dtype, r.op, r.impl, r.ranks, r.iters,
                    statistics.median(x.time_us for x in recs), sum(x.wrong for x in recs),
                    [statistics.median(h) for h in zip(*hosts)] if hosts else None, r.wire_model),
            anchor_drift=statistics.median(drifts) if drifts else None))
    return out


def late_passes(comm: MPI.Intracomm, sizes: Iterable[int], late: dict[str, Impl], first: list[Record],
                on_record: Callable[[Record], None] | None = None, log: Callable[[str], None] = lambda line: None,
                **settings) -> list[Record]:
    """Measure the late implementations (Horovod) after everything else, each
    in a pass of its own (``LATE_BASELINES`` order) with MPI_Allreduce
    re-measured beside it as an anchor: the anchor's ratio to its time in
    ``first`` (the records of the pass before) says how far conditions
    drifted between the passes, which ``log`` is told. ``settings`` go to
    :func:`run`; ``on_record`` sees the late implementations' records."""
    first_mpi = {r.size_bytes: r.time_us for r in first if r.impl == mpi_label()}
    out = []
    doors.stop()  # their threads (hvd-hpcjobs' controller polls every millisecond on rank 0) not beside Horovod
    for label in sorted(late, key=LATE_BASELINES.index):
        anchor = {"mpi (anchor)": Impl(*ADAPTERS["mpi"])}
        recs = run(comm, sizes, {label: late[label], **anchor},
                   on_record=lambda r: on_record(r) if on_record is not None and r.impl in late else None, **settings)
        at = {r.size_bytes: r.time_us / first_mpi[r.size_bytes] for r in recs
              if r.impl == "mpi (anchor)" and r.size_bytes in first_mpi}
        drift = sorted(at.values())
        if drift:
            log(f"anchor beside {label}: MPI_Allreduce took {drift[len(drift) // 2]:.2f}x its first-pass "
                f"time (median over sizes; range {drift[0]:.2f}-{drift[-1]:.2f}x)")
        out += [dataclasses.replace(r, anchor_drift=at.get(r.size_bytes)) for r in recs if r.impl in late]
    return out
