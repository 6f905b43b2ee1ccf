"""The tuning table: measure every allreduce algorithm that applies here
(:func:`applicable`) and write the table that ``algorithm="auto"`` reads
(format in :mod:`hpcjobs.collectives.auto`); ``hpcjobs tune`` runs it.

Run it once per machine or allocation shape, under the same launcher and
ranks as the jobs that will use it::

    mpirun -n 8 hpcjobs tune --out tuning.json
    export HPCJOBS_TUNING=$PWD/tuning.json

The file keeps one table per (ranks, nodes, ranks on each node); tuning
another shape adds its table and keeps the others. Across hosts the table
also records the network's sustained rate (``link_gbps``, one way, between
rank 0 and the next node's first rank), so a reader knows which link it
was tuned on.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from mpi4py import MPI

from .._files import atomic_write
from ..collectives import ALGORITHMS
from ..collectives.names import SHARED_MEMORY
from ..collectives.tuning import load_tuning
from .sweep import Record, implementations, median_records, run

__all__ = ["WrongResults", "applicable", "best_rows", "merge", "tune", "write"]


class WrongResults(RuntimeError):
    """A sweep counted wrong elements: no table is written from a broken run."""

# Keep the current row's algorithm while it is within this factor of a size's
# winner: near-ties (ring and Rabenseifner at 2 ranks are the same exchange)
# otherwise flip with timing noise and give a table that no rerun reproduces.
STICKY = 1.05


def _winners(records: list[Record]) -> tuple[dict[int, list[Record]], list[tuple[int, Record, Record]]]:
    by_size: dict[int, list[Record]] = {}
    for r in records:
        by_size.setdefault(r.size_bytes, []).append(r)
    winners = []
    for size in sorted(by_size):
        ranked = sorted(by_size[size], key=lambda r: r.time_us)
        winners.append((size, ranked[0], ranked[1] if len(ranked) > 1 else ranked[0]))
    return by_size, winners


def best_rows(*passes: list[Record]) -> list[dict]:
    """Collapse per-size winners into rows: each algorithm up to the largest
    size it won (or stayed within ``STICKY`` of the winner) before the next
    one took over; the last row is unbounded. With several passes of the
    same sweep, a size's times are the medians over the passes, and a row's
    contenders include what won nearby in any single pass."""
    by_size, winners = _winners(median_records(passes))
    near = [(size, best.impl) for records in passes for size, best, _ in _winners(records)[1]]
    rows: list[dict] = []
    for size, best, second in winners:
        if rows and rows[-1]["algorithm"] != best.impl:
            current = next((r for r in by_size[size] if r.impl == rows[-1]["algorithm"]), None)
            if current is not None and current.time_us <= STICKY * best.time_us:
                best, second = current, best
        if rows and rows[-1]["algorithm"] == best.impl:
            rows[-1]["max_bytes"] = size
            rows[-1]["measured"].append(_measure(size, best, second))
        else:
            rows.append({"max_bytes": size, "algorithm": best.impl, "measured": [_measure(size, best, second)]})
    if rows:
        rows[-1]["max_bytes"] = None
    for row in rows:
        row["candidates"] = _candidates(row, near)
    return rows


# auto times a row's candidates where it runs (hpcjobs.collectives.auto):
# the winner, the algorithms that won sizes near the row, then the runner-ups
# seen most often in it. Nearby winners come first because a crossover moves
# between runs here: in one run shm won 16 MB and lost 32-64 MB to the
# rings, and in the bench that followed it was 1.4x ahead at 32 and 64 MB.
MAX_CANDIDATES = 4
# "Near": sizes from a quarter of the row's smallest to 4x its largest.
NEAR = 4


def _candidates(row: dict, winners: list[tuple[int, str]]) -> list[str]:
    sizes = [m["size_bytes"] for m in row["measured"]]
    near = [name for size, name in winners if min(sizes) / NEAR <= size <= max(sizes) * NEAR]
    runner_ups = [m["runner_up"] for m in row["measured"]]
    names = [row["algorithm"]]
    for seen in (near, runner_ups):  # each by count; stable, so the first seen wins ties
        names += sorted(dict.fromkeys(n for n in seen if n not in names), key=lambda n: -seen.count(n))
    return names[:MAX_CANDIDATES]


def _measure(size: int, best: Record, second: Record) -> dict:
    return {"size_bytes": size, "time_us": round(best.time_us, 2),
            "runner_up": second.impl, "runner_up_ratio": round(second.time_us / best.time_us, 3)}


def _shape(t: dict) -> tuple:
    return t["ranks"], t["nodes"], tuple(t.get("local_sizes") or ()), t.get("layout") == "override"


def merge_problem(flag: str, path: str) -> str | None:
    """Why the file at ``path`` cannot take a table (:func:`merge`), or None."""
    if not os.path.isfile(path):  # read back for the merge after the sweep: a pipe's read waited for good
        return (f"{flag} {path} is not a regular file: tune adds its table to those already in the file, which a "
                "pipe or a device cannot give back; name a file")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return f"{flag} {path} exists and is not a tuning file to add to ({e}); move it or name another"
    if not isinstance(data, dict) or not isinstance(data.get("tables"), list):
        return f"{flag} {path} exists and is not a tuning file to add to (no list of 'tables'); move it or name another"
    if data["tables"]:  # its tables are kept beside the new one: checked as auto will read them
        try:
            load_tuning.__wrapped__(path)
        except ValueError as e:
            return f"{flag} {path} exists and is not a tuning file to add to ({e}); move it or name another"
    return None


def merge(path: str, table: dict, environment: dict) -> dict:
    """The tuning file at ``path`` with ``table`` added or replacing the one
    of the same ranks, nodes and ranks per node, simulated or real."""
    data = {"version": 1, "tables": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data["tables"] = [t for t in data.get("tables", []) if _shape(t) != _shape(table)] + [table]
    data["tables"].sort(key=_shape)
    key = f"{table['ranks']}x{table['nodes']}" + ("" if not table.get("local_sizes") else
                                                  "[" + ",".join(map(str, table["local_sizes"])) + "]")
    key += " simulated" if table.get("layout") == "override" else ""
    data.setdefault("environments", {})[key] = environment
    return data


def applicable(shared_memory: bool, nodes: int) -> tuple[list[str], list[str]]:
    """The algorithms worth timing here, and why the others are not.

    On one node the hierarchical algorithm is its intra-node stage alone (the
    ring, plus finding the topology): timing it again would only give a
    row's contender slot to a copy of the ring (in one tune here it took the
    last row's fourth slot from the pipelined ring, the best message-passing
    algorithm at 64 MB in every run). shm needs every rank on one shared-memory
    node; across nodes, simulated ones on one host too, ``auto`` runs
    hierarchical and recursive doubling in place of shm and oneshot, so a
    table that named them there would record winners it never runs."""
    names, left_out = [], []
    for name in ALGORITHMS:
        if name in SHARED_MEMORY and not shared_memory:
            left_out.append(f"{name}: the ranks do not share one node's memory")
        elif name in SHARED_MEMORY and nodes > 1:
            left_out.append(f"{name}: across nodes (simulated ones too) auto runs hierarchical or "
                            "recursive_doubling in its place")
        elif name == "hierarchical" and nodes == 1:
            left_out.append("hierarchical: on one node it is its intra-node stage, the ring")
        else:
            names.append(name)
    return names, left_out


def tune(comm: MPI.Intracomm, sizes: list[int], names: list[str], passes: int, iters: int | None = None,
         nodes: int = 1, on_record: Callable[[Record], None] | None = None, topology=None,
         link_gbps: float | None = None) -> dict:
    """Measure ``names`` over ``sizes``, ``passes`` times, and return the
    table for this many ranks and ``nodes`` (collective). With ``topology``
    the table records the ranks on each node (``local_sizes``, which auto
    matches) and where the layout came from; ``link_gbps``: the network's
    sustained one-way rate, measured by the caller.

    Raises:
        WrongResults: a wrong result in any pass, on every rank alike (the
            counts are summed over ranks).
    """
    runs = [run(comm, sizes, implementations(names), iters=iters, on_record=on_record, pass_index=p)
            for p in range(passes)]
    wrong = sum(r.wrong for records in runs for r in records)
    if wrong:
        raise WrongResults(f"{wrong} wrong elements: not writing a tuning table from a broken run")
    table = {"ranks": comm.Get_size(), "nodes": nodes, "passes": passes}
    if topology is not None:
        table.update(local_sizes=list(topology.local_sizes), layout=topology.source)
    if link_gbps is not None:
        table["link_gbps"] = round(link_gbps, 3)
    return {**table, "rows": above_measured(best_rows(*runs), table)}


def above_measured(rows: list[dict], table: dict) -> list[dict]:
    """``rows`` (:func:`best_rows`) ending at the largest size measured, then
    the built-in table's rows above it (``"measured": []``, as ``auto``
    would choose without a file): a sweep to 64 KB had its last row open
    to every size, so ``auto`` ran 64 KB's winner (oneshot) on 16 MB, where
    the built-in table runs shm (7.8 against 5.0 ms, once, at 3 ranks here)."""
    from ..collectives.tuning import DEFAULT_TABLE, _pick_table

    if not rows:
        return rows
    largest = rows[-1]["measured"][-1]["size_bytes"]
    builtin = _pick_table(DEFAULT_TABLE, table["ranks"], table["nodes"], tuple(table.get("local_sizes") or ()) or None,
                          table.get("layout") == "override")["rows"]
    beyond = [{**r, "measured": []} for r in builtin if r["max_bytes"] is None or r["max_bytes"] > largest]
    return [*rows[:-1], {**rows[-1], "max_bytes": largest}, *beyond]


def write(path: str, table: dict, environment: dict) -> None:
    """Add ``table`` to the tuning file at ``path`` (:func:`merge`), atomically."""
    data = merge(path, table, environment)
    with atomic_write(path) as f:
        json.dump(data, f, indent=1)
        f.write("\n")
