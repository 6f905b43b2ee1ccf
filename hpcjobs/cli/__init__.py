"""``hpcjobs <command>``: the suite's command line, run under mpirun or srun.

Launch, e.g.::

    mpirun -n 4 hpcjobs bench allreduce --max-bytes 64M
    srun -N 2 --ntasks-per-node 4 --mpi=pmix hpcjobs bench allreduce

Every command is one module of this package with ``configure(parser)``
(its flags) and ``run(args) -> exit code``, listed in :data:`COMMANDS`. The
library never imports this package; a command imports the library inside
``run``. Only the command asked for is imported and configured, and building
its parser starts no MPI: the names and defaults it offers come from modules
that import neither MPI nor torch (``hpcjobs.collectives.names``,
``hpcjobs.training.config``, ...; torch comes only with a compressor spec to
check). So ``--help`` and the login-node commands (``slurm render / submit /
launch``), which check a job's flags with :func:`parse_error`, never
initialise MPI, and answer at once.

Every rank parses the same command line, so a usage error exits 2 on every
rank and nothing starts; the library's ValueErrors from the checks a
command makes before it runs are usage errors too (:func:`args.usage`). An
exception on one rank once work has begun aborts the whole job (MPI_Abort)
rather than leaving the other ranks waiting in a collective forever.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import traceback
from dataclasses import dataclass
from importlib import import_module

from .args import UsageError, nonnegative_float

__all__ = ["COMMANDS", "Command", "UsageError", "build_parser", "main", "parse_error"]


@dataclass(frozen=True)
class Command:
    path: str  # "bench allreduce"
    module: str  # hpcjobs.cli.<module> has configure(parser) and run(args)
    help: str
    mpi: bool = True  # False: runs on a login node or the batch host; MPI is never initialised
    passthrough: bool = False  # takes the job's arguments after --

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(self.path.split())


COMMANDS = (
    Command("info", "info", "print the MPI library, versions and world size (every rank with --all-ranks)"),
    Command("topology", "topology", "print which ranks share a node, as the hierarchical collectives see it"),
    Command("bench allreduce", "bench_allreduce",
            "time every allreduce implementation over a size sweep (nccl-tests table)"),
    Command("bench staging", "bench_staging",
            "GPU: the staged transport's pipeline against its parts (copies + host allreduce), per chunk size"),
    Command("bench train", "bench_train",
            "training throughput: our DistributedOptimizer vs Horovod and torch DDP, one run"),
    Command("bench compression", "bench_compression",
            "gradient compression: bytes, codec time and allreduce time per compressor, and (--train) "
            "MNIST-1D accuracy with and without error feedback"),
    Command("tune", "tune", "measure the allreduce algorithms that apply here and write the tuning table auto reads"),
    Command("model", "model", "fit alpha/beta/gamma here, predict every algorithm, compare with measured; count bytes"),
    Command("train", "train", "data-parallel training on our allreduce (MNIST-1D, digits, synthetic, MNIST, CIFAR-10)"),
    Command("experiment large-batch", "experiment",
            "Goyal et al.'s large-minibatch table on MNIST-1D: test error vs batch for no/constant/gradual warmup"),
    Command("experiment async", "experiment_async",
            "sync SGD against async parameter servers, bounded staleness, Hogwild!, local SGD and EASGD, with and "
            "without a straggler: error, time to target, bytes, staleness"),
    Command("plan", "plan", "how many devices, which algorithm: iteration time, efficiency and time to a target "
            "loss per device count, predicted from measurements", mpi=False),
    Command("plan-check", "plan_check", "the planner against published scaling results: each row's hardware "
            "description through plan, predicted against published efficiency", mpi=False),
    Command("soak", "soak", "many random allreduces (sizes, dtypes, ops, algorithms) checked against MPI_Allreduce, "
            "with each rank's memory watched"),
    Command("slurm render", "slurm_render",
            "print a job script: a template from slurm/ with your values, validated and quoted",
            mpi=False, passthrough=True),
    Command("slurm submit", "slurm_submit", "render a template and sbatch it; prints the job id",
            mpi=False, passthrough=True),
    Command("slurm launch", "slurm_launch",
            "inside a job script: start the ranks with srun or mpirun (see the templates)",
            mpi=False, passthrough=True),
)


class _TopParser(argparse.ArgumentParser):
    """hpcjobs' own parser: a global flag given after the command says where it goes."""

    def error(self, message):
        if "unrecognized arguments" in message and any(f in message.split() for f in ("--timeout", "--no-checks")):
            message += " (--timeout and --no-checks are hpcjobs' own: they go before the command, as in " \
                       "`hpcjobs --timeout 60 bench allreduce`)"
        super().error(message)


