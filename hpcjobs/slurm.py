"""Slurm: render and submit the job templates in ``slurm/``, and launch the
ranks from inside a job.

    hpcjobs slurm render allreduce --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 \\
        --time 01:00:00 --partition gpu -- --max-bytes 1G > job.sbatch
    hpcjobs slurm submit train --nodes 2 --cpu -- --epochs 5      # sbatch it, print the job id

Inside a job (the last line of every template)::

    hpcjobs slurm launch -- bench allreduce --out {job_dir}/report

``launch`` runs once, on the batch host. It

1. refuses to run outside a Slurm allocation;
2. makes the per-job results directory ``$HPCJOBS_RESULTS/<job name>-<job id>``
   and substitutes it for ``{job_dir}`` in the arguments;
3. sets ``MASTER_ADDR`` (the first node of ``scontrol show hostnames``, as
   its ``NodeAddr``) and ``MASTER_PORT`` for torch.distributed, and
   ``HPCJOBS_EXPECT_WORLD_SIZE`` to the job's task count, so ranks that come
   up as singletons (a launcher that does not match the MPI) fail loudly;
4. asks each rank to bind to its GPU by local rank (``HPCJOBS_BIND_GPU``,
   read by :func:`bind_gpu` in every rank) unless ``HPCJOBS_CPU=1``;
5. execs ``srun --mpi=$HPCJOBS_SRUN_MPI`` (default pmix) or, with
   ``HPCJOBS_LAUNCHER=mpirun``, ``mpirun`` over the allocation.

Which ``--mpi`` goes with which MPI is in the README ("Running on a cluster").
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .cli import UsageError, arguments, command, positive_int

__all__ = ["TEMPLATES", "template_path", "render", "RenderOptions", "bind_gpu", "launch_command",
           "clear_stale_mpi_sessions"]

TEMPLATES = ("allreduce", "train", "tune", "horovod", "nccl")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_TIME = re.compile(r"^(?:(?P<days>\d+)-)?(?P<first>\d+)(?P<rest>(?::\d{1,2}){0,2})$")
_SBATCH = re.compile(r"^#SBATCH --(?P<key>[a-z-]+)=(?P<value>\S+)(?P<rest>.*)$")


def template_dir() -> Path:
    """``slurm/`` beside the package (an editable install or a checkout)."""
    return Path(__file__).resolve().parent.parent / "slurm"


def template_path(name: str) -> Path:
    """A template by name (``allreduce``) or by path."""
    if name in TEMPLATES:
        path = template_dir() / f"{name}.sbatch"
    else:
        path = Path(name)
    if not path.is_file():
        raise UsageError(f"no template {name!r}: give one of {', '.join(TEMPLATES)} or a path to a .sbatch file")
    return path


def _time(text: str) -> str:
    """Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS,
    with minutes and seconds after the first field below 60 and hours after
    a day count below 24; or UNLIMITED / INFINITE."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return text
    m = _TIME.match(text)
    if not m:
        raise UsageError(f"--time {text!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS)")
    later = [int(f) for f in m["rest"].split(":")[1:]]
    if any(v >= 60 for v in later) or (m["days"] is not None and int(m["first"]) >= 24):
        raise UsageError(f"--time {text!r}: minutes and seconds must be below 60, and hours below 24 after days")
    return text


def _name(flag: str, text: str) -> str:
    if not _NAME.match(text):
        raise UsageError(f"{flag} {text!r}: use letters, digits, '_', '.', '-' (at most 64, not starting with . or -)")
    return text


@dataclass
class RenderOptions:
    nodes: int | None = None
    ntasks_per_node: int | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None
    job_name: str | None = None
    partition: str | None = None
    account: str | None = None
    cpu: bool = False
    job_args: tuple[str, ...] = ()

    def validate(self) -> None:
        for flag in ("nodes", "ntasks_per_node", "cpus_per_task"):
            v = getattr(self, flag)
            if v is not None and (int(v) != v or v < 1):
                raise UsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {v}")
        if self.gpus_per_node is not None and (int(self.gpus_per_node) != self.gpus_per_node
                                               or self.gpus_per_node < 0):
            raise UsageError(f"--gpus-per-node must be an integer >= 0, got {self.gpus_per_node}")
        if self.time is not None:
            _time(self.time)
        if self.job_name is not None:
            _name("--job-name", self.job_name)
        if self.partition is not None:
            _name("--partition", self.partition)
        if self.account is not None:
            _name("--account", self.account)


