"""``hpcjobs slurm render``: print a job script, a template from ``slurm/``
with the user's values, validated and quoted (:mod:`hpcjobs.slurm`). Runs on
a login node: no MPI.

    hpcjobs slurm render allreduce --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 \\
        --time 01:00:00 --partition gpu -- --max-bytes 1G > job.sbatch
"""

from __future__ import annotations

import os
import re
import sys

from ..slurm import TEMPLATES, RenderOptions, job_commands, render, signal_too_early, template_path
from .args import UsageError, positive_int, usage


def configure(p) -> None:
    p.add_argument("template", help=f"one of {', '.join(TEMPLATES)}, or a path to a .sbatch file")
    p.add_argument("--nodes", "-N", type=positive_int, help="nodes")
    p.add_argument("--ntasks-per-node", type=positive_int,
                   help="ranks per node (= GPUs per node: either sets the other)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (0 = CPU mode; = ranks per node)")
    p.add_argument("--cpus-per-task", type=positive_int, help="cores per rank")
    p.add_argument("--time", "-t", help="wall-clock limit (HH:MM:SS, D-HH:MM:SS, ...)")
    p.add_argument("--job-name", "-J", help="job name (letters, digits, _ . -)")
    p.add_argument("--partition", "-p",
                   help="partition, or several separated by commas (else sbatch's default or SBATCH_PARTITION; "
                        "a script's #SBATCH line gives way to SBATCH_* variables, so render warns where one is set, "
                        "and submit passes each flag given on sbatch's command line too)")
    p.add_argument("--account", "-A", help="account (else SBATCH_ACCOUNT)")
    p.add_argument("--qos", "-q", help="quality of service (else sbatch's default or SBATCH_QOS)")
    p.add_argument("--constraint", "-C", help="node features as Slurm takes them: joined by & or |, with "
                   "counts and brackets (e.g. a100&ib, [rack1|rack2], [a100*2&h100*2])")
    p.add_argument("--mem", help="memory per node, e.g. 200G (0: all of it; else the site's default)")
    p.add_argument("--exclusive", action="store_true", help="no other job on the job's nodes")
    p.add_argument("--gpu-type", help="ask for GPUs of this type (--gpus-per-node=TYPE:N), e.g. a100")
    p.add_argument("--cpu", action="store_true", help="CPU mode: no GPU request, HPCJOBS_CPU=1 by default")
    p.epilog = "Arguments after -- go to the job's hpcjobs command, e.g. -- --max-bytes 1G"


def check_job_args(template: str, job_args: tuple[str, ...], ranks: int | None = None, cpu: bool = False) -> None:
    """Refuse job arguments that no command of the template accepts (a
    template may run one of several, e.g. train or large-batch), before
    anything is submitted; starts no MPI. With the rendered job's ``ranks``
    (and ``cpu``: no GPUs), also what the command refuses at that size
    before its ranks start (train: ``--global-batch`` that does not divide,
    a mode's flags on another mode, ``--amp fp16`` on CPUs), which a job
    would otherwise say only after waiting in the queue.

    Raises:
        UsageError: naming the command and its complaint.
    """
    from . import parse_error

    commands = job_commands(template)
    if not job_args or not commands:
        return
    errors = [parse_error([*cmd, *job_args], ranks, cpu) for cmd in commands]
    if all(errors):
        raise UsageError(f"the job's arguments after -- would fail in the job: {errors[0]}")
    chooser = re.search(r'case "\$(\w+)" in', template)  # the variable that picks the command (train's)
    picked = os.environ.get(chooser.group(1), "") if chooser else ""
    runs = next((i for i, cmd in enumerate(commands) if cmd[-1] == picked), 0)
    if errors[runs]:  # taken by another command than the one the job runs as things stand
        takes = next(" ".join(cmd) for cmd, e in zip(commands, errors) if not e)
        how = f" ({chooser.group(1)}={takes.split()[-1]} when it is submitted)" if chooser else ""
        print(f"hpcjobs slurm: warning: the job's arguments after -- are for {takes}; the job runs "
              f"{' '.join(commands[runs])} unless the template is told otherwise{how}, and that fails: "
              f"{errors[runs]}", file=sys.stderr)


