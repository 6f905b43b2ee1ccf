"""One-line verdicts on a sweep's records: what ``auto`` kept, how far it
ran from the best of our algorithms, and how ``auto`` did against each
baseline (``hpcjobs bench allreduce`` prints them after each pass)."""

from __future__ import annotations

import dataclasses

from typing import Iterable

from ..collectives import ALGORITHMS, DEVICE_ALGORITHMS
from ..collectives import auto as auto_
from .sweep import Record, format_bytes

__all__ = ["kept_summary", "auto_against_best", "ours_against"]


def kept_summary(records: list[Record], label: str, dtype: str, op: str, comm, device: bool = False) -> str:
    """What ``auto`` ran in its timed calls, per run of sizes, e.g.
    "8-16K recursive_doubling, 32K-64M shm" (``device``: on CUDA tensors,
    "8-32K staged, 64K-256M cuda_ipc")."""
    runs: list[list] = []  # [first size, last size, algorithm]
    for r in records:
        if r.impl == label:
            name = auto_.kept(r.size_bytes, dtype, op, comm, device) or "?"
            if runs and runs[-1][2] == name:
                runs[-1][1] = r.size_bytes
            else:
                runs.append([r.size_bytes, r.size_bytes, name])
    return ", ".join(f"{format_bytes(lo)}{'' if lo == hi else '-' + format_bytes(hi)} {name}"
                     for lo, hi, name in runs)


def _times_by_size(records: list[Record]) -> dict[int, dict[str, float]]:
    """size -> label -> time (µs), sizes in ascending order; a row with a
    wrong result at a size is left out there (fast and wrong is no best)."""
    by_size: dict[int, dict[str, float]] = {}
    for r in sorted(records, key=lambda r: r.size_bytes):
        if not r.wrong:
            by_size.setdefault(r.size_bytes, {})[r.impl] = r.time_us
    return by_size


def _algorithm_rows(times: dict[str, float]) -> dict[str, float]:
    """The rows of our algorithms (a pipelined ring and hierarchical per
    segment size too; not auto, not a +check row)."""
    return {k: v for k, v in times.items()
            if k in ALGORITHMS or k in DEVICE_ALGORITHMS or k.startswith(("ring_pipelined/", "hierarchical/"))}


def auto_against_best(records: list[Record], within: float = 1.10) -> str | None:
    """How far ``auto``'s time is from the fastest of our other algorithms
    in the table, size by size, e.g. "within 10% at 23 of 24 sizes; worst
    1.13x at 32K (recursive_doubling)". None without two of ours beside it."""
    ratios = []
    for size, times in _times_by_size(records).items():
        ours = _algorithm_rows(times)
        if "auto" in times and len(ours) >= 2:
            best = min(ours, key=ours.get)
            ratios.append((times["auto"] / ours[best], size, best))
    if not ratios:
        return None
    ratio, size, best = max(ratios)
    ok = sum(r <= within for r, _, _ in ratios)
    return (f"within {round((within - 1) * 100)}% at {ok} of {len(ratios)} sizes; "
            f"worst {ratio:.2f}x at {format_bytes(size)} ({best})")


def drift_corrected(records: list[Record], baseline: str) -> list[Record] | None:
    """``records`` with the late ``baseline``'s times divided by its anchor's
    drift (its pass ran when MPI_Allreduce took that many times its first
    pass's), or None where the baseline has no anchor."""
    if not any(r.impl == baseline and r.anchor_drift for r in records):
        return None
    return [dataclasses.replace(r, time_us=r.time_us / r.anchor_drift) if r.impl == baseline and r.anchor_drift
            else r for r in records]


def ours_against(records: list[Record], baseline: str, at: Iterable[int] = (8, 4 << 10, 1 << 20, 16 << 20, 64 << 20),
                 within: float = 1.10) -> tuple[str, str] | None:
    """The one-line verdict against ``baseline``, as ``(who, line)``: who
    is ``auto`` where the table has it (the call a user makes), else "our
    best" (the fastest of our rows at each size, picked after the fact: of
    several rows as fast as the baseline, the luckiest median wins, so it
    leans our way); line is the baseline's time over ours (above 1: we are faster)
    at the sizes ``at`` that the table has, and at how many sizes we are
    faster, slower and within ``within`` of it, e.g. "0.45x at 8, 1.21x at
    1M, 3.04x at 64M; faster at 12, slower at 6, within 10% at 6 of 24
    sizes". None when the table has no such row."""
    ratios, picked = [], set()
    auto_ran = any(r.impl == "auto" for r in records)
    for size, times in _times_by_size(records).items():
        if auto_ran and "auto" not in times:  # auto wrong here (said, and the run fails): no pick in its stead
            continue
        ours = {"auto": times["auto"]} if "auto" in times else _algorithm_rows(times)
        if baseline in times and ours:
            picked.add("auto" if "auto" in ours else "best" if len(ours) > 1 else next(iter(ours)))
            ratios.append((size, times[baseline] / min(ours.values())))
    if not ratios:
        return None
    at = set(at)
    shown = [(s, x) for s, x in ratios if s in at] or list(dict.fromkeys([ratios[0], ratios[-1]]))  # once if one
    faster, slower = sum(x > within for _, x in ratios), sum(x * within < 1 for _, x in ratios)
    who = picked.pop() if len(picked) == 1 else "best"
    return ("our best" if who == "best" else who,
            ", ".join(f"{x:.2f}x at {format_bytes(s)}" for s, x in shown)
            + f"; faster at {faster}, slower at {slower}, within {round((within - 1) * 100)}% at "
            f"{len(ratios) - faster - slower} of {len(ratios)} sizes")