def job_commands(template: str) -> list[tuple[str, ...]]:
    """The hpcjobs commands a template runs with the job's arguments
    (``hpcjobs slurm launch -- COMMAND ... "${JOB_ARGS[@]}"``)."""
    commands = []
    for line in template.replace("\\\n", " ").splitlines():
        m = re.search(r"hpcjobs slurm launch -- (.*)", line)
        if m and '"${JOB_ARGS[@]}"' in line:
            words = []
            for word in m.group(1).split():
                if not re.fullmatch(r"[a-z][a-z-]*", word):
                    break
                words.append(word)
            commands.append(tuple(words))
    return commands


def check_job_args(template: str, job_args: tuple[str, ...]) -> None:
    """Refuse job arguments that no command of the template accepts (a
    template may run one of several, e.g. train or large-batch), before
    anything is submitted.

    Raises:
        UsageError: naming the command and argparse's complaint.
    """
    commands = job_commands(template)
    if not job_args or not commands:
        return
    from .cli import parse_error

    errors = [parse_error([*cmd, *job_args]) for cmd in commands]
    if all(errors):
        raise UsageError(f"the job's arguments after -- would fail in the job: {errors[0]}")


def render(template: str, opts: RenderOptions) -> str:
    """The template's text with the user's values in its ``#SBATCH`` lines,
    its ``JOB_ARGS=()`` filled (shell-quoted) and, with ``cpu``, CPU mode on
    by default and no GPU request.

    Raises:
        UsageError: an invalid value, job arguments the template's command
            does not take, or a template without the lines to fill.
    """
    opts.validate()
    check_job_args(template, opts.job_args)
    values = {"nodes": opts.nodes, "ntasks-per-node": opts.ntasks_per_node, "gpus-per-node": opts.gpus_per_node,
              "cpus-per-task": opts.cpus_per_task, "time": opts.time, "job-name": opts.job_name}
    cpu = opts.cpu or opts.gpus_per_node == 0
    out, seen = [], set()
    for line in template.splitlines():
        m = _SBATCH.match(line)
        if m:
            key = m.group("key")
            seen.add(key)
            if key == "gpus-per-node" and cpu:
                continue  # CPU mode: ask for no GPUs
            if values.get(key) is not None:
                head, rest = f"#SBATCH --{key}={values[key]}", m.group("rest")
                comment = rest.lstrip()
                # keep the comment in its column when the new value fits
                width = len(line) - len(comment) if comment else 0
                line = (head.ljust(width - 1) + " " + comment) if comment else head
            out.append(line)
            if key == "job-name":
                if opts.partition:
                    out.append(f"#SBATCH --partition={opts.partition}".ljust(40) + " # partition (render --partition)")
                if opts.account:
                    out.append(f"#SBATCH --account={opts.account}".ljust(40) + " # account charged (render --account)")
            continue
        if line.strip() == "JOB_ARGS=()":
            seen.add("JOB_ARGS")
            line = "JOB_ARGS=(" + " ".join(shlex.quote(a) for a in opts.job_args) + ")"
        elif cpu and line.startswith("export HPCJOBS_CPU=${HPCJOBS_CPU:-0}"):
            line = line.replace("${HPCJOBS_CPU:-0}", "${HPCJOBS_CPU:-1}", 1)
        out.append(line)
    missing = [k for k in ("nodes", "ntasks-per-node", "time", "job-name", "JOB_ARGS") if k not in seen]
    if missing:
        raise UsageError(f"the template has no {', '.join(missing)} line(s) to fill")
    return "\n".join(out) + "\n"


# --- inside a job ---------------------------------------------------------

def bind_gpu() -> None:
    """In a rank process: with ``HPCJOBS_BIND_GPU=1``, keep only the GPU of
    this rank's local index visible (before torch touches CUDA). The local
    index is the MPI's own (``OMPI_COMM_WORLD_LOCAL_RANK``,
    ``MPI_LOCALRANKID``) or ``SLURM_LOCALID`` under srun -- under mpirun
    ``SLURM_LOCALID`` is 0 on every rank."""
    if os.environ.get("HPCJOBS_BIND_GPU") != "1":
        return
    local = next((os.environ[k] for k in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
                  if os.environ.get(k, "").isdigit()), None)
    if local is None:
        return
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    index = int(local)
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[index % len(visible)] if visible else str(index)
    os.environ["LOCAL_RANK"] = local


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout


def master_address(nodelist: str) -> str:
    """The first node of the allocation, as the address Slurm reaches it at."""
    first = _scontrol("show", "hostnames", nodelist).split()[0]
    m = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", first))
    return m.group(1) if m else first


