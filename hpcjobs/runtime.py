"""The process a rank runs in: its GPU, its cores, and the session folders
killed launches leave behind.

This module imports neither MPI nor torch at import time: :func:`bind_gpu`
must run before torch first looks at CUDA, and the scripts clear stale
session folders before any MPI starts (``python -m hpcjobs.runtime``).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
from fractions import Fraction
from pathlib import Path

__all__ = ["bind_gpu", "pick_device", "autocast", "out_of_memory", "cores_per_rank", "cpu_share", "cpu_limit",
           "cgroup_hierarchies", "set_threads", "clear_stale_mpi_sessions"]

DEVICES = ("auto", "cpu", "cuda")


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


def pick_device(choice: str, comm):
    """The ``torch.device`` this rank trains on, and make it current.

    ``auto``: this rank's GPU when every rank of ``comm`` sees one, else the
    CPU; ``cuda``: this rank's GPU, or ValueError on every rank when some
    rank sees none. This rank's GPU is its local index on the node modulo
    the GPUs it sees (one when ``HPCJOBS_BIND_GPU=1`` or the Slurm templates
    bound it; ranks share GPUs when there are more ranks than GPUs).
    Collective over ``comm``.
    """
    import torch
    from mpi4py import MPI

    if choice not in DEVICES:
        raise ValueError(f"unknown device {choice!r}; choose from {', '.join(DEVICES)}")
    gpus = torch.cuda.device_count() if choice != "cpu" and torch.cuda.is_available() else 0
    everyone = comm.allreduce(int(gpus > 0), op=MPI.MIN) == 1
    if choice == "cpu" or (choice == "auto" and not everyone):
        return torch.device("cpu")
    if not everyone:
        raise ValueError("--device cuda: " + ("no CUDA GPU is visible to this rank (torch.cuda.is_available() "
                                              "is False)" if not gpus else "another rank sees no CUDA GPU"))
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_rank()
    node.Free()
    device = torch.device("cuda", local % gpus)
    torch.cuda.set_device(device)
    return device


def autocast(amp: str, device):
    """Mixed precision for a forward pass on ``device`` (a ``torch.device``):
    ``amp`` "bf16" or "fp16" autocasts to that type, "none" does nothing."""
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16,
                          enabled=amp != "none")


def out_of_memory(error: BaseException, comm, device, doing: str, advice: str, end_job: bool = True) -> MemoryError:
    """A CUDA out-of-memory ``error`` on this rank, in a user's words: "out
    of GPU memory on rank R (DEVICE) <doing>: <advice> (<torch's first
    line>)". With ``end_job`` and several ranks it is printed and the job
    ends on every rank (the others would wait in the next collective for a
    rank that is gone); otherwise the MemoryError is returned, to raise."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    message = f"out of GPU memory on rank {comm.Get_rank()} ({device}) {doing}: {advice} ({first})"
    if end_job and comm.Get_size() > 1:
        print(f"hpcjobs: {message}; ending the job", file=sys.stderr, flush=True)
        comm.Abort(1)
    return MemoryError(message)


