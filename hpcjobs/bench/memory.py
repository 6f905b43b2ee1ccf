"""Whether a benchmark's largest message fits in the memory of its hosts,
checked before anything is measured.

A sweep (:func:`hpcjobs.bench.sweep.run`: ``bench allreduce``, ``tune``,
``model``) holds, for each size, the buffer every row reduces, each of the
three input variants and each variant's expected result, and the
algorithms' scratch: about :data:`SWEEP_COPIES` times the message on every
rank (measured: 7.8x at 256 MiB with the default rows, 9.4-9.9x with
``--impl all --baselines all``, 2 ranks, 2026-11-29). Past the host's
memory the sweep ran until the kernel's out-of-memory killer ended a rank,
and on a shared node possibly someone else's process; now every rank
refuses it at once, saying how much it needs.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from mpi4py import MPI

from ..comm import by_value
from .inputs import VARIANTS

__all__ = ["SWEEP_COPIES", "available_bytes", "cgroup_room", "check_fits", "check_sweep_fits"]

SWEEP_COPIES = 1 + 2 * VARIANTS + 1  # the buffer, each variant's input and expected result, one copy of scratch


def available_bytes(meminfo: str = "/proc/meminfo", cgroups: str = "/proc/self/cgroup",
                    root: str = "/sys/fs/cgroup") -> int | None:
    """What this process may still take: the host's available memory
    (Linux's ``MemAvailable``: free memory and what the kernel can reclaim
    without swapping), or less where a memory cgroup limits it (a Slurm job's
    ``--mem``, a container): :func:`cgroup_room`. None where it cannot tell
    (another system, an old kernel)."""
    host = None
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    host = int(value) * (1 << 10 if unit == "kB" else 1)
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = cgroup_room(cgroups, root)
    return room if host is None else host if room is None else min(host, room)


def cgroup_room(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The memory left under the tightest memory cgroup limit on this process
    and its ancestors (v2: ``memory.max``; v1: ``memory.limit_in_bytes``):
    the limit less what the group holds, its page cache not counted (the
    kernel reclaims that before it kills). None where nothing limits it."""
    try:
        with open(cgroups) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2's unified hierarchy
            base, files = Path(root), ("memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):
            base, files = Path(root) / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        group = PurePosixPath(path or "/")
        for d in (group, *group.parents):
            room = _room(base / str(d).lstrip("/"), *files)
            if room is not None:
                best = room if best is None else min(best, room)
    return best


def _room(folder: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # no limit (v1 writes a number near 2^63)
            return None
        used = int((folder / usage_file).read_text())
        stat = dict(line.split()[:2] for line in (folder / "memory.stat").read_text().splitlines()
                    if len(line.split()) >= 2)
        cache = int(stat.get(cache_key, 0))
    except (OSError, ValueError):
        return None
    return max(0, int(limit) - max(0, used - cache))


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def check_fits(comm: MPI.Intracomm, per_rank_bytes: int, what: str, available: int | None = None) -> None:
    """Raise ValueError on every rank of ``comm`` where the ranks of some host
    need more than its available memory (:func:`available_bytes`, read by the
    host's first rank): ``per_rank_bytes`` each, times the ranks that share
    the host (MPI's shared-memory split). ``what`` says what needs it (the
    flag and its value). A host that cannot tell its memory refuses nothing.
    Collective. ``available``: this rank's figure instead of its host's (for
    tests: one rank alone short, as on a host of its own)."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ranks_here = local.Get_size()
        # one reading per host, its first rank's: ranks reading a moment apart could disagree
        read = local.bcast(available_bytes() if local.Get_rank() == 0 else None, root=0)
    finally:
        local.Free()
    available = read if available is None else available
    need = per_rank_bytes * ranks_here
    short = available is not None and need > available
    verdict = (f"{ranks_here} rank(s) here need about {_gib(need)} ({_gib(per_rank_bytes)} each), {_gib(available)} "
               "is available" if short else "fits" if available is not None else "cannot tell (no MemAvailable)")
    found = comm.allgather((short, verdict))
    if any(s for s, _ in found):
        raise ValueError(f"{what} does not fit in memory: " + by_value([v for _, v in found])
                         + "; lower it, or run fewer ranks per host")


def check_sweep_fits(comm: MPI.Intracomm, sizes: list[int], max_bytes: int, flag: str = "--max-bytes") -> None:
    """:func:`check_fits` for a sweep of ``sizes`` (bytes) asked for with ``flag max_bytes``."""
    from .sweep import format_bytes

    largest = max(sizes)
    check_fits(comm, SWEEP_COPIES * largest,
               f"{flag} {format_bytes(max_bytes)} (a sweep holds about {SWEEP_COPIES}x its largest message, "
               f"{format_bytes(largest)}, on each rank: the buffer, {VARIANTS} inputs and their {VARIANTS} expected "
               "results, scratch)")
