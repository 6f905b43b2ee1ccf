"""``hpcjobs slurm launch``: inside a job script, start the ranks with srun
or mpirun (:func:`hpcjobs.slurm.launch_command`). Runs on the batch host
before any rank: no MPI.

    hpcjobs slurm launch -- bench allreduce --out {job_dir}/report
    hpcjobs slurm launch --requeue 10 -- train --checkpoint {job_dir}/checkpoint.pt --resume

With ``--requeue N`` it waits for the launcher instead of becoming it, and
requeues the job when a SIGUSR1 stopped the run after its checkpoint
(:func:`hpcjobs.slurm.requeue_decision`), at most N times: the run says so
in ``{job_dir}/stopped.json`` (``HPCJOBS_STOP_FILE``), since srun's exit
status does not tell a stop from a failure. A SIGUSR1 this process gets
(the train template execs it and asks ``sbatch --signal=B:USR1@120``)
goes on to the launcher, which hands it to every rank: srun and mpirun
both forward it, so the batch host's ranks under mpirun get it too. The
template ignores SIGUSR1 until then: one that comes before the launcher
runs is dropped.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from .args import UsageError, nonnegative_int, usage


def configure(p) -> None:
    p.add_argument("--requeue", type=nonnegative_int, default=0, metavar="N",
                   help="when a SIGUSR1 stopped the run after its checkpoint (sbatch --signal=B:USR1@SECONDS before "
                        "the time limit, scancel --batch --signal=USR1; a SIGUSR1 this process gets goes on to "
                        "the launcher), requeue the job to resume from it; at most N times in all "
                        "(SLURM_RESTART_COUNT). Default 0: never (the launcher replaces this process)")
    p.epilog = "After --: the hpcjobs command every rank runs; {job_dir} in it becomes the job's results directory"


def _stop_record(path: Path) -> dict | None:
    """What the run wrote when a signal stopped it; None if it wrote nothing (or nothing readable)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _run_forwarding(cmd: list[str], env: dict, signum: int) -> int:
    """Run the launcher and wait for it, handing it each ``signum`` this
    process gets; its return code. The launcher starts with ``signum``
    ignored until it sets its own handler (srun and mpirun do), so one that
    comes before it could pass it on is dropped, not its end; afterwards
    ``signum`` stays ignored: a second one must not end this process before
    it has requeued the job."""
    signal.signal(signum, signal.SIG_IGN)
    child = subprocess.Popen(cmd, env=env)
    signal.signal(signum, lambda sig, frame: child.send_signal(sig))  # nothing once the child has ended
    try:
        return child.wait()
    finally:
        signal.signal(signum, signal.SIG_IGN)


def _run_and_requeue(cmd: list[str], env: dict, limit: int) -> int:
    """The launcher as a child; then, after a SIGUSR1's stop, ``scontrol requeue`` this job."""
    from ..slurm import STOP_FILE, STOP_FILE_ENV, requeue_decision  # not training.preempt: it starts MPI

    stop_file = Path(env["HPCJOBS_JOB_DIR"]) / STOP_FILE
    stop_file.unlink(missing_ok=True)  # a run before this one's
    env[STOP_FILE_ENV] = str(stop_file)
    rc = _run_forwarding(cmd, env, signal.SIGUSR1)
    rc = 128 - rc if rc < 0 else rc  # the launcher ended by a signal: as a shell reports it
    job = os.environ["SLURM_JOB_ID"]
    requeue, why = requeue_decision(_stop_record(stop_file), int(os.environ.get("SLURM_RESTART_COUNT") or 0), limit)
    if why:
        print(f"# hpcjobs slurm launch: job {job}: {why}", flush=True)
    if not requeue:
        return rc
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if proc.returncode != 0:  # the job was not submitted --requeue, or the site's JobRequeue=0 forbids it
        print(f"hpcjobs slurm launch: error: scontrol requeue {job} failed: {proc.stderr.strip() or proc.stdout}; "
              "the checkpoint is there for `--resume`", file=sys.stderr, flush=True)
        return rc or 1
    return 0  # Slurm ends this script and queues the job again


def run(args) -> int:
    from ..runtime import clear_stale_mpi_sessions
    from ..slurm import launch_command, master_address
    from . import parse_error

    if not os.environ.get("SLURM_JOB_ID"):
        raise UsageError("not inside a Slurm job (no SLURM_JOB_ID): submit the template with sbatch")
    if not args.passthrough:
        raise UsageError("give the command the ranks run after --, e.g. launch -- bench allreduce")
    error = parse_error(list(args.passthrough))
    if error:  # before srun starts a rank
        raise UsageError(f"the ranks' command would fail: {error}")
    with usage():
        cmd, env = launch_command(dict(os.environ), list(args.passthrough))
    if "MASTER_ADDR" not in env:  # asks scontrol, unless HPCJOBS_MASTER_ADDR said
        env["MASTER_ADDR"] = master_address(os.environ.get("SLURM_JOB_NODELIST", ""))
    replaced = [f"{k}={os.environ[k]}" for k in ("MASTER_ADDR", "MASTER_PORT") if os.environ.get(k, env[k]) != env[k]]
    if replaced:
        print(f"# replaced {' '.join(replaced)} from the submitting shell with this job's (HPCJOBS_MASTER_ADDR / "
              "HPCJOBS_MASTER_PORT set one's own)", flush=True)
    Path(env["HPCJOBS_JOB_DIR"]).mkdir(parents=True, exist_ok=True)
    if cmd[0] == "mpirun":
        stale = clear_stale_mpi_sessions(env.get("TMPDIR"))
        if stale:
            print(f"# removed {len(stale)} session folder(s) of killed mpiruns, which would stop an mpirun given "
                  f"the same pid: {' '.join(map(str, stale))}", flush=True)
    print(f"# hpcjobs slurm launch: job {os.environ['SLURM_JOB_ID']}, {env['HPCJOBS_EXPECT_WORLD_SIZE']} tasks on "
          f"{os.environ.get('SLURM_JOB_NUM_NODES', '?')} node(s), results in {env['HPCJOBS_JOB_DIR']}, "
          f"MASTER_ADDR={env['MASTER_ADDR']}:{env['MASTER_PORT']}\n# {shlex.join(cmd)}", flush=True)
    if args.requeue:
        return _run_and_requeue(cmd, env, args.requeue)
    os.execvpe(cmd[0], cmd, env)