def _kernel_id() -> str | None:
    """This boot of this machine's kernel: the same in every network, UTS or
    container namespace on it (emulated hosts, containers), different on
    another machine. None where it cannot be read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _own_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity; all of them where it cannot be read)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_limit(proc: str = "/proc/self") -> tuple[tuple, float] | None:
    """This process's cgroup CPU limit (a container's ``--cpus``, a
    Kubernetes limit, a systemd CPUQuota), which its affinity does not show:
    (the limiting cgroup's identity, the CPUs it gives: quota / period), the
    smallest over the cgroup and its parents in either hierarchy (v2's
    ``cpu.max``, v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``). None
    where nothing limits it or it cannot be read."""
    best = None
    for v2, folders in cgroup_hierarchies("cpu", proc):
        for folder in folders:
            cpus = _quota(folder, v2)
            if cpus is not None and (best is None or cpus < best[1]):
                st = os.stat(folder)
                best = ((st.st_dev, st.st_ino), cpus)
    return best


def cgroup_hierarchies(controller: str, proc: str = "/proc/self"):
    """The cgroup folders whose limits bind the process ``proc`` names, for
    ``controller`` ("cpu", "memory"): yields (v2, folders) for each mounted
    hierarchy that may carry it -- v2's unified one, v1's that names it --
    the folders from the process's own cgroup up to the mount's top. Found
    from ``proc``'s cgroup and mountinfo files, so a hierarchy is read where
    it is mounted (v2 under ``/sys/fs/cgroup/unified`` beside v1's, a
    container's own cgroup as its mount's root). Yields nothing where they
    cannot be read."""
    try:
        groups = [line.split(":", 2) for line in Path(proc, "cgroup").read_text().splitlines()]
        mounts = [line.split() for line in Path(proc, "mountinfo").read_text().splitlines()]
    except OSError:
        return
    for fields in mounts:  # id parent dev root mountpoint options... - fstype source superoptions
        if "-" not in fields or len(fields) < 5:
            continue
        tail = fields[fields.index("-") + 1:]
        v2 = tail[:1] == ["cgroup2"]
        if not (v2 or (tail[:1] == ["cgroup"] and len(tail) > 2 and controller in tail[2].split(","))):
            continue
        path = next((g[2] for g in groups if len(g) == 3 and (g[1] == "" if v2 else controller in g[1].split(","))),
                    None)
        root = _unescape(fields[3]).rstrip("/")
        if path is None or not (path + "/").startswith(root + "/"):
            continue  # the process's cgroup is outside what this mount shows
        top = Path(_unescape(fields[4]))
        here = top / path[len(root):].lstrip("/")
        folders = [here]
        while here != top:
            here = here.parent
            folders.append(here)
        yield v2, folders


def _unescape(field: str) -> str:
    """A mountinfo path as it is (the kernel writes space, tab, newline and backslash as octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _quota(folder: Path, v2: bool) -> float | None:
    """The CPUs a cgroup's own quota gives (None: unlimited or unreadable)."""
    try:
        if v2:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        else:
            quota, period = ((folder / f"cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period"))
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def cores_per_rank(comm) -> int:
    """Cores this rank may use: its share of the CPUs it may run on, each CPU
    divided among the ranks of ``comm`` on this machine that may run on it
    (their affinities: a launcher's binding, a container's cpuset) --
    :func:`cpu_share`. Unbound ranks divide the machine's CPUs; ranks bound
    to cores of their own get those.
    Ranks are on the same machine when they run on the same kernel, so hosts
    emulated in namespaces, or containers, that share one machine's cores share
    them here too; where the kernel's boot id cannot be read, MPI's
    shared-memory node stands for the machine. A cgroup's CPU limit
    (:func:`cpu_limit`: a container's ``--cpus``) caps it at the limit's
    CPUs divided among the ranks under that limit, rounded down. At least 1.
    Collective over ``comm``."""
    from mpi4py import MPI  # comm exists, so MPI is up already

    mine, limit = _own_cpus(), cpu_limit()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leader = node.allreduce(comm.Get_rank(), op=MPI.MIN)
    node.Free()
    machine = _kernel_id() or f"shared-memory node of rank {leader}"
    everyone = comm.allgather((machine, mine, limit and limit[0]))
    share = cpu_share(mine, [cpus_ for key, cpus_, _ in everyone if key == machine])
    if limit is not None:  # the ranks under the same limit share its CPUs
        under = sum(1 for key, _, cgroup in everyone if key == machine and cgroup == limit[0])
        share = min(share, max(1, int(limit[1] / under)))
    return share


def cpu_share(mine, together) -> int:
    """Threads for a rank allowed on CPUs ``mine``, beside ranks allowed on
    ``together`` (each one's CPUs, this rank's among them): the sum over its
    CPUs of 1 / the ranks allowed on each, rounded down, at least 1. Ranks on
    {0, 1}, {0, 1} and {2, ..., 7} get 1, 1 and 6 (an even split of the 8,
    2 each, would have put 4 threads on cores 0 and 1 and left 4 idle)."""
    sharing: dict[int, int] = {}
    for cpus_ in together:
        for c in cpus_:
            sharing[c] = sharing.get(c, 0) + 1
    share = sum(Fraction(1, sharing[c]) for c in mine)
    return max(1, math.floor(share))


def set_threads(threads: int | None, comm) -> int:
    """Give torch ``threads`` threads in this rank (None: :func:`cores_per_rank`);
    returns how many. Collective over ``comm`` where it is not None.

    ``comm`` None: a process alone (``plan --measure``), whose own cores
    (its affinity, capped by its cgroup's CPU limit) are its default.

    Also flushes denormal floats to zero on the CPU (as TensorFlow does), before
    torch starts its threads so that they inherit the setting. Numbers that sink
    into the denormal range, as in a model that has stopped learning, otherwise make
    each step slower as training goes on: 4x by the 4th epoch of an MLP at batch 8 here, while
    ``plan --measure`` times fresh weights (docs/results/planner.md)."""
    import torch

    torch.set_flush_denormal(True)  # False where the CPU cannot: nothing to do then
    if threads:
        n = threads
    elif comm is None:
        limit = cpu_limit()
        n = len(_own_cpus()) if limit is None else max(1, min(len(_own_cpus()), int(limit[1])))
    else:
        n = cores_per_rank(comm)
    torch.set_num_threads(n)
    return n


def clear_stale_mpi_sessions(tmpdir: str | None = None) -> list[Path]:
    """Remove this user's Open MPI session folders whose ``mpirun`` is gone;
    return them.

    Open MPI 5's mpirun keeps its session in ``$TMPDIR/ompi.<its pid>`` and
    removes it when it exits, but not when it is killed (scancel, a time
    limit, the OOM killer). A later mpirun on that node that is given the
    same pid finds the old rendezvous file and stops with "The PMIx server's
    listener thread failed to start". A folder whose pid is alive is left
    alone: a folder of ours can only belong to a live mpirun of ours. The
    scripts (``scripts/lib.sh``) and ``hpcjobs slurm launch`` call this."""
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


if __name__ == "__main__":  # scripts/lib.sh: clean_stale_mpi_sessions
    clear_stale_mpi_sessions()
