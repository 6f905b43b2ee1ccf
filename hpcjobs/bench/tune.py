"""``hpcjobs tune``: measure every allreduce algorithm that applies here (see
``_applicable``) and write the tuning table that ``algorithm="auto"`` reads (format in
``hpcjobs.collectives.select``).

Run it once per machine or allocation shape, under the same launcher and
ranks as the jobs that will use it::

    mpirun -n 8 hpcjobs tune --out tuning.json
    export HPCJOBS_TUNING=$PWD/tuning.json

The file keeps one table per (ranks, nodes); tuning another shape adds its
table and keeps the others.
"""

from __future__ import annotations

import json
import os

from ..collectives import ALGORITHMS
from ..collectives.shm import is_single_node
from .allreduce import Record, format_bytes, implementations, median_records, run, size_sweep


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


# auto times a row's candidates where it runs (hpcjobs.collectives.select):
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


def merge(path: str, table: dict, environment: dict) -> dict:
    """The tuning file at ``path`` with ``table`` added or replacing the one
    of the same ranks and nodes."""
    data = {"version": 1, "tables": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data["tables"] = [t for t in data.get("tables", [])
                      if (t["ranks"], t["nodes"]) != (table["ranks"], table["nodes"])] + [table]
    data["tables"].sort(key=lambda t: (t["nodes"], t["ranks"]))
    data.setdefault("environments", {})[f"{table['ranks']}x{table['nodes']}"] = environment
    return data


# Sweeps per `hpcjobs tune`. Two runs here 15 s apart disagreed at 16 MB (shm
# 1.59x ahead of the ring in one, behind in the next); three passes give a
# median and three looks at which algorithms win near each size.
PASSES = 3


def _applicable(shared_memory: bool, nodes: int) -> tuple[list[str], list[str]]:
    """The algorithms worth timing here, and why the others are not.

    On one node the hierarchical algorithm is its intra-node stage alone (the
    ring, plus finding the topology): timing it again would only give a
    row's contender slot to a copy of the ring (in one tune here it took the
    last row's fourth slot from the pipelined ring, the best message-passing
    algorithm at 64 MB in every run). shm needs every rank on one shared-memory
    node."""
    names, left_out = [], []
    for name in ALGORITHMS:
        if name == "shm" and not shared_memory:
            left_out.append("shm: the ranks do not share one node's memory")
        elif name == "hierarchical" and nodes == 1:
            left_out.append("hierarchical: on one node it is its intra-node stage, the ring")
        else:
            names.append(name)
    return names, left_out


def _configure(p) -> None:
    from ..cli import positive_int
    from .allreduce import add_sweep_arguments

    p.add_argument("--out", "-O", default="tuning.json", metavar="PATH",
                   help="tuning file to write or update (default tuning.json)")
    p.add_argument("--passes", type=positive_int, default=PASSES,
                   help=f"sweeps to run, one after the other; a size's time is the median over them "
                        f"(default {PASSES}: here the fastest algorithm at a size can change within seconds)")
    add_sweep_arguments(p)


def main(args) -> int:
    from ..cli import UsageError
    from ..comm import print0, private
    from ..topology import detect_private
    from .allreduce import apply_placement, unchecked_benchmarks
    from .report import environment

    if args.min_bytes > args.max_bytes or args.factor < 2:
        raise UsageError("need --min-bytes <= --max-bytes and --factor >= 2")
    apply_placement(args)
    unchecked_benchmarks()
    comm = private()
    topo = detect_private(comm)
    names, left_out = _applicable(is_single_node(comm), topo.num_nodes)
    sizes = size_sweep(args.min_bytes, args.max_bytes, args.factor)
    print0(f"# hpcjobs tune: {comm.Get_size()} ranks on {topo.num_nodes} node(s); "
           f"{len(names)} algorithms x {len(sizes)} sizes x {args.passes} passes")
    for line in left_out:
        print0(f"# left out: {line}")
    done = [0]

    def progress(rec):
        done[0] += 1
        if done[0] % len(names) == 0:
            n = done[0] // len(names)
            print0(f"#   pass {(n - 1) // len(sizes) + 1}: {format_bytes(rec.size_bytes):>6} done "
                   f"({n}/{len(sizes) * args.passes})")

    passes = [run(comm, sizes, implementations(names), iters=args.iters, on_record=progress)
              for _ in range(args.passes)]
    wrong = sum(r.wrong for records in passes for r in records)
    if wrong:
        print0(f"# {wrong} wrong elements: not writing a tuning table from a broken run")
        return 1
    table = {"ranks": comm.Get_size(), "nodes": topo.num_nodes, "passes": args.passes, "rows": best_rows(*passes)}
    if comm.Get_rank() == 0:
        data = merge(args.out, table, environment(comm))
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.out)
        print("# up to (B)   algorithm            best time(us)  runner-up (x slower)           "
              "also timed by auto", flush=True)
        for row in table["rows"]:
            last = row["measured"][-1]
            bound = "inf" if row["max_bytes"] is None else str(row["max_bytes"])
            runner_up = f"{last['runner_up']} ({last['runner_up_ratio']:.2f}x)"
            print(f"{bound:>12}   {row['algorithm']:<20} {last['time_us']:>13.1f}  {runner_up:<30}  "
                  f"{', '.join(row['candidates'][1:]) or '-'}", flush=True)
        print(f"# written to {args.out}; use it with HPCJOBS_TUNING={os.path.abspath(args.out)}", flush=True)
    return 0


def _register() -> None:
    from ..cli import arguments, command

    command("tune", "measure the allreduce algorithms that apply here and write the tuning table auto reads")(
        arguments(_configure)(main))


_register()