def launch_command(env: dict, args: list[str]) -> tuple[list[str], dict]:
    """The launcher command and environment for ``hpcjobs <args>`` on every
    task of the job described by ``env`` (Slurm's variables)."""
    ntasks = int(env.get("SLURM_NTASKS") or 0)
    if ntasks < 1:
        raise UsageError("SLURM_NTASKS is not set: launch runs inside an sbatch job")
    job_dir = Path(env.get("HPCJOBS_RESULTS") or Path(env.get("SLURM_SUBMIT_DIR", ".")) / "results") / \
        f"{env.get('SLURM_JOB_NAME', 'hpcjobs')}-{env['SLURM_JOB_ID']}"
    new = dict(env)
    new["HPCJOBS_JOB_DIR"] = str(job_dir)
    new["HPCJOBS_EXPECT_WORLD_SIZE"] = str(ntasks)
    new.setdefault("MASTER_PORT", str(20000 + int(env["SLURM_JOB_ID"]) % 20000))
    if env.get("HPCJOBS_CPU", "0") != "1":
        new["HPCJOBS_BIND_GPU"] = "1"
    new.setdefault("PMIX_MCA_psec", "native")  # Slurm's PMIx server and the wheel's client agree on it
    venv_prterun = Path(sys.prefix) / "bin" / "prterun"
    if "OPAL_PREFIX" not in env and venv_prterun.exists():
        new["OPAL_PREFIX"] = sys.prefix  # the Open MPI wheel finds its help files and components
    hpcjobs = [sys.executable, "-m", "hpcjobs", *[a.replace("{job_dir}", str(job_dir)) for a in args]]
    launcher = env.get("HPCJOBS_LAUNCHER", "srun")
    if launcher == "srun":
        cmd = ["srun", f"--mpi={env.get('HPCJOBS_SRUN_MPI', 'pmix')}", *shlex.split(env.get("HPCJOBS_SRUN_FLAGS", "")),
               *hpcjobs]
    elif launcher == "mpirun":
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        mapping = ["--map-by", f"ppr:{per_node}:node"] if per_node.isdigit() else []
        cmd = ["mpirun", "-n", str(ntasks), *mapping, *shlex.split(env.get("HPCJOBS_MPIRUN_FLAGS", "")), *hpcjobs]
    else:
        raise UsageError(f"HPCJOBS_LAUNCHER must be srun or mpirun, got {launcher!r}")
    return cmd, new


def clear_stale_mpi_sessions(tmpdir: str | None = None) -> list[Path]:
    """Remove this user's Open MPI session folders whose ``mpirun`` is gone;
    return them.

    Open MPI 5's mpirun keeps its session in ``$TMPDIR/ompi.<its pid>`` and
    removes it when it exits, but not when it is killed (scancel, a time
    limit, the OOM killer). A later mpirun on that node that is given the
    same pid finds the old rendezvous file and stops with "The PMIx server's
    listener thread failed to start". A folder whose pid is alive is left
    alone: a folder of ours can only belong to a live mpirun of ours.
    ``scripts/lib.sh`` (``clean_stale_mpi_sessions``) does the same for the
    scripts."""
    base = Path(tmpdir or os.environ.get("TMPDIR") or "/tmp")
    removed = []
    for d in sorted(base.glob("ompi.*")):
        pid = d.name.removeprefix("ompi.")
        if not pid.isdigit() or d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # a live process of ours with this pid: its mpirun
        except (ProcessLookupError, PermissionError):  # none, or someone else's: our mpirun is gone
            pass
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


# --- commands -----------------------------------------------------------------

def _render_arguments(p) -> None:
    p.add_argument("template", help=f"one of {', '.join(TEMPLATES)}, or a path to a .sbatch file")
    p.add_argument("--nodes", "-N", type=positive_int, help="nodes")
    p.add_argument("--ntasks-per-node", type=positive_int, help="ranks per node (= GPUs per node)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (0 = CPU mode)")
    p.add_argument("--cpus-per-task", type=positive_int, help="cores per rank")
    p.add_argument("--time", "-t", help="wall-clock limit (HH:MM:SS, D-HH:MM:SS, ...)")
    p.add_argument("--job-name", "-J", help="job name (letters, digits, _ . -)")
    p.add_argument("--partition", "-p", help="partition (else sbatch's default or SBATCH_PARTITION)")
    p.add_argument("--account", "-A", help="account (else SBATCH_ACCOUNT)")
    p.add_argument("--cpu", action="store_true", help="CPU mode: no GPU request, HPCJOBS_CPU=1 by default")
    p.epilog = "Arguments after -- go to the job's hpcjobs command, e.g. -- --max-bytes 1G"


