"""What every command shares: argument types, the usage error, the flags of
the commands that sweep message sizes, and the checks that run before
anything is measured."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import tempfile
from pathlib import Path

__all__ = ["UsageError", "usage", "parse_bytes", "positive_int", "nonnegative_int", "seed_int", "positive_float",
           "nonnegative_float", "comma_list", "add_sweep_arguments", "sweep_sizes", "apply_placement",
           "check_outputs", "dataclass_values"]


class UsageError(Exception):
    """A bad command line found after parsing (two arguments that disagree,
    a value the library refuses). Every rank raises it before any
    communication; ``main`` prints it argparse-style and exits 2."""


@contextlib.contextmanager
def usage(*kinds: type[Exception]):
    """Inside: a ValueError or TypeError (or ``kinds``) from the library is a
    usage error.

    For the checks a command makes before anything runs, alike on every rank
    (the library raises ValueError naming the value and the rule). Errors
    once work has begun are not usage errors and end the job as such."""
    try:
        yield
    except kinds or (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None


_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)i?B?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'8', '4K', '64M', '1G' (powers of 1024) -> bytes; > 0."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8, 4K, 64M)")
    value = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _bounded(cast, kind: str, ok, rule: str):
    """An argparse type: ``cast(text)`` that must satisfy ``ok``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {value}")
        return value

    return parse


positive_int = _bounded(int, "an integer", lambda v: v > 0, "positive")
nonnegative_int = _bounded(int, "an integer", lambda v: v >= 0, ">= 0")
# a seed numpy's legacy generators take too (MNIST-1D's data is drawn with one)
seed_int = _bounded(int, "an integer", lambda v: 0 <= v < 2 ** 32, "from 0 to 2**32 - 1")
positive_float = _bounded(float, "a number", lambda v: v > 0 and v != float("inf"), "positive")
nonnegative_float = _bounded(float, "a number", lambda v: 0 <= v < float("inf"), ">= 0")


def comma_list(text: str) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c']."""
    return [item.strip() for item in text.split(",") if item.strip()]


def add_sweep_arguments(p: argparse.ArgumentParser, factor: int = 2) -> None:
    """--min-bytes/--max-bytes/--factor/--iters/--ranks-per-node, shared by
    every command that sweeps message sizes (bench allreduce, tune, model)."""
    p.add_argument("--min-bytes", "-b", type=parse_bytes, default=8, metavar="SIZE",
                   help="smallest message, e.g. 8, 4K (default 8)")
    p.add_argument("--max-bytes", "-e", type=parse_bytes, default=64 << 20, metavar="SIZE",
                   help="largest message (default 64M); each rank holds about 8 times it, refused where a host "
                        "lacks the memory")
    p.add_argument("--factor", "-f", type=positive_int, default=factor,
                   help=f"size multiplier between rows (default {factor})")
    p.add_argument("--iters", "-n", type=positive_int, default=None,
                   help="timed iterations per row (default: 200 for small messages down to 10 for large)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="N",
                   help="simulate nodes of N consecutive ranks for hierarchical and auto "
                        "(sets HPCJOBS_RANKS_PER_NODE; default: detect)")


def sweep_sizes(args) -> list[int]:
    """The message sizes of --min-bytes/--max-bytes/--factor (usage error if they disagree)."""
    from ..bench.sweep import size_sweep

    if args.min_bytes > args.max_bytes:
        raise UsageError(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    if args.factor < 2:
        raise UsageError("--factor must be at least 2")
    sizes = size_sweep(args.min_bytes, args.max_bytes, args.factor)
    dtype = getattr(args, "dtype", "float32")  # tune measures float32
    import numpy as np

    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    if not any(n >= itemsize for n in sizes):  # every size skipped: an empty table, and tune an empty one written
        raise UsageError(f"no size from --min-bytes {args.min_bytes} to --max-bytes {args.max_bytes} holds one "
                         f"{dtype} element ({itemsize} bytes)")
    return sizes


def apply_placement(args) -> None:
    """--ranks-per-node and --tuning, shared by the commands that run our
    collectives: checked before anything is measured (usage error, exit 2,
    on every rank: a --tuning file missing or bad on one host only, refused
    there alone, left the others waiting with no word)."""
    from ..collectives import auto
    from ..comm import private

    if getattr(args, "ranks_per_node", None):
        os.environ["HPCJOBS_RANKS_PER_NODE"] = str(args.ranks_per_node)
    if getattr(args, "tuning", None):
        problem = None
        try:
            auto.load_tuning(args.tuning)
        except ValueError as e:
            problem = str(e)
        problems = private().allgather(problem)
        if any(problems):
            raise UsageError("; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p))
        auto.set_tuning(args.tuning)


def _output_problem(flag: str, path: str, directory: bool) -> str | None:
    """Why ``path`` cannot be written, after creating the directories it needs; None if it can."""
    if path == "-":  # (train's --metrics takes it for standard output; these wrote a file named "-")
        return (f"{flag} -: would be a {'directory' if directory else 'file'} named \"-\" here; give a path"
                + ("" if directory else ", or /dev/stdout for standard output"))
    p = Path(path)
    folder = p if directory else p.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{flag} {path}: cannot create the directory {folder}: {e.strerror}"
    if not directory and p.is_dir():
        return f"{flag} {path}: is a directory; give a file name"
    if not directory and p.exists() and not p.is_file():
        return None  # a pipe, a device, /dev/stdout: written in place (hpcjobs._files.atomic_write)
    # A file made and removed there, as the write will make its temporary one: permissions alone say nothing
    # to root, nor of a directory no file can be made in (/proc, a read-only mount).
    try:
        fd, probe = tempfile.mkstemp(prefix=".hpcjobs-", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{flag} {path}: cannot write a file in the directory {folder}: {e.strerror}"
    return None


def check_outputs(comm, outputs: list[tuple]) -> None:
    """Before anything is measured: rank 0 makes sure every output it will
    write can be written (``(flag, path, is a directory[, check])``; None
    paths are skipped; ``check(flag, path)``: why an existing file there
    cannot be added to, or None), creating the directories they need, and
    every rank raises the same usage error if one cannot. ``comm`` None:
    this process alone."""
    problem = None
    if comm is None or comm.Get_rank() == 0:
        for flag, path, directory, *check in outputs:
            if path and problem is None:
                problem = _output_problem(flag, path, directory)
                if problem is None and check and os.path.exists(path):  # (a pipe too: the check says)
                    problem = check[0](flag, path)
    if comm is not None:
        problem = comm.bcast(problem, root=0)
    if problem:
        raise UsageError(problem)


def dataclass_values(cls, args) -> dict:
    """The fields of dataclass ``cls`` that ``args`` sets (flags named like
    the fields; those left at None take the dataclass's default)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}


def check_amp(amp: str, device) -> None:
    """``--amp`` on ``device`` (a ``torch.device``, or its type: "cpu"): fp16 is refused on the
    CPU: float16 matrix products ran about 20x slower than float32 on this
    project's CPUs (``bench train``, gpt-mini), and its GradScaler exists
    for GPUs' narrow float16 range."""
    if amp == "fp16" and getattr(device, "type", device) == "cpu":
        raise UsageError("--amp fp16 is for GPUs: on CPUs float16 matrix products run about 20x slower than "
                         "float32; use --amp bf16")
