"""Slurm: the job templates in ``slurm/`` (``hpcjobs/slurm_templates``),
filled in for a job, and the launcher command that starts the ranks from
inside one.

This module starts no MPI: it runs on a login node and on the batch host.
The commands around it are ``hpcjobs slurm render / submit / launch``
(``hpcjobs.cli``):

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
   its ``NodeAddr``; ``HPCJOBS_MASTER_ADDR`` if set) and ``MASTER_PORT``
   (20000 + job id mod 12000; ``HPCJOBS_MASTER_PORT``) for torch.distributed,
   whatever ``MASTER_*`` the submit shell passed on, and
   ``HPCJOBS_EXPECT_WORLD_SIZE`` to the job's task count, so ranks that come
   up as singletons (a launcher that does not match the MPI) fail loudly;
4. asks each rank to bind to its GPU by local rank (``HPCJOBS_BIND_GPU``,
   read by :func:`hpcjobs.runtime.bind_gpu` in every rank) unless
   ``HPCJOBS_CPU=1``;
5. execs ``srun --mpi=$HPCJOBS_SRUN_MPI`` (default pmix;
   ``--kill-on-bad-exit=1``: a rank that fails ends the job; ``--export=ALL``:
   all of this reaches the ranks under ``sbatch --export=NONE`` too) or, with
   ``HPCJOBS_LAUNCHER=mpirun``, ``mpirun`` over the allocation.

Which ``--mpi`` goes with which MPI: docs/cluster.md, "Which launcher with
which MPI".
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TEMPLATES", "template_path", "render", "RenderOptions", "job_commands", "launch_command",
           "master_address", "STOP_FILE", "STOP_FILE_ENV", "requeue_decision", "stop_point"]

TEMPLATES = ("allreduce", "train", "tune", "horovod", "nccl")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")  # fullmatch: no trailing newline gets through
_TIME = re.compile(r"(?:(?P<days>\d+)-)?(?P<first>\d+)(?P<rest>(?::\d{1,2}){0,2})")
_SBATCH = re.compile(r"^#SBATCH --(?P<key>[a-z-]+)=(?P<value>\S+)(?P<rest>.*)$")
_MEM = re.compile(r"\d+[KMGTkmgt]?")


def _constraint_ok(text: str) -> bool:
    """Slurm's --constraint grammar: features (each with a node count or
    not) joined by & (and), | (or) or , ; grouped in parentheses, which may
    take a count, and in (unnested) brackets: matching or, ``[rack1|rack2]``,
    and multiple counts, ``[rack1*2&rack2*4]``."""
    if not re.fullmatch(r"[A-Za-z0-9_.&|,*()\[\]-]+", text) or re.search(r"\[[^\]]*\[", text):
        return False
    s = re.sub(r"\*[1-9]\d*", "#", text)  # node counts first: a count's digits are no feature
    s, before = re.sub(r"[A-Za-z0-9_.-]+#?", "x", s), None
    while s != before:  # fold "x&x", "(x)", "(x)#" and "[x]" down to one "x"
        before = s
        s = re.sub(r"\(x\)#?|\[x\]|x[&|,]x", "x", s)
    return s == "x"


def template_dir() -> Path:
    """The templates, package data (``hpcjobs/slurm_templates``, which the
    checkout's ``slurm/`` links to): there in any install, not only an
    editable one."""
    return Path(__file__).resolve().parent / "slurm_templates"


def template_path(name: str) -> Path:
    """A template by name (``allreduce``) or by path."""
    if name in TEMPLATES:
        path = template_dir() / f"{name}.sbatch"
    else:
        path = Path(name)
    if not path.is_file():
        raise ValueError(f"no template {name!r}: give one of {', '.join(TEMPLATES)} or a path to a .sbatch file")
    return path


def _time(text: str) -> str:
    """Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS,
    with minutes and seconds after the first field below 60 and hours after
    a day count below 24; or UNLIMITED / INFINITE."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return text
    m = _TIME.fullmatch(text)
    if not m:
        raise ValueError(f"--time {text!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS)")
    later = [int(f) for f in m["rest"].split(":")[1:]]
    if any(v >= 60 for v in later) or (m["days"] is not None and int(m["first"]) >= 24):
        raise ValueError(f"--time {text!r}: minutes and seconds must be below 60, and hours below 24 after days")
    return text


def time_seconds(text: str) -> int | None:
    """A Slurm time (:func:`_time`'s formats) in seconds; None for no limit
    (UNLIMITED, INFINITE, or 0, which sbatch takes to mean none)."""
    if _time(text).upper() in ("UNLIMITED", "INFINITE") or not any(int(d) for d in re.findall(r"\d+", text)):
        return None
    m = _TIME.fullmatch(text)
    first, later = int(m["first"]), [int(f) for f in m["rest"].split(":")[1:]]
    if m["days"] is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        minutes, seconds = (later + [0, 0])[:2]
        return int(m["days"]) * 86400 + first * 3600 + minutes * 60 + seconds
    if len(later) == 2:  # HH:MM:SS
        return first * 3600 + later[0] * 60 + later[1]
    return first * 60 + sum(later)  # MM, MM:SS


def signal_too_early(script: str) -> str | None:
    """Where a script's ``--signal=...@S`` comes with a ``--time`` of S + 60 s
    or less (Slurm may send the signal up to 60 s before S), why: the train
    template's SIGUSR1 would stop the run at its start, and requeue it."""
    signal = re.search(r"^#SBATCH --signal=\S*@(\d+)", script, re.M)
    limit = re.search(r"^#SBATCH --time=(\S+)", script, re.M)
    seconds = time_seconds(limit.group(1)) if signal and limit else None
    if seconds is None or seconds > int(signal.group(1)) + 60:
        return None
    return (f"--time {limit.group(1)} ({seconds} s): the script asks for a signal {signal.group(1)} s before the "
            "limit, which Slurm may send up to 60 s earlier, so it comes as the job starts (train: a checkpoint "
            "after the second step, a stop and a requeue, each time); give a longer --time")


def _name(flag: str, text: str, listed: bool = False) -> str:
    """A name Slurm takes (``listed``: a comma-separated list of them, as
    partitions are)."""
    if not all(_NAME.fullmatch(part) for part in (text.split(",") if listed else [text])):
        raise ValueError(f"{flag} {text!r}: use letters, digits, '_', '.', '-' (at most 64, not starting with . or -)"
                         + (", names separated by commas" if listed else ""))
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
    qos: str | None = None
    constraint: str | None = None
    mem: str | None = None
    exclusive: bool = False
    gpu_type: str | None = None
    cpu: bool = False
    job_args: tuple[str, ...] = ()

    def validate(self) -> None:
        for flag in ("nodes", "ntasks_per_node", "cpus_per_task"):
            v = getattr(self, flag)
            if v is not None and (int(v) != v or v < 1):
                raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {v}")
        if self.gpus_per_node is not None and (int(self.gpus_per_node) != self.gpus_per_node
                                               or self.gpus_per_node < 0):
            raise ValueError(f"--gpus-per-node must be an integer >= 0, got {self.gpus_per_node}")
        if self.time is not None:
            _time(self.time)
        if self.job_name is not None:
            _name("--job-name", self.job_name)
        if self.partition is not None:
            _name("--partition", self.partition, listed=True)
        if self.account is not None:
            _name("--account", self.account)
        if self.qos is not None:
            _name("--qos", self.qos)
        if self.gpu_type is not None:
            _name("--gpu-type", self.gpu_type)
        if self.constraint is not None and not _constraint_ok(self.constraint):
            raise ValueError(f"--constraint {self.constraint!r}: node features (letters, digits, '_', '.', '-'), "
                             "each with a node count or not (a100*2), joined by & (and), | (or) or , and grouped "
                             "in ( ) or [ ] -- e.g. a100&ib, [rack1|rack2], [rack1*2&rack2*4]")
        if self.mem is not None and not _MEM.fullmatch(self.mem):
            raise ValueError(f"--mem {self.mem!r}: memory per node as a number with K, M, G or T (M without one); "
                             "0 asks for all of each node's memory")

    def site_lines(self) -> list[str]:
        """The #SBATCH lines of the site's choices, commented, after the job name."""
        lines = [(f"partition={self.partition}", "partition"), (f"account={self.account}", "account charged"),
                 (f"qos={self.qos}", "quality of service"), (f"constraint={self.constraint}", "node features"),
                 (f"mem={self.mem}", "memory per node, 0: all"), ("exclusive", "no other job on the nodes")]
        given = (self.partition, self.account, self.qos, self.constraint, self.mem, self.exclusive or None)
        return [f"#SBATCH --{line}".ljust(40) + f" # {what} (render --{line.split('=')[0]})"
                for (line, what), value in zip(lines, given) if value is not None]


def job_commands(template: str) -> list[tuple[str, ...]]:
    """The hpcjobs commands a template runs with the job's arguments
    (``hpcjobs slurm launch [FLAGS] -- COMMAND ... ${JOB_ARGS[@]+"${JOB_ARGS[@]}"}``:
    the array, or nothing where it is empty, which bash before 4.4 under
    ``set -u`` would call unbound)."""
    commands = []
    for line in template.replace("\\\n", " ").splitlines():
        m = re.search(r"hpcjobs slurm launch(?: [^ ]+)*? -- (.*)", line)  # launch's own flags before --
        if m and '${JOB_ARGS[@]+"${JOB_ARGS[@]}"}' in line:
            words = []
            for word in m.group(1).split():
                if not re.fullmatch(r"[a-z][a-z-]*", word):
                    break
                words.append(word)
            if tuple(words) not in commands:  # one command on two lines (train with and without a checkpoint)
                commands.append(tuple(words))
    return commands


def render(template: str, opts: RenderOptions) -> str:
    """The template's text with the user's values in its ``#SBATCH`` lines,
    its ``JOB_ARGS=()`` filled (shell-quoted) and, with ``cpu``, CPU mode on
    by default and no GPU request.

    The job's arguments are not checked here (that needs the command line's
    parsers; ``hpcjobs slurm render`` checks them against
    :func:`job_commands` first).

    Raises:
        ValueError: an invalid value, or a template without the lines to fill.
    """
    opts.validate()
    values = {"nodes": opts.nodes, "ntasks-per-node": opts.ntasks_per_node, "gpus-per-node": opts.gpus_per_node,
              "cpus-per-task": opts.cpus_per_task, "time": opts.time, "job-name": opts.job_name}
    cpu = opts.cpu or opts.gpus_per_node == 0
    if opts.cpu and opts.gpus_per_node:
        raise ValueError(f"--cpu asks for no GPUs: leave out --gpus-per-node {opts.gpus_per_node}")
    if cpu and opts.gpu_type:
        raise ValueError(f"--gpu-type {opts.gpu_type}: CPU mode asks for no GPUs (leave out --cpu or "
                         "--gpus-per-node 0)")
    if not cpu:  # one rank drives one GPU (runtime.bind_gpu): the one given sets the other
        tasks, gpus = opts.ntasks_per_node, opts.gpus_per_node
        if tasks is not None and gpus is not None and tasks != gpus:
            raise ValueError(f"--ntasks-per-node {tasks} and --gpus-per-node {gpus}: each rank drives one GPU, so "
                             "give them equal (or --cpu)")
        values["ntasks-per-node"] = values["gpus-per-node"] = tasks if tasks is not None else gpus
    out, seen = [], set()
    for line in template.splitlines():
        m = _SBATCH.match(line)
        if m:
            key = m.group("key")
            seen.add(key)
            if key == "gpus-per-node" and cpu:
                continue  # CPU mode: ask for no GPUs
            if key == "gpus-per-node" and opts.gpu_type:  # typed GRES: TYPE:COUNT (the template's count)
                count = values.get(key) if values.get(key) is not None else m.group("value").split(":")[-1]
                values[key] = f"{opts.gpu_type}:{count}"
            if values.get(key) is not None:
                head, rest = f"#SBATCH --{key}={values[key]}", m.group("rest")
                comment = rest.lstrip()
                # keep the comment in its column when the new value fits
                width = len(line) - len(comment) if comment else 0
                line = (head.ljust(width - 1) + " " + comment) if comment else head
            out.append(line)
            if key == "job-name":
                out += opts.site_lines()
            continue
        if line.strip() == "JOB_ARGS=()":
            seen.add("JOB_ARGS")
            line = "JOB_ARGS=(" + " ".join(shlex.quote(a) for a in opts.job_args) + ")"
        elif cpu and line.startswith("export HPCJOBS_CPU=${HPCJOBS_CPU:-0}"):
            line = line.replace("${HPCJOBS_CPU:-0}", "${HPCJOBS_CPU:-1}", 1)
        out.append(line)
    missing = [k for k in ("nodes", "ntasks-per-node", "time", "job-name", "JOB_ARGS") if k not in seen]
    if missing:
        raise ValueError(f"the template has no {', '.join(missing)} line(s) to fill")
    return "\n".join(out) + "\n"


# --- inside a job ---------------------------------------------------------

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
        raise ValueError("SLURM_NTASKS is not set: launch runs inside an sbatch job")
    job_dir = Path(env.get("HPCJOBS_RESULTS") or Path(env.get("SLURM_SUBMIT_DIR", ".")) / "results") / \
        f"{env.get('SLURM_JOB_NAME', 'hpcjobs')}-{env['SLURM_JOB_ID']}"
    new = dict(env)
    new["HPCJOBS_JOB_DIR"] = str(job_dir)
    new["HPCJOBS_EXPECT_WORLD_SIZE"] = str(ntasks)
    # torch.distributed's rendezvous: the first node of this job, whatever MASTER_ADDR/MASTER_PORT the submit
    # shell passed on (a torchrun habit, MASTER_ADDR=localhost, would send every node to itself); an address
    # of one's own through HPCJOBS_MASTER_ADDR / HPCJOBS_MASTER_PORT. The port is below Linux's ephemeral range.
    new.pop("MASTER_ADDR", None)
    if env.get("HPCJOBS_MASTER_ADDR"):
        new["MASTER_ADDR"] = env["HPCJOBS_MASTER_ADDR"]
    new["MASTER_PORT"] = env.get("HPCJOBS_MASTER_PORT") or str(20000 + int(env["SLURM_JOB_ID"]) % 12000)
    if env.get("HPCJOBS_CPU", "0") != "1":
        new["HPCJOBS_BIND_GPU"] = "1"
    new.setdefault("PMIX_MCA_psec", "native")  # Slurm's PMIx server and the wheel's client agree on it
    venv_prterun = Path(sys.prefix) / "bin" / "prterun"
    if "OPAL_PREFIX" not in env and venv_prterun.exists():
        new["OPAL_PREFIX"] = sys.prefix  # the Open MPI wheel finds its help files and components
    hpcjobs = [sys.executable, "-m", "hpcjobs", *[a.replace("{job_dir}", str(job_dir)) for a in args]]
    launcher = env.get("HPCJOBS_LAUNCHER", "srun")
    if launcher == "srun":
        # since Slurm 22.05 srun no longer takes --cpus-per-task from the job: each task would get one core
        cpus = env.get("SLURM_CPUS_PER_TASK", "")
        # --kill-on-bad-exit: a rank that exits non-zero ends the step, as mpirun does. Without it a rank that
        # failed before MPI started (bad input on one node) left the others in MPI_Init until the time limit.
        # --export=ALL: the environment set here reaches the ranks also in a job submitted with --export=NONE
        # (or SBATCH_EXPORT=NONE), whose srun would pass on only SLURM_* (MPI_Init then failed, OPAL_PREFIX lost).
        cmd = ["srun", f"--mpi={env.get('HPCJOBS_SRUN_MPI', 'pmix')}", "--kill-on-bad-exit=1", "--export=ALL",
               *([f"--cpus-per-task={cpus}"] if cpus else []), *shlex.split(env.get("HPCJOBS_SRUN_FLAGS", "")),
               *hpcjobs]
    elif launcher == "mpirun":
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        mapping = ["--map-by", f"ppr:{per_node}:node"] if per_node.isdigit() else []
        cmd = ["mpirun", "-n", str(ntasks), *mapping, *shlex.split(env.get("HPCJOBS_MPIRUN_FLAGS", "")), *hpcjobs]
        # Open MPI starts its daemons on the other nodes with an srun of its own, which reads --export from
        # SLURM_EXPORT_ENV: in a job submitted with --export=NONE (or SBATCH_EXPORT=a list) they got only SLURM_*
        # and the list, and the job failed, as srun's ranks did before --export=ALL above
        new["SLURM_EXPORT_ENV"] = "ALL"
    else:
        raise ValueError(f"HPCJOBS_LAUNCHER must be srun or mpirun, got {launcher!r}")
    return cmd, new


STOP_FILE = "stopped.json"  # in the job's results directory: where a run a signal stopped says so (launch --requeue)
# The variable that names it to the ranks (hpcjobs.training.preempt.write_stop_file): launch reads the file when
# srun ends, since srun's exit status does not tell a stop from a failure (it read 138 or 143 for the same stop).
STOP_FILE_ENV = "HPCJOBS_STOP_FILE"


def stop_point(epoch: int, step: int) -> str:
    """Where a stopped run stands, as its messages say it: whole epochs
    done, and steps of the next."""
    return f"at step {step} of epoch {epoch + 1}" if step else f"after epoch {epoch}"


def requeue_decision(record: dict | None, restarts: int, limit: int) -> tuple[bool, str]:
    """After the ranks' run ended, ``launch --requeue LIMIT``: whether to
    requeue the job, and a line for its log saying why ("" when the run
    was not stopped by a signal). ``record``: what the run wrote to its
    stop file (:func:`hpcjobs.training.preempt.write_stop_file`), None if
    it wrote none; ``restarts``: how often the job ran before
    (``SLURM_RESTART_COUNT``).

    Only a SIGUSR1 stop requeues: ``sbatch --signal=B:USR1@SECONDS`` before
    the time limit, or ``scancel --batch --signal=USR1``. A SIGTERM is Slurm ending
    the job (``scancel``, the time limit, preemption, which requeues a job
    by itself where the site says so)."""
    if record is None:
        return False, ""
    where = stop_point(int(record.get("epoch") or 0), int(record.get("step") or 0))
    signal_name = record.get("signal", "?")
    if not record.get("written"):
        return False, (f"{signal_name} stopped the run {where} with parameters that are not finite: not requeued "
                       "(it would resume from the last checkpoint and end the same)")
    if signal_name != "SIGUSR1":
        return False, (f"{signal_name} stopped the run {where}: not requeued (a SIGUSR1 requeues; a SIGTERM is "
                       "scancel, the time limit or preemption)")
    if restarts >= limit:
        return False, (f"SIGUSR1 stopped the run {where}: not requeued, the job was requeued {restarts} time(s) "
                       f"and --requeue allows {limit}; `scontrol requeue JOB` goes on from the checkpoint")
    return True, (f"SIGUSR1 stopped the run {where}: requeueing the job ({restarts + 1} of at most {limit}); it "
                  f"resumes from {record.get('checkpoint')} when Slurm starts it again")
