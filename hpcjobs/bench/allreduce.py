"""``hpcjobs bench allreduce``: every implementation, same buffers, one run.

For each message size, every implementation runs ``warmup + iters`` times on
the same buffer, round-robin (its input restored before each call, untimed);
the time is the slowest rank's median. Inputs are crafted so that the exact result is
known: rank ``r`` holds ``(i + r) % 3`` at element ``i`` (``1 + (i + r) % 2``
for ``prod``), so every partial result is a small integer, exact in every
dtype and in any reduction order, and the expected output depends only on
``i % 6``. ``#wrong`` counts elements that differ from it, summed over ranks.

``auto`` times its candidates on its first calls at a size
(:mod:`hpcjobs.collectives.select`); those calls run untimed before the
warmup, so its row shows the algorithm it settles on, as a training job
sees it between two measurements.

``--passes N`` runs the whole sweep N times, ``auto`` measuring afresh in each
(``select.remeasure``), and ends with each row's median over the passes
(:func:`median_records`), which is also what ``--json``/``--csv``/``--out``
then write.

Baselines that reduce device memory (nccl) work on a copy of the buffer in
their GPU instead: the input is uploaded before each call and the result
read back after the last, both untimed, so their rows time the collective
alone, as training on GPUs would see it.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time and
busbw = algbw · 2(P-1)/P, the per-link rate a ring would need, comparable
across P.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import numpy as np
from mpi4py import MPI

from ..collectives import ALGORITHMS, allreduce, ring_allreduce, select, symmetric_empty, symmetric_free
from ..collectives._buffers import as_flat, finish_avg
from ..collectives.agreement import set_checks
from ..collectives.ring import DEFAULT_SEGMENT_BYTES
from .baselines import BASELINES, KNOWN_BASELINES, LATE_BASELINES, available, mpi_label, shutdown
from .harness import auto_iters, max_of_medians, sum_over_ranks, time_interleaved

_PERIOD = 6  # lcm of the two input patterns' periods (3 and 2)


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

    def to_dict(self) -> dict:
        return asdict(self)


def _pattern(rank: int, op: str) -> list[int]:
    if op == "prod":
        return [1 + (i + rank) % 2 for i in range(_PERIOD)]
    return [(i + rank) % 3 for i in range(_PERIOD)]


def _to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """Small integers as ``dtype`` elements (bfloat16 as its uint16 bits)."""
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return values.astype(dtype)


def make_input(count: int, dtype: str, op: str, rank: int) -> np.ndarray:
    """Rank ``rank``'s input, as the typed data of a Flat (bf16 as bits)."""
    return _to_dtype(np.resize(np.array(_pattern(rank, op), dtype=np.int64), count), dtype)


def expected_output(count: int, dtype: str, op: str, size: int) -> np.ndarray:
    """The exact allreduce of every rank's :func:`make_input`.

    Integers are reduced in int64, whose wrap-around agrees with any narrower
    integer type's modulo its width; floats in float64, exact for these values.
    """
    integer = dtype != "bfloat16" and np.issubdtype(np.dtype(dtype), np.integer)
    ufunc = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]
    acc = np.array(_pattern(0, op), dtype=np.int64 if integer else np.float64)
    with np.errstate(over="ignore"):
        for r in range(1, size):
            ufunc(acc, np.array(_pattern(r, op), dtype=acc.dtype), out=acc)
        out = _to_dtype(np.resize(acc, count), dtype)
    if op == "avg":
        finish_avg(out, dtype, size)
    return out


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

    def __call__(self, buf, op, comm):
        return self.fn(buf, op, comm)


def implementations(names: Iterable[str], segment_sizes: Iterable[int] = ()) -> dict[str, Impl]:
    """Map table labels to ``fn(buf, op, comm)`` for the requested names.

    Names are our algorithms (:data:`hpcjobs.collectives.ALGORITHMS`), "auto"
    and the baselines. ``ring_pipelined`` appears once per segment size; with
    several sizes the label carries the size, e.g. ``ring_pipelined/64K``.
    """
    segment_sizes = list(segment_sizes)
    impls: dict[str, Callable] = {}
    for name in names:
        if name == "ring_pipelined" and segment_sizes:
            for seg in segment_sizes:
                label = name if len(segment_sizes) == 1 else f"{name}/{format_bytes(seg)}"
                impls[label] = Impl(functools.partial(_ring_pipelined, segment_bytes=seg))
        elif (algorithm := name.removesuffix(CHECKED)) in ALGORITHMS or algorithm == "auto":
            fn = _ours_checked if name.endswith(CHECKED) else _ours
            impls[name] = Impl(functools.partial(fn, algorithm=algorithm),
                               settled=select.settled if algorithm == "auto" else None)
        elif name in BASELINES:
            impls[mpi_label() if name == "mpi" else name] = Impl(*BASELINES[name], late=name in LATE_BASELINES)
        else:
            raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(IMPLS)}")
    return impls


