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

from pathlib import Path

from mpi4py import MPI

from ..comm import by_value
from ..runtime import cgroup_hierarchies
from .inputs import VARIANTS

__all__ = ["COMPRESSION_BYTES_PER_ELEMENT", "SOAK_BYTES_PER_ELEMENT", "SWEEP_COPIES", "available_bytes",
           "cgroup_room", "check_fits", "check_sweep_fits"]

SWEEP_COPIES = 1 + 2 * VARIANTS + 1  # the buffer, each variant's input and expected result, one copy of scratch
# bench compression: the gradient, its copies, payloads and residuals, about 8x its fp32 bytes (50M elements, 2 ranks)
COMPRESSION_BYTES_PER_ELEMENT = 8 * 4
# soak: the values, the exact result in a wide type and MPI's, the buffer, the scratch kept for --max-count: peak RSS
# less the process's, 2 ranks, 36 measured (300 ops to 20M elements) and 40-41 (1,500 to 4M); 48 leaves some room
SOAK_BYTES_PER_ELEMENT = 48


def available_bytes(meminfo: str = "/proc/meminfo", proc: str = "/proc/self") -> int | None:
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
    return min((v for v in (host, cgroup_room(proc)) if v is not None), default=None)


def cgroup_room(proc: str = "/proc/self") -> int | None:
    """The memory left under the tightest memory cgroup limit on the process
    ``proc`` names and its ancestors (v2: ``memory.max``; v1:
    ``memory.limit_in_bytes``), in each hierarchy where it is mounted
    (:func:`hpcjobs.runtime.cgroup_hierarchies`): the limit less what the
    group holds, its page cache not counted (the kernel reclaims that before
    it kills). None where nothing limits it."""
    best = None
    for v2, folders in cgroup_hierarchies("memory", proc):
        for folder in folders:
            room = _room(folder, not v2)
            if room is not None:
                best = room if best is None else min(best, room)
            if not v2 and _read(folder / "memory.use_hierarchy") == "0":  # the parents' limits do not bind it
                break
    return best


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _room(folder: Path, v1: bool) -> int | None:
    """The room under ``folder``'s limit: the limit less what the group holds
    but its reclaimable page cache (shared memory, tmpfs included in the
    cache, is not reclaimable); the limit itself where use or cache cannot
    be read (an upper bound: never a refusal it did not earn). None: no limit."""
    limit = _read(folder / ("memory.limit_in_bytes" if v1 else "memory.max"))
    try:
        limit = int(limit)
    except (TypeError, ValueError):  # absent, unreadable, or v2's "max"
        return None
    if limit >= 1 << 60:  # v1's "no limit", a number near 2^63
        return None
    try:
        used = int(_read(folder / ("memory.usage_in_bytes" if v1 else "memory.current")))
        stat = dict(line.split()[:2] for line in (_read(folder / "memory.stat") or "").splitlines()
                    if len(line.split()) >= 2)
        if v1:
            cache = int(stat.get("total_cache", stat.get("cache"))) - int(stat.get("total_shmem", stat.get("shmem", 0)))
        else:
            cache = int(stat["file"]) - int(stat.get("shmem", 0))
    except (TypeError, ValueError, KeyError):
        return limit
    return max(0, limit - max(0, used - max(0, cache)))


def _host_bytes() -> int | None:
    try:
        return available_bytes()
    except Exception:  # whatever it is, the host's other ranks wait for this one in the bcast
        return None


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
        read = local.bcast(_host_bytes() if local.Get_rank() == 0 else None, root=0)
    finally:
        local.Free()
    available = read if available is None else available
    need = per_rank_bytes * ranks_here
    short = available is not None and need > available
    if short:
        verdict = f"{ranks_here} rank(s) here need about {_gib(need)} ({_gib(per_rank_bytes)} each), " \
                  f"{_gib(available)} is available"
    else:
        verdict = "fits" if available is not None else "cannot tell (no MemAvailable)"
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