def build_parser(command: Command | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The parser of ``hpcjobs``: every command listed, only ``command``'s
    flags added (its module imported). Returns the parser and the parsers
    of the command groups ("bench", "slurm"), for help on an incomplete
    command."""
    parser = _TopParser(
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
    groups = {(): parser.add_subparsers(dest="command", metavar="COMMAND")}
    group_parsers: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for cmd in COMMANDS:
        words = cmd.words
        for depth in range(1, len(words)):
            prefix = words[:depth]
            if prefix not in groups:
                sub = groups[prefix[:-1]].add_parser(prefix[-1], help=f"{prefix[-1]} commands")
                group_parsers[prefix] = sub
                groups[prefix] = sub.add_subparsers(dest=f"command_{depth}", metavar="COMMAND")
        p = groups[words[:-1]].add_parser(words[-1], help=cmd.help, description=cmd.help)
        p.set_defaults(_command=cmd)
        if cmd is command:
            import_module(f"{__name__}.{cmd.module}").configure(p)
    return parser, group_parsers


def _requested(argv: list[str]) -> Command | None:
    """The command ``argv`` names, found by parsing it with no command's
    flags added (so that no command module is imported for it)."""
    parser, _ = build_parser(None)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            args, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
        except SystemExit:
            return None
    return getattr(args, "_command", None)


def _parser_for(argv: list[str]) -> tuple[Command | None, argparse.ArgumentParser, dict]:
    """The command ``argv`` names and :func:`build_parser`'s result for it."""
    command = _requested(argv)
    return (command, *build_parser(command))


def parse_error(argv: list[str], ranks: int | None = None, cpu: bool = False) -> str | None:
    """The usage error ``hpcjobs ARGV`` would exit 2 with (argparse's
    checks: flags, types, choices), or None when it parses. For job scripts,
    to refuse a command line before a job is submitted or its ranks start;
    starts no MPI. With ``ranks`` (the job's), also what the command's
    ``check_job(args, ranks, cpu)`` refuses before MPI starts (``train``:
    a global batch that does not divide, a mode's flags on another mode;
    ``cpu``: the job runs without GPUs)."""
    command, parser, _ = _parser_for(argv)
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
    except SystemExit as e:
        if not e.code:
            return None  # --help
        errors = [line for line in out.getvalue().splitlines() if ": error: " in line]
        return errors[-1] if errors else out.getvalue().strip()
    if getattr(args, "_command", None) is None:
        return f"hpcjobs {' '.join(argv)}: not a command (see hpcjobs --help)"
    check = getattr(import_module(f"{__name__}.{command.module}"), "check_job", None)
    if ranks is not None and check is not None:
        try:
            check(args, ranks, cpu)
        except UsageError as e:
            return f"hpcjobs {' '.join(command.words)}: error: {e} (at the job's {ranks} ranks)"
    return None


def _check_environment(command: Command) -> None:
    """The job parameters read from the environment, checked before anything
    runs (a bad one would otherwise surface as a traceback mid-job).

    Raises:
        ValueError: naming the variable and the rule.
    """
    from ..topology import check_ranks_per_node

    check_ranks_per_node(None)  # HPCJOBS_RANKS_PER_NODE
    tuning = os.environ.get("HPCJOBS_TUNING")
    if tuning and command.path != "tune":  # tune writes tables, it does not read this one
        from ..collectives.auto import load_tuning

        try:
            load_tuning(tuning)
        except ValueError as e:
            raise ValueError(f"HPCJOBS_TUNING: {e}") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is handed to the command untouched (the
    # job's arguments for `slurm render/submit/launch`), not parsed here.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    command, parser, groups = _parser_for(argv)
    from ..slurm import STOP_FILE_ENV  # no MPI

    if command is not None and command.path == "train" and os.environ.get(STOP_FILE_ENV):
        from .._early_signals import note  # a rank of `slurm launch --requeue`

        note()  # a SIGUSR1 before the run sets its handlers: noted, not this rank's end
    args = parser.parse_args(argv)
    args.passthrough = passthrough
    if getattr(args, "_command", None) is None:
        given = tuple(a for a in argv if not a.startswith("-"))
        (groups.get(given[:1]) or parser).print_help(sys.stderr)
        return 2
    run = import_module(f"{__name__}.{command.module}").run
    prog = f"hpcjobs {command.path}"
    if passthrough and not command.passthrough:
        print(f"{prog}: error: unexpected arguments after --: {' '.join(passthrough)}", file=sys.stderr)
        return 2
    if not command.mpi:
        try:
            return int(run(args) or 0)
        except UsageError as e:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
            return 2
    return _run_ranks(command, run, args, prog)


def _environment_refused(problem: str | None, settings: dict, prog: str, comm) -> bool:
    """Whether some rank's environment was refused (``problem``: this rank's
    reason, or None), or ``settings`` that every rank must share differ
    (:func:`hpcjobs.comm.refusals`). Collective over ``comm``: a variable
    set differently on one host (a tuning table missing there,
    ``HPCJOBS_CHECKS=0`` there only) stops every rank with exit 2, rather
    than that rank alone while the others wait in MPI, or every rank at the
    first collective they run differently. Rank 0 prints each reason once;
    the barrier after it keeps srun's --kill-on-bad-exit from ending rank 0
    before it has."""
    from ..comm import refusals

    found = refusals(problem, settings, comm)
    if not found:
        return False
    if comm.Get_rank() == 0:
        for m in found:
            print(f"{prog}: error: {m}", file=sys.stderr, flush=True)
    comm.Barrier()
    return True


def _meet(comm, seconds: float = 10.0):
    """Wait, at most ``seconds``, until every rank of ``comm`` has come here:
    a refusal every rank makes alike ends no rank before rank 0 has printed
    it (srun's --kill-on-bad-exit ends the others when one exits 2). Bounded,
    unlike a barrier: a refusal made on some ranks only must not hang the
    ones that made it; they abort the job (``_run_ranks``), and their barrier
    left behind never meets MPI_Finalize. None where they met, else the
    barrier's request, still active: whoever goes on must complete it before
    ``comm`` is freed (a pending nonblocking collective on a freed
    communicator crashed a later progress call)."""
    import time

    request = comm.Ibarrier()
    end = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > end:
            return request
        time.sleep(0.001)
    return None


def _shared_settings(args) -> dict:
    """The job parameters that every rank must share (:func:`hpcjobs.comm.shared_settings`)
    and the ranks per simulated node after the command line's override."""
    from ..comm import shared_settings
    from ..topology import check_ranks_per_node

    nodes = getattr(args, "ranks_per_node", None) or check_ranks_per_node(None)
    return shared_settings() | {"HPCJOBS_RANKS_PER_NODE": "unset" if nodes is None else nodes}


# Set by a launcher (mpirun, srun with PMIx or PMI-2): without one the process is MPI's singleton
_LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")


def _start_mpi() -> None:
    """Start MPI. A singleton (a command run without mpirun) starts it with
    Open MPI's loopback transport alone, unless the user set ``OMPI_MCA_btl``:
    Open MPI 5's shared-memory transport left a 16 MiB file in /dev/shm
    behind every such run (open-mpi/ompi#13261; 1,262 of them had piled up
    on this project's machine), and one process has no peer to reach. Set for
    the start only: a job this command launches gets the user's environment."""
    alone = not ("mpi4py.MPI" in sys.modules or "OMPI_MCA_btl" in os.environ
                 or any(v in os.environ for v in _LAUNCHED))
    if alone:
        os.environ["OMPI_MCA_btl"] = "self"
    try:
        import_module("mpi4py.MPI")  # MPI_Init, which reads the variable
    finally:
        if alone:
            del os.environ["OMPI_MCA_btl"]


def _run_ranks(command: Command, run, args, prog: str) -> int:
    """A command on every rank: the environment checked, the GPU bound, MPI
    started, then ``run``; errors mapped to exit codes."""
    _start_mpi()
    problem, settings = None, {}
    try:
        from ..collectives import agreement, watchdog
        from ..comm import environment_problem

        problem = environment_problem()  # HPCJOBS_TIMEOUT, HPCJOBS_CHECKS, ...: numbers read at import, choices
        if problem is None:
            _check_environment(command)
            from ..runtime import bind_gpu

            bind_gpu()  # before torch sees CUDA: one GPU per rank by local rank, when the job asks
            if args.timeout is not None:
                watchdog.set_timeout(args.timeout)
            if args.no_checks:
                agreement.set_checks(False)
            settings = _shared_settings(args)
    except Exception as e:  # this rank's alone: said on every rank below, not raised here
        problem = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    from mpi4py import MPI

    from ..comm import expect_world_size, world

    try:  # with the other refusals: where the ranks were given different sizes, the others had waited in world()
        expect_world_size()
    except RuntimeError as e:
        problem = problem or str(e)
    if _environment_refused(problem, settings, prog, MPI.COMM_WORLD):
        return 2
    world()  # collective: the private world and the stall watchdog's, so a timeout can name missing ranks
    meeting = MPI.COMM_WORLD.Dup()  # for a refusal's meeting only: no command's collective can be on it
    try:
        return int(run(args) or 0)
    except UsageError as e:
        rank = MPI.COMM_WORLD.Get_rank()
        if rank == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        if _meet(meeting) is not None:  # refused on some ranks only: the others went on, and would wait for these
            print(f"hpcjobs: rank {rank}: {prog}: error: {e}" + ("" if rank else " (said above)")
                  + "; some ranks did not refuse it: aborting the job", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(2)
        return 2
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        if MPI.COMM_WORLD.Get_size() > 1:
            print(f"hpcjobs: rank {MPI.COMM_WORLD.Get_rank()} failed; aborting the job", file=sys.stderr, flush=True)
            MPI.COMM_WORLD.Abort(1)
        return 1