def _ours(buf, op, comm, *, algorithm):
    return allreduce(buf, op, algorithm, comm)


# "<algorithm>+check": the same with the cross-rank agreement check, which the
# benchmarks otherwise turn off (unchecked_benchmarks), to show what it costs.
CHECKED = "+check"


def _ours_checked(buf, op, comm, *, algorithm):
    set_checks(True)
    try:
        return allreduce(buf, op, algorithm, comm)
    finally:
        set_checks(False)


def unchecked_benchmarks() -> None:
    """Benchmarks compare our algorithms as algorithms, against
    MPI_Allreduce, which checks nothing either: the agreement check
    (:mod:`hpcjobs.collectives.agreement`) is off while they run, and
    ``<algorithm>+check`` rows measure it."""
    set_checks(False)


def _ring_pipelined(buf, op, comm, *, segment_bytes):
    return ring_allreduce(buf, op, comm, pipeline=True, segment_bytes=segment_bytes)


IMPLS = (*ALGORITHMS, "auto", *KNOWN_BASELINES)


def add_sweep_arguments(p, factor: int = 2) -> None:
    """--min-bytes/--max-bytes/--factor/--iters/--ranks-per-node, shared by
    every command that sweeps message sizes (bench allreduce, tune, model)."""
    from ..cli import parse_bytes, positive_int

    p.add_argument("--min-bytes", "-b", type=parse_bytes, default=8, metavar="SIZE",
                   help="smallest message, e.g. 8, 4K (default 8)")
    p.add_argument("--max-bytes", "-e", type=parse_bytes, default=64 << 20, metavar="SIZE",
                   help="largest message (default 64M)")
    p.add_argument("--factor", "-f", type=positive_int, default=factor,
                   help=f"size multiplier between rows (default {factor})")
    p.add_argument("--iters", "-n", type=positive_int, default=None,
                   help="timed iterations per row (default: 200 for small messages down to 10 for large)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="N",
                   help="simulate nodes of N consecutive ranks for hierarchical and auto "
                        "(sets HPCJOBS_RANKS_PER_NODE; default: detect)")


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min_bytes, min_bytes·factor, ... up to max_bytes (the --min/--max/--factor
    flags of every sweeping command)."""
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


BUFFERS = ("private", "symmetric")


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
        on_record: Callable[[Record], None] | None = None, buffers: str = "private") -> list[Record]:
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
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    records = []
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    for nbytes in sizes:
        count = nbytes // itemsize
        if count == 0:
            continue
        buf = _make_buffer(count, dtype, framework, buffers, comm)
        flat = as_flat(buf)
        pristine = make_input(count, dtype, op, rank)
        want = expected_output(count, dtype, op, size)
        n_iters = iters or auto_iters(count * itemsize)
        chosen = {label: fn for label, fn in impls.items() if not isinstance(fn, Impl) or fn.supports(dtype)}
        stages = {label: fn.stage(buf, comm) for label, fn in chosen.items()
                  if isinstance(fn, Impl) and fn.stage is not None}
        runs = {label: functools.partial(fn, stages[label].buf if label in stages else buf, op, comm)
                for label, fn in chosen.items()}

        def reset(label):
            np.copyto(flat.data, pristine)
            if label in stages:
                stages[label].upload()

        def check(label) -> int:
            if label in stages:
                stages[label].download()
            return int(np.count_nonzero(flat.data != want))

        for label, fn in chosen.items():  # auto's measuring calls, untimed
            while isinstance(fn, Impl) and fn.settled is not None and not fn.settled(buf, op, comm):
                reset(label)
                runs[label]()
        times, wrong = time_interleaved(runs, reset, check, comm, n_iters, warmup)
        stages.clear()  # frees the device copies before the next size
        for label in runs:
            rec = _record(count * itemsize, count, dtype, op, label, size, n_iters,
                          max_of_medians(times[label], comm) * 1e6, sum_over_ranks(wrong[label], comm))
            records.append(rec)
            if on_record is not None:
                on_record(rec)
        if buffers == "symmetric":
            symmetric_free(buf)  # collective; nothing here uses buf after
    return records


def _record(nbytes: int, count: int, dtype: str, op: str, impl: str, ranks: int, iters: int, time_us: float,
            wrong: int) -> Record:
    """A Record with its bandwidths: algbw = bytes / time, busbw = algbw·2(P-1)/P."""
    algbw = nbytes / time_us / 1e3
    return Record(nbytes, count, dtype, op, impl, ranks, iters, time_us, algbw,
                  algbw * (2 * (ranks - 1) / ranks if ranks > 1 else 1.0), wrong)


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
        out.append(_record(r.size_bytes, r.count, r.dtype, r.op, r.impl, r.ranks, r.iters,
                           statistics.median(x.time_us for x in recs), sum(x.wrong for x in recs)))
    return out


def _configure(p) -> None:
    from ..cli import nonnegative_int, positive_int

    add_sweep_arguments(p)
    p.add_argument("--impl", default="ring,ring_pipelined",
                   help=f"comma-separated algorithms of ours, or 'all' (from: {', '.join((*ALGORITHMS, 'auto'))}; "
                        "add +check, e.g. ring+check, for the same with the cross-rank agreement check, "
                        "which is otherwise off here; default %(default)s)")
    p.add_argument("--baselines", default="mpi",
                   help=f"comma-separated baselines, 'all' or 'none' (from: {', '.join(KNOWN_BASELINES)}; "
                        "default %(default)s); one that cannot run here is skipped with the reason, except "
                        "horovod when HPCJOBS_REQUIRE_HOROVOD=1")
    p.add_argument("--tuning", metavar="PATH", default=None,
                   help="tuning table for auto, from `hpcjobs tune` (default: $HPCJOBS_TUNING, else built in)")
    p.add_argument("--dtype", "-d", default="float32", choices=("float16", "float32", "float64", "int32", "int64", "bfloat16"))
    p.add_argument("--op", "-o", default="sum", choices=("sum", "avg", "min", "max", "prod"))
    p.add_argument("--framework", default="numpy", choices=("numpy", "torch"), help="buffer type (default numpy)")
    p.add_argument("--buffers", default="private", choices=BUFFERS,
                   help="private: ordinary arrays (default); symmetric: every size's buffer in shared memory "
                        "(symmetric_empty, one node), where shm reduces straight out of the peers' buffers "
                        "instead of staging; every row runs on that same buffer")
    p.add_argument("--warmup", "-w", type=nonnegative_int, default=3, help="untimed iterations first (default 3)")
    p.add_argument("--passes", type=positive_int, default=1,
                   help="run the whole sweep this many times, auto measuring afresh in each, then print each "
                        "row's median over the passes (default 1). On a shared machine load comes in spells of "
                        "seconds, longer than a row takes: one pass can catch a spell that the median rides over")
    p.add_argument("--segment-bytes", default=None, metavar="SIZE[,SIZE...]",
                   help=f"ring_pipelined segment size(s); several give one row each "
                        f"(default {format_bytes(DEFAULT_SEGMENT_BYTES)})")
    p.add_argument("--json", metavar="PATH", help="also write the records and the environment as JSON")
    p.add_argument("--csv", metavar="PATH", help="also write the records as CSV")
    p.add_argument("--out", metavar="DIR",
                   help="write a report there: report.md with the table and environment, busbw.png, "
                        "latency.png, records.json, records.csv (plots need matplotlib)")


def main(args) -> int:
    import os

    from ..cli import UsageError, parse_bytes
    from ..comm import print0, private
    from .report import environment, header, preamble, row, write_csv, write_json, write_report

    if args.min_bytes > args.max_bytes:
        raise UsageError(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.factor < 2:
        raise UsageError("--factor must be at least 2")
    names = [*ALGORITHMS, "auto"] if args.impl == "all" else [n.strip() for n in args.impl.split(",") if n.strip()]
    base = {"all": list(KNOWN_BASELINES), "none": []}.get(
        args.baselines, [n.strip() for n in args.baselines.split(",") if n.strip()])
    unknown = [n for n in base if n not in KNOWN_BASELINES]
    if unknown:
        raise UsageError(f"unknown baseline {unknown[0]!r}; choose from {', '.join(KNOWN_BASELINES)}, all, none")
    # A baseline named in --impl goes through the same availability check.
    base += [n for n in names if n in KNOWN_BASELINES and n not in base]
    names = [n for n in names if n not in KNOWN_BASELINES]
    apply_placement(args)
    unchecked_benchmarks()
    try:
        segs = [parse_bytes(s) for s in args.segment_bytes.split(",")] if args.segment_bytes else []
        impls = implementations(names, segs)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise UsageError(f"{e}") from None
    sizes = size_sweep(args.min_bytes, args.max_bytes, args.factor)

    comm = private()
    if args.buffers == "symmetric":
        from ..collectives.shm import is_single_node

        if not is_single_node(comm):
            raise UsageError("--buffers symmetric needs every rank on one node (symmetric buffers are shared memory)")
    skipped = {}
    for name in base:
        reason = available(name, comm)
        if reason is None:
            impls.update(implementations([name]))
        elif name == "horovod" and os.environ.get("HPCJOBS_REQUIRE_HOROVOD") == "1":
            raise RuntimeError(f"HPCJOBS_REQUIRE_HOROVOD=1 but horovod cannot run: {reason}")
        else:
            skipped[name] = reason
    env = environment(comm)
    from ..topology import detect_private

    topo = detect_private(comm)  # what the hierarchical and auto rows see
    env["nodes"] = f"{topo.num_nodes} ({topo.source}; ranks per node {','.join(map(str, topo.local_sizes))})"
    for line in preamble(env, f"hpcjobs bench allreduce: {', '.join(impls)}; dtype {args.dtype}, op {args.op}, "
                              f"{args.framework} buffers ({args.buffers}); time = max over ranks of each rank's median"):
        print0(line)
    for name, reason in skipped.items():
        print0(f"# {name}: skipped: {reason}")
    for label, impl in impls.items():
        if not impl.supports(args.dtype):
            print0(f"# {label}: has no {args.dtype} allreduce; its rows are left out")
    print0(header())
    first = {label: impl for label, impl in impls.items() if not impl.late}
    late = {label: impl for label, impl in impls.items() if impl.late}
    passes = []
    try:
        for n in range(args.passes):
            if args.passes > 1:
                select.remeasure()  # each pass measures as a fresh job would
                print0(f"# pass {n + 1} of {args.passes}")
            records = run(comm, sizes, first, args.dtype, args.op, args.iters, args.warmup, args.framework,
                          on_record=lambda r: print0(row(r)), buffers=args.buffers)
            if late:
                records += _late_pass(comm, sizes, late, records, args)
            _auto_lines(records, impls, args, comm)
            passes.append(records)
    finally:
        shutdown()  # stop Gloo's and Horovod's threads before the interpreter does
    records = median_records(passes)  # of one pass: its own records
    if args.passes > 1:
        env["passes"] = args.passes
        print0(f"# median over {args.passes} passes")
        print0(header())
        for r in records:
            print0(row(r))
        _auto_verdict(records, impls, f", medians over {args.passes} passes")
    wrong = sum(r.wrong for r in records)
    print0(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if comm.Get_rank() == 0:
        if args.json:
            write_json(args.json, records, env)
            print0(f"# records written to {args.json}")
        if args.csv:
            write_csv(args.csv, records)
            print0(f"# records written to {args.csv}")
        if args.out:
            import sys

            command = " ".join(["hpcjobs", *sys.argv[1:]])
            paths = write_report(args.out, records, env, f"hpcjobs bench allreduce, {comm.Get_size()} ranks", command)
            print0(f"# report written to {paths[0]}")
    return 1 if wrong else 0


def _auto_lines(records: list[Record], impls: dict, args, comm) -> None:
    """After a pass: what auto kept, and how far it was from our best."""
    from ..comm import print0

    for label, impl in impls.items():
        if impl.settled is not None:  # auto, with or without +check
            print0(f"# {label} kept: {kept_summary(records, label, args.dtype, args.op, comm)}")
    _auto_verdict(records, impls)


def _auto_verdict(records: list[Record], impls: dict, over: str = "") -> None:
    from ..comm import print0

    line = auto_against_best(records) if "auto" in impls else None
    if line:
        print0(f"# auto vs the best of ours{over}: {line}")


def kept_summary(records: list[Record], label: str, dtype: str, op: str, comm) -> str:
    """What ``auto`` ran in its timed calls, per run of sizes, e.g.
    "8-16K recursive_doubling, 32K-64M shm"."""
    runs: list[list] = []  # [first size, last size, algorithm]
    for r in records:
        if r.impl == label:
            name = select.kept(r.size_bytes, dtype, op, comm) or "?"
            if runs and runs[-1][2] == name:
                runs[-1][1] = r.size_bytes
            else:
                runs.append([r.size_bytes, r.size_bytes, name])
    return ", ".join(f"{format_bytes(lo)}{'' if lo == hi else '-' + format_bytes(hi)} {name}"
                     for lo, hi, name in runs)


def auto_against_best(records: list[Record], within: float = 1.10) -> str | None:
    """How far ``auto``'s time is from the fastest of our other algorithms
    in the table, size by size, e.g. "within 10% at 23 of 24 sizes; worst
    1.13x at 32K (recursive_doubling)". None without two of ours beside it."""
    by_size: dict[int, dict[str, float]] = {}
    for r in records:
        by_size.setdefault(r.size_bytes, {})[r.impl] = r.time_us
    ratios = []
    for size, times in by_size.items():
        ours = {k: v for k, v in times.items() if k in ALGORITHMS or k.startswith("ring_pipelined/")}
        if "auto" in times and len(ours) >= 2:
            best = min(ours, key=ours.get)
            ratios.append((times["auto"] / ours[best], size, best))
    if not ratios:
        return None
    ratio, size, best = max(ratios)
    ok = sum(r <= within for r, _, _ in ratios)
    return (f"within {round((within - 1) * 100)}% at {ok} of {len(ratios)} sizes; "
            f"worst {ratio:.2f}x at {format_bytes(size)} ({best})")