def _options(args) -> RenderOptions:
    return RenderOptions(nodes=args.nodes, ntasks_per_node=args.ntasks_per_node, gpus_per_node=args.gpus_per_node,
                         cpus_per_task=args.cpus_per_task, time=args.time, job_name=args.job_name,
                         partition=args.partition, account=args.account, cpu=args.cpu,
                         job_args=tuple(args.passthrough))


def _no_mpi(fn):
    fn.no_mpi = True  # runs on a login node or the batch host: no MPI_Init
    fn.takes_passthrough = True  # the job's arguments come after --
    return fn


@command("slurm render", "print a job script: a template from slurm/ with your values, validated and quoted")
@arguments(_render_arguments)
@_no_mpi
def render_main(args) -> int:
    text = render(template_path(args.template).read_text(), _options(args))
    sys.stdout.write(text)
    return 0


def _submit_arguments(p) -> None:
    _render_arguments(p)
    p.add_argument("--script", metavar="PATH", help="where to write the job script "
                   "(default: results/slurm/<template>-<n>.sbatch)")
    p.add_argument("--wait", action="store_true", help="sbatch --wait: return when the job ends, with its exit code")


@command("slurm submit", "render a template and sbatch it; prints the job id")
@arguments(_submit_arguments)
@_no_mpi
def submit_main(args) -> int:
    if shutil.which("sbatch") is None:
        raise UsageError("no sbatch on PATH: submit from a Slurm login node (or start scripts/local_slurm.sh)")
    text = render(template_path(args.template).read_text(), _options(args))
    if args.script:
        script = Path(args.script)
    else:
        base = Path("results/slurm")
        base.mkdir(parents=True, exist_ok=True)
        stem = Path(args.template).stem
        n = 1 + sum(1 for _ in base.glob(f"{stem}-*.sbatch"))
        script = base / f"{stem}-{n}.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    script.chmod(0o755)
    cmd = ["sbatch", "--parsable", *(["--wait"] if args.wait else []), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    job_id = proc.stdout.strip().split(";")[0]
    if job_id:
        print(job_id, flush=True)
    if proc.returncode != 0:
        print(f"hpcjobs slurm submit: sbatch exited {proc.returncode}: {proc.stderr.strip()}", file=sys.stderr)
        return proc.returncode
    print(f"# submitted {script} as job {job_id}", file=sys.stderr)
    return 0


def _launch_arguments(p) -> None:
    p.epilog = "After --: the hpcjobs command every rank runs; {job_dir} in it becomes the job's results directory"


@command("slurm launch", "inside a job script: start the ranks with srun or mpirun (see the templates)")
@arguments(_launch_arguments)
@_no_mpi
def launch_main(args) -> int:
    if not os.environ.get("SLURM_JOB_ID"):
        raise UsageError("not inside a Slurm job (no SLURM_JOB_ID): submit the template with sbatch")
    if not args.passthrough:
        raise UsageError("give the command the ranks run after --, e.g. launch -- bench allreduce")
    from .cli import parse_error

    error = parse_error(list(args.passthrough))
    if error:  # before srun starts a rank
        raise UsageError(f"the ranks' command would fail: {error}")
    cmd, env = launch_command(dict(os.environ), list(args.passthrough))
    env.setdefault("MASTER_ADDR", master_address(os.environ.get("SLURM_JOB_NODELIST", "")))
    Path(env["HPCJOBS_JOB_DIR"]).mkdir(parents=True, exist_ok=True)
    if cmd[0] == "mpirun":
        stale = clear_stale_mpi_sessions(env.get("TMPDIR"))
        if stale:
            print(f"# removed {len(stale)} session folder(s) of killed mpiruns, which would stop an mpirun given "
                  f"the same pid: {' '.join(map(str, stale))}", flush=True)
    print(f"# hpcjobs slurm launch: job {os.environ['SLURM_JOB_ID']}, {env['HPCJOBS_EXPECT_WORLD_SIZE']} tasks on "
          f"{os.environ.get('SLURM_JOB_NUM_NODES', '?')} node(s), results in {env['HPCJOBS_JOB_DIR']}, "
          f"MASTER_ADDR={env['MASTER_ADDR']}:{env['MASTER_PORT']}\n# {shlex.join(cmd)}", flush=True)
    os.execvpe(cmd[0], cmd, env)
