"""``hpcjobs slurm submit``: render a template (``slurm render``) and sbatch
it; prints the job id. Runs on a login node: no MPI.

    hpcjobs slurm submit train --nodes 2 --cpu -- --epochs 5
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .._files import write_text
from . import slurm_render
from .args import UsageError, check_outputs


def configure(p) -> None:
    slurm_render.configure(p)
    p.add_argument("--script", metavar="PATH", help="where to write the job script "
                   "(default: results/slurm/<template>-<n>.sbatch)")
    p.add_argument("--wait", action="store_true", help="sbatch --wait: return when the job ends, with its exit code")


def default_script(template: str, base: Path = Path("results/slurm")) -> Path:
    """``base``/<template>-<n>.sbatch, n one past the highest there: counting
    them wrote over the last one where an earlier one had been removed."""
    stem = Path(template).stem
    numbered = (re.fullmatch(rf"{re.escape(stem)}-(\d+)\.sbatch", p.name) for p in base.glob(f"{stem}-*.sbatch"))
    return base / f"{stem}-{max((int(m.group(1)) for m in numbered if m), default=0) + 1}.sbatch"


# render's flags and the #SBATCH options each sets (ranks and GPUs per node set each other)
_SETS = {"nodes": ("nodes",), "ntasks_per_node": ("ntasks-per-node", "gpus-per-node"),
         "gpus_per_node": ("gpus-per-node", "ntasks-per-node"), "gpu_type": ("gpus-per-node",),
         "cpus_per_task": ("cpus-per-task",), "time": ("time",), "job_name": ("job-name",),
         "partition": ("partition",), "account": ("account",), "qos": ("qos",), "constraint": ("constraint",),
         "mem": ("mem",), "exclusive": ("exclusive",)}


def sbatch_env(args) -> dict:
    """sbatch's environment: this one, less the GPU requests of slurm_render.GPU_VARIABLES
    in CPU mode (``--cpu`` or ``--gpus-per-node 0``), which would otherwise
    give the job GPUs its script does not ask for."""
    env = dict(os.environ)
    if args.cpu or args.gpus_per_node == 0:
        for var in slurm_render.GPU_VARIABLES:
            env.pop(var, None)
    return env


def sbatch_command(args, text: str, script) -> list[str]:
    """sbatch with each option the user gave on its command line too, as
    rendered: sbatch takes its SBATCH_* environment variables over a
    script's #SBATCH lines (SBATCH_PARTITION over --partition, SBATCH_TIMELIMIT
    over --time), and its command line over both."""
    keys = [k for flag, ks in _SETS.items() if slurm_render.given(getattr(args, flag, None)) for k in ks]
    lines = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", text, re.M))
    given = [f"--{k}" + (f"={lines[k]}" if lines[k] else "") for k in dict.fromkeys(keys) if k in lines]
    return ["sbatch", "--parsable", *(["--wait"] if args.wait else []), *given, str(script)]


def run(args) -> int:
    if shutil.which("sbatch") is None:
        raise UsageError("no sbatch on PATH: submit from a Slurm login node (or start scripts/local_slurm.sh)")
    text = slurm_render.script(args)
    script = Path(args.script) if args.script else default_script(args.template)
    check_outputs(None, [("--script", str(script), False)])
    write_text(script, text)
    script.chmod(0o755)
    cmd = sbatch_command(args, text, script)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=sbatch_env(args))
    # The id as soon as sbatch prints it: with --wait sbatch returns only when the job ends, and an id seen
    # only then could not be given to squeue or scancel meanwhile.
    job_id = proc.stdout.readline().strip().split(";")[0]
    if job_id:
        print(job_id, flush=True)
        print(f"# submitted {script} as job {job_id}" + (", waiting for it to end" if args.wait else ""),
              file=sys.stderr, flush=True)
    _, err = proc.communicate()
    if proc.returncode != 0:
        print(f"hpcjobs slurm submit: sbatch exited {proc.returncode}: {err.strip()}", file=sys.stderr)
    return proc.returncode
