"""``hpcjobs slurm launch``: inside a job script, start the ranks with srun
or mpirun (:func:`hpcjobs.slurm.launch_command`). Runs on the batch host
before any rank: no MPI.

    hpcjobs slurm launch -- bench allreduce --out {job_dir}/report
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from .args import UsageError, usage


def configure(p) -> None:
    p.epilog = "After --: the hpcjobs command every rank runs; {job_dir} in it becomes the job's results directory"


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
    os.execvpe(cmd[0], cmd, env)
