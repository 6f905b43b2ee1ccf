"""``hpcjobs <command>``: the suite's command line, run under mpirun or srun.

Launch, e.g.::

    mpirun -n 4 hpcjobs bench allreduce --max-bytes 64M
    srun -N 2 --ntasks-per-node 4 --mpi=pmix hpcjobs bench allreduce

Each subcommand registers itself in :data:`COMMANDS` with a function that
adds its arguments and one that runs it. Every rank parses the same command
line, so a usage error exits 2 on every rank and nothing starts. An exception
on one rank aborts the whole job (MPI_Abort) rather than leaving the other
ranks waiting in a collective forever.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: list[Command] = []


class UsageError(Exception):
    """A bad command line found after parsing (e.g. two arguments that
    disagree). Every rank raises it before any communication; ``main`` prints
    it argparse-style and exits 2."""


def command(path: str, help: str):
    """Register ``fn(args) -> exit code`` as ``hpcjobs <path>``; the decorated
    function's ``configure`` attribute (set with :func:`arguments`) adds args."""

    def wrap(fn):
        COMMANDS.append(Command(tuple(path.split()), help, getattr(fn, "configure", lambda p: None), fn))
        return fn

    return wrap


def arguments(configure: Callable[[argparse.ArgumentParser], None]):
    def wrap(fn):
        fn.configure = configure
        return fn

    return wrap


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
positive_float = _bounded(float, "a number", lambda v: v > 0 and v != float("inf"), "positive")
nonnegative_float = _bounded(float, "a number", lambda v: 0 <= v < float("inf"), ">= 0")


# Importing one of these modules registers its commands.
_COMMAND_MODULES = ("hpcjobs.comm", "hpcjobs.topology", "hpcjobs.bench.allreduce", "hpcjobs.bench.tune",
                    "hpcjobs.perfmodel", "hpcjobs.training.cli", "hpcjobs.training.experiment",
                    "hpcjobs.bench.train", "hpcjobs.bench.compression", "hpcjobs.soak", "hpcjobs.slurm")


def _load_commands() -> None:
    import importlib

    for name in _COMMAND_MODULES:
        importlib.import_module(name)


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = argparse.ArgumentParser(
        prog="hpcjobs",
        description="MPI job suite for distributed training: hand-written collectives, "
                    "benchmarked against MPI_Allreduce, torch.distributed and Horovod. "
                    "Run under mpirun/srun, e.g. `mpirun -n 4 hpcjobs bench allreduce`.",
    )
    parser.add_argument("--timeout", type=nonnegative_float, default=None, metavar="SECONDS",
                        help="abort the job when one collective waits longer than this for the other ranks "
                             "(default: $HPCJOBS_TIMEOUT or 300; 0: never); a warning comes at min(60, half)")
    parser.add_argument("--no-checks", action="store_true",
                        help="skip the cross-rank agreement check before each collective (one small allreduce; "
                             "also HPCJOBS_CHECKS=0); the benchmarks skip it anyway")
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {(): parser.add_subparsers(dest="command", metavar="COMMAND")}
    parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for cmd in COMMANDS:
        for depth in range(1, len(cmd.path)):
            prefix = cmd.path[:depth]
            if prefix not in groups:
                sub = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} commands")
                parsers[prefix] = sub
                groups[prefix] = sub.add_subparsers(dest=f"command_{depth}", metavar="COMMAND")
        p = groups[cmd.path[:-1]].add_parser(cmd.path[-1], help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run, _path=cmd.path)
        parsers[cmd.path] = p
    parser._hpcjobs_groups = parsers  # for help on incomplete commands
    return parser


def parse_error(argv: list[str]) -> str | None:
    """The usage error ``hpcjobs ARGV`` would exit 2 with (argparse's
    checks: flags, types, choices), or None when it parses. For job scripts,
    to refuse a command line before a job is submitted or its ranks start."""
    import contextlib
    import io

    parser = build_parser()
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
    except SystemExit as e:
        if not e.code:
            return None  # --help
        errors = [line for line in out.getvalue().splitlines() if ": error: " in line]
        return errors[-1] if errors else out.getvalue().strip()
    if getattr(args, "_run", None) is None:
        return f"hpcjobs {' '.join(argv)}: not a command (see hpcjobs --help)"
    return None


def _check_environment(command: tuple[str, ...]) -> None:
    """The job parameters read from the environment, checked before anything
    runs (a bad one would otherwise surface as a traceback mid-job).

    Raises:
        ValueError: naming the variable and the rule.
    """
    from .topology import _ranks_per_node

    _ranks_per_node(None)  # HPCJOBS_RANKS_PER_NODE
    tuning = os.environ.get("HPCJOBS_TUNING")
    if tuning and command != ("tune",):  # tune writes tables, it does not read this one
        from .collectives.select import load_tuning

        try:
            load_tuning(tuning)
        except ValueError as e:
            raise ValueError(f"HPCJOBS_TUNING: {e}") from None


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ValueError as e:  # a bad HPCJOBS_* setting read at import (HPCJOBS_TIMEOUT, ...)
        print(f"hpcjobs: error: {e}", file=sys.stderr, flush=True)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is handed to the command untouched (the
    # job's arguments for `slurm render/submit/launch`), not parsed here.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.passthrough = passthrough
    run = getattr(args, "_run", None)
    if run is None:
        given = tuple(a for a in argv if not a.startswith("-"))
        parsers = parser._hpcjobs_groups
        (parsers.get(given[:1]) or parser).print_help(sys.stderr)
        return 2
    prog = f"hpcjobs {' '.join(args._path)}"
    if passthrough and not getattr(run, "takes_passthrough", False):
        print(f"{prog}: error: unexpected arguments after --: {' '.join(passthrough)}", file=sys.stderr)
        return 2
    if getattr(run, "no_mpi", False):  # login-node commands (slurm render/submit/launch): no MPI_Init
        try:
            return int(run(args) or 0)
        except UsageError as e:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
            return 2
    try:
        _check_environment(args._path)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    from .slurm import bind_gpu

    bind_gpu()  # before torch sees CUDA: one GPU per rank by local rank, when the job asks
    from .collectives.agreement import set_checks
    from .collectives.watchdog import set_timeout

    if args.timeout is not None:
        set_timeout(args.timeout)
    if args.no_checks:
        set_checks(False)
    from mpi4py import MPI

    from .comm import expect_world_size, world

    try:
        expect_world_size()
    except RuntimeError as e:
        # Every rank is alone in its own world here: each says so and fails.
        print(f"hpcjobs: error on rank {MPI.COMM_WORLD.Get_rank()}: {e}", file=sys.stderr, flush=True)
        return 1
    world()  # collective: the private world and the stall watchdog's, so a timeout can name missing ranks
    try:
        return int(run(args) or 0)
    except UsageError as e:
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        if MPI.COMM_WORLD.Get_size() > 1:
            print(f"hpcjobs: rank {MPI.COMM_WORLD.Get_rank()} failed; aborting the job", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