def _late_pass(comm, sizes, late: dict, first_records: list, args) -> list:
    """Measure the late implementations (Horovod) after everything else, each
    in a pass of its own (LATE_BASELINES order) with MPI_Allreduce re-measured
    beside it as an anchor: the anchor's ratio to its first-pass time says
    how far conditions drifted between the passes."""
    from ..comm import print0
    from .report import row

    print0(f"# {', '.join(late)}: measured after the others, each in its own pass beside MPI_Allreduce as an "
           "anchor (Horovod's background thread keeps ~half a core busy on rank 0 once initialised)")
    first_mpi = {r.size_bytes: r.time_us for r in first_records if r.impl == mpi_label()}
    out = []
    for label in sorted(late, key=LATE_BASELINES.index):
        anchor = {"mpi (anchor)": Impl(*BASELINES["mpi"])}
        recs = run(comm, sizes, {label: late[label], **anchor}, args.dtype, args.op, args.iters, args.warmup,
                   args.framework, on_record=lambda r: print0(row(r)) if r.impl in late else None,
                   buffers=args.buffers)
        drift = sorted(r.time_us / first_mpi[r.size_bytes] for r in recs
                       if r.impl == "mpi (anchor)" and r.size_bytes in first_mpi)
        if drift:
            print0(f"# anchor beside {label}: MPI_Allreduce took {drift[len(drift) // 2]:.2f}x its first-pass "
                   f"time (median over sizes; range {drift[0]:.2f}-{drift[-1]:.2f}x)")
        out += [r for r in recs if r.impl in late]
    return out


def apply_placement(args) -> None:
    """--ranks-per-node and --tuning, shared by the commands that run our
    collectives: checked before anything is measured (usage error, exit 2)."""
    import os

    from ..cli import UsageError
    from ..collectives.select import load_tuning, set_tuning

    if getattr(args, "ranks_per_node", None):
        os.environ["HPCJOBS_RANKS_PER_NODE"] = str(args.ranks_per_node)
    if getattr(args, "tuning", None):
        try:
            load_tuning(args.tuning)
        except ValueError as e:
            raise UsageError(str(e)) from None
        set_tuning(args.tuning)


def _register() -> None:
    from ..cli import arguments, command

    command("bench allreduce", "time every allreduce implementation over a size sweep (nccl-tests table)")(
        arguments(_configure)(main))


_register()