def script(args) -> str:
    """The job script ``args`` describe: the template read, the job's
    arguments checked, the values filled in (usage errors for bad ones)."""
    opts = RenderOptions(nodes=args.nodes, ntasks_per_node=args.ntasks_per_node, gpus_per_node=args.gpus_per_node,
                         cpus_per_task=args.cpus_per_task, time=args.time, job_name=args.job_name,
                         partition=args.partition, account=args.account, qos=args.qos, constraint=args.constraint,
                         mem=args.mem, exclusive=args.exclusive, gpu_type=args.gpu_type, cpu=args.cpu,
                         job_args=tuple(args.passthrough))
    with usage():
        template = template_path(args.template).read_text()
        text = render(template, opts)  # validates opts
    sizes = dict(re.findall(r"^#SBATCH --(nodes|ntasks-per-node)=(\d+)\b", text, re.M))
    # at the job's ranks as rendered (a node range such as 2-4: the flags alone)
    ranks = int(sizes["nodes"]) * int(sizes["ntasks-per-node"]) if len(sizes) == 2 else None
    check_job_args(template, opts.job_args, ranks, opts.cpu or opts.gpus_per_node == 0)
    early = signal_too_early(text)
    if early:
        print(f"hpcjobs slurm: warning: {early}", file=sys.stderr)
    return text


def given(value) -> bool:
    """Whether a render flag was given: --gpus-per-node 0 is (0 == False), --exclusive left off is not."""
    return value is not None and value is not False


# what asks sbatch for GPUs from the environment, which CPU mode does not want
GPU_VARIABLES = ("SBATCH_GPUS_PER_NODE", "SBATCH_GPUS", "SBATCH_GRES")
# render's flags and the sbatch variable that would take their #SBATCH line's place
_VARIABLES = {"partition": "SBATCH_PARTITION", "account": "SBATCH_ACCOUNT", "qos": "SBATCH_QOS",
              "constraint": "SBATCH_CONSTRAINT", "mem": "SBATCH_MEM_PER_NODE", "exclusive": "SBATCH_EXCLUSIVE",
              "time": "SBATCH_TIMELIMIT", "job_name": "SBATCH_JOB_NAME", "gpus_per_node": "SBATCH_GPUS_PER_NODE",
              "ntasks_per_node": "SBATCH_GPUS_PER_NODE", "gpu_type": "SBATCH_GPUS_PER_NODE"}


def overridden(args) -> list[str]:
    """The SBATCH_* variables set here that would take the place of a flag
    given to render, once sbatch reads the script (its environment comes
    before a script's #SBATCH lines)."""
    pairs = [(flag, var) for flag, var in _VARIABLES.items() if given(getattr(args, flag, None))]
    if args.cpu or args.gpus_per_node == 0:  # CPU mode asks for no GPUs: a GPU variable would give it some
        pairs = [p for p in pairs if p[1] not in GPU_VARIABLES]
        pairs += [("cpu" if args.cpu else "gpus_per_node", var) for var in GPU_VARIABLES]
    return list(dict.fromkeys(f"{var}={os.environ[var]} (--{flag.replace('_', '-')})"
                              for flag, var in pairs if os.environ.get(var)))


def run(args) -> int:
    text = script(args)
    for what in overridden(args):
        print(f"hpcjobs slurm render: warning: {what}: sbatch takes its environment over the script's #SBATCH "
              "line; unset it, or submit with `hpcjobs slurm submit`, which overrides it (the flag on sbatch's command "
              "line; in CPU mode, no GPU variable)",
              file=sys.stderr)
    sys.stdout.write(text)
    return 0
