"""``hpcjobs slurm submit``: render a template (``slurm render``) and sbatch
it; prints the job id. Runs on a login node: no MPI.

    hpcjobs slurm submit train --nodes 2 --cpu -- --epochs 5
"""

from __future__ import annotations

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


def run(args) -> int:
    if shutil.which("sbatch") is None:
        raise UsageError("no sbatch on PATH: submit from a Slurm login node (or start scripts/local_slurm.sh)")
    text = slurm_render.script(args)
    if args.script:
        script = Path(args.script)
    else:
        base = Path("results/slurm")
        stem = Path(args.template).stem
        n = 1 + sum(1 for _ in base.glob(f"{stem}-*.sbatch"))
        script = base / f"{stem}-{n}.sbatch"
    check_outputs(None, [("--script", str(script), False)])
    write_text(script, text)
    script.chmod(0o755)
    cmd = ["sbatch", "--parsable", *(["--wait"] if args.wait else []), str(script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
