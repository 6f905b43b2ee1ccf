"""Whether a benchmark's largest message fits in the memory of its hosts,
checked before anything is measured.

A sweep (:func:`hpcjobs.bench.sweep.run`: ``bench allreduce``, ``tune``,
``model``) holds, for each size, the buffer every row reduces, each of the
three input variants and each variant's expected result, and the
algorithms' scratch: about :data:`SWEEP_COPIES` times the message on every
rank (measured: 7.8x at 256 MiB with the default rows, 9.8-10.8x with
``--impl all --baselines all``, 2 ranks, 2026-11-29). Past the host's
memory the sweep ran until the kernel's out-of-memory killer ended a rank,
and on a shared node possibly someone else's process; now every rank
refuses it at once, saying how much it needs.
"""

from __future__ import annotations

from mpi4py import MPI

from ..comm import by_value
from .inputs import VARIANTS

__all__ = ["SWEEP_COPIES", "available_bytes", "check_fits", "check_sweep_fits"]

SWEEP_COPIES = 1 + 2 * VARIANTS + 1  # the buffer, each variant's input and expected result, one copy of scratch


def available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """This host's available memory (Linux's ``MemAvailable``: free memory and
    what the kernel can reclaim without swapping), or None where it cannot
    tell (another system, an old kernel)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * {"kB": 1 << 10, "mB": 1 << 20}.get(unit, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def check_fits(comm: MPI.Intracomm, per_rank_bytes: int, what: str, available: int | None = None) -> None:
    """Raise ValueError on every rank of ``comm`` where the ranks of some host
    need more than its available memory: ``per_rank_bytes`` each, times the
    ranks that share the host (MPI's shared-memory split). ``what`` says what
    needs it (the flag and its value). A host that cannot tell its memory
    refuses nothing. Collective. ``available``: this host's bytes, for tests."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ranks_here = local.Get_size()
    finally:
        local.Free()
    if available is None:
        available = available_bytes()
    problem = None
    need = per_rank_bytes * ranks_here
    if available is not None and need > available:
        problem = (f"{ranks_here} rank(s) here need about {_gib(need)} ({_gib(per_rank_bytes)} each), "
                   f"{_gib(available)} is available")
    problems = comm.allgather(problem)
    if any(problems):
        raise ValueError(f"{what} does not fit in memory: "
                         + by_value([p or "fits" for p in problems])
                         + "; lower it, or run fewer ranks per host")


def check_sweep_fits(comm: MPI.Intracomm, sizes: list[int], flag: str = "--max-bytes") -> None:
    """:func:`check_fits` for a sweep whose largest message is ``max(sizes)`` bytes."""
    from .sweep import format_bytes

    largest = max(sizes)
    check_fits(comm, SWEEP_COPIES * largest,
               f"{flag} {format_bytes(largest)} (a sweep holds about {SWEEP_COPIES}x its largest message on each "
               f"rank: the buffer, {VARIANTS} inputs and their {VARIANTS} expected results, scratch)")
