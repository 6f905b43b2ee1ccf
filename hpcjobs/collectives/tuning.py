"""Tuning tables for ``algorithm="auto"``: the built-in one, reading a
file, and picking the table for a shape (format and rules:
:mod:`hpcjobs.collectives.auto`)."""

from __future__ import annotations

import functools
import json
import sys

from .names import ALGORITHMS

__all__ = ["DEFAULT_TABLE", "load_tuning"]

# Used when no tuning file exists: from `hpcjobs tune` at 2 ranks on the CI
# machine (docs/results/allreduce.md, "The tuning table"), generalised: the
# latency-optimal algorithm for small messages, shared memory on one node for
# large ones, and the two-level algorithm across nodes.
# The candidates are the algorithms that won or came second in that range
# across several `hpcjobs tune` runs here, in the host's calm and busy spells.
DEFAULT_TABLE = {
    "version": 1,
    "tables": [
        {"ranks": 2, "nodes": 1, "rows": [
            # oneshot: 9.1-10.7 us against recursive doubling's 13.2-21.4 at 8 B-4 KB
            # here, and 1.6-1.8x faster than it at 4-16 ranks on a 16-core node
            # (docs/results/allreduce.md, "Small messages: oneshot").
            {"max_bytes": 16 << 10, "algorithm": "oneshot",
             "candidates": ["oneshot", "recursive_doubling", "parameter_server"]},
            # Where latency gives way to bandwidth. At 32 KB on the 16-core node
            # oneshot took 50-101 us where shm took 84-187.
            {"max_bytes": 64 << 10, "algorithm": "oneshot",
             "candidates": ["oneshot", "shm", "recursive_doubling"]},
            {"max_bytes": 4 << 20, "algorithm": "shm", "candidates": ["shm", "ring", "rabenseifner"]},
            {"max_bytes": None, "algorithm": "shm", "candidates": ["shm", "ring_pipelined", "rabenseifner"]}]},
        {"ranks": 16, "nodes": 2, "rows": [
            {"max_bytes": 16 << 10, "algorithm": "recursive_doubling",
             "candidates": ["recursive_doubling", "tree"]},
            # Rabenseifner, halving near first, sends hierarchical's bytes across in
            # log rounds: `hpcjobs tune` across 2 emulated hosts x 2 ranks chose it
            # from 64 KB at 1 Gbit/s (hierarchical 0.98-1.09x its time at 1-16 MB)
            # and from 256 KB at 200 Mbit/s (a tie, 0.995-1.02x). Kept second: the
            # layouts this row stands for (8 ranks a node) cannot be measured here.
            {"max_bytes": None, "algorithm": "hierarchical",
             "candidates": ["hierarchical", "rabenseifner", "ring_pipelined"]}]},
    ],
}


@functools.lru_cache(maxsize=4)
def load_tuning(path: str | None) -> dict:
    """Read and check a tuning file; None gives :data:`DEFAULT_TABLE`.

    Raises:
        ValueError: the file is missing, not JSON, or names an unknown algorithm.
    """
    if path is None:
        return DEFAULT_TABLE
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read tuning table {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"tuning table {path} is not JSON: {e}") from None
    tables = data.get("tables") if isinstance(data, dict) else None
    if not tables or not isinstance(tables, list):
        raise ValueError(f"tuning table {path} has no 'tables'")
    for t in tables:
        # every field the lookups read, checked here: a hand-edited table failed later, inside a collective
        if not isinstance(t, dict) or not isinstance(t.get("ranks"), int) or not isinstance(t.get("nodes"), int):
            raise ValueError(f"tuning table {path}: each table needs integer 'ranks' and 'nodes'")
        layout = t.get("local_sizes")
        if layout is not None and not (isinstance(layout, list) and all(isinstance(n, int) for n in layout)):
            raise ValueError(f"tuning table {path}: 'local_sizes' must be a list of integers, got {layout!r}")
        if "layout" in t and not isinstance(t["layout"], str):
            raise ValueError(f"tuning table {path}: 'layout' must be a string, got {t['layout']!r}")
        rows = t.get("rows")
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"tuning table {path}: each table needs 'rows'")
        bounds = [r.get("max_bytes") for r in rows]
        if bounds[-1] is not None:
            raise ValueError(f"tuning table {path}: each table's last row needs max_bytes null (no upper bound)")
        if (not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds[:-1])
                or bounds[:-1] != sorted(set(bounds[:-1]))):
            raise ValueError(f"tuning table {path}: max_bytes must be integers, increasing row by row, {bounds}")
        for row in rows:
            candidates = row.get("candidates", [])
            if not isinstance(candidates, list):
                raise ValueError(f"tuning table {path}: 'candidates' must be a list, got {candidates!r}")
            measured = row.get("measured", [])
            if not isinstance(measured, list) or not all(isinstance(m, dict) for m in measured):
                raise ValueError(f"tuning table {path}: 'measured' must be a list of objects, got {measured!r}")
            for name in [row.get("algorithm"), *candidates]:
                if name not in ALGORITHMS:
                    raise ValueError(f"tuning table {path}: unknown algorithm {name!r}")
    return data


def _pick_table(data: dict, ranks: int, nodes: int, local_sizes: tuple | None = None,
                simulated: bool | None = None) -> dict:
    """The table for this shape: the same nodes first, then the same ranks
    on each node (``local_sizes``) on the same kind of nodes (``simulated``:
    nodes simulated on one host with --ranks-per-node, whose tables were
    tuned where every step shares the same cores), then the nearest ranks. A
    table without a layout, from an older ``hpcjobs tune``, comes after one
    that matches and before one that does not."""
    def distance(t):
        layout = t.get("local_sizes")
        if local_sizes is None or layout is None:
            fit = 1
        elif tuple(layout) != tuple(local_sizes):
            fit = 3
        elif simulated is not None and "layout" in t and (t["layout"] == "override") != simulated:
            fit = 2
        else:
            fit = 0
        return (t["nodes"] != nodes, abs(t["nodes"] - nodes), fit, abs(t["ranks"] - ranks))

    return min(data["tables"], key=distance)


_warned: set = set()


def warn_other_layout(path: str | None, data: dict, ranks: int, nodes: int, local_sizes: tuple,
                      simulated: bool) -> None:
    """Say once, on stderr, where the tuning file ``path`` has no table for
    this layout and ``auto`` follows the nearest one (tuned for other ranks
    or nodes, or on nodes simulated on one host for real ones or the other
    way round: its choices may be wrong here). The built-in table says
    nothing: no one chose it for this layout."""
    table = _pick_table(data, ranks, nodes, local_sizes, simulated)
    tuned = table.get("local_sizes")
    same_shape = (table["ranks"] == ranks and table["nodes"] == nodes
                  and (tuned is None or tuple(tuned) == tuple(local_sizes)))
    other_kind = "layout" in table and (table["layout"] == "override") != simulated
    if path is None or (same_shape and not other_kind):
        return
    kind = {True: " (nodes simulated on one host)", False: " (real nodes)"}
    shape = f"{table['ranks']} ranks on {table['nodes']} node(s)" + (f" {list(tuned)}" if tuned else "")
    message = (f"hpcjobs: warning: tuning table {path} has no table for {ranks} ranks on {nodes} node(s) "
               f"{list(local_sizes)}{kind[simulated] if other_kind else ''}; auto follows the one of {shape}"
               f"{kind[not simulated] if other_kind else ''} (run `hpcjobs tune` on this layout)")
    if message not in _warned:  # once per file, layout and table followed
        _warned.add(message)
        print(message, file=sys.stderr, flush=True)
