"""``hpcjobs plan-check``: the planner against published scaling results.

Each row of a CSV names a published run, its device count, its published
scaling efficiency and the hardware description ``hpcjobs plan`` gets for it
(``flags``: the parameters, one device's samples/s at its batch, devices per
node, the links, the fusion size). The planner predicts the efficiency at the
row's device count from those flags alone; the command prints predicted
against published, the difference in points and how many rows fall within
``--within`` points. Without a file it checks the rows that
docs/results/planner.md (c) reports (``hpcjobs/data/published_scaling.csv``,
each with its source)::

    hpcjobs plan-check
    hpcjobs plan-check my_cluster.csv --within 5 --json check.json

A row (lines starting with ``#`` are comments)::

    id,run,devices,published,source,flags
    A2,Horovod 16 RDMA ResNet-101,16,0.914,"Horovod README: 1746.2 img/s on 16, 119.4 on 1",\
"--params 44.5M --throughput 119.4 --batch-per-device 64 --devices-per-node 4 --intra-bw 16 --inter-bw 25 ..."
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
from importlib import resources

from .args import UsageError, positive_float

COLUMNS = ("id", "run", "devices", "published", "source", "flags")
REFUSED = ("--devices", "--json", "--plot", "--metrics", "--target-loss", "--runs")  # the row or the check sets these
DEFAULT_ROWS = "published_scaling.csv"


def configure(p) -> None:
    p.add_argument("rows", nargs="?", metavar="ROWS.csv",
                   help=f"rows to check ({', '.join(COLUMNS)}; default: the published rows of "
                        "docs/results/planner.md (c), shipped as hpcjobs/data/" + DEFAULT_ROWS + ")")
    p.add_argument("--within", type=positive_float, default=7.0, metavar="POINTS",
                   help="count the rows predicted within this many points of efficiency (default %(default)g)")
    p.add_argument("--json", metavar="PATH", help="write each row's prediction and difference as JSON")


class _Parser(argparse.ArgumentParser):
    """plan's parser, raising instead of exiting, so a bad row names its line."""

    def error(self, message):
        raise ValueError(message)


def plan_parser() -> argparse.ArgumentParser:
    from . import plan

    p = _Parser(prog="hpcjobs plan", add_help=False)
    plan.configure(p)
    return p


def read_rows(path: str | None) -> tuple[str, list[dict]]:
    """The rows of ``path`` (or the shipped file) as dicts, each with its
    line number; every malformed row refused with its line."""
    if path is None:
        source = resources.files("hpcjobs") / "data" / DEFAULT_ROWS
        name, text = f"hpcjobs/data/{DEFAULT_ROWS}", source.read_text()
    else:
        try:
            with open(path, newline="") as f:
                name, text = path, f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{path}: cannot read it ({e})")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")]
    if not lines:
        raise UsageError(f"{name}: no header and no rows (expected {','.join(COLUMNS)})")
    header = [h.strip() for h in next(csv.reader([lines[0][1]]))]
    if sorted(header) != sorted(COLUMNS):
        raise UsageError(f"{name}:{lines[0][0]}: expected the columns {','.join(COLUMNS)}, got {','.join(header)}")
    rows = []
    for n, line in lines[1:]:
        cells = next(csv.reader([line]))
        if len(cells) != len(header):
            raise UsageError(f"{name}:{n}: {len(cells)} fields, the header has {len(header)} (quote fields with commas)")
        row = dict(zip(header, (c.strip() for c in cells)), line=n)
        try:
            row["devices"] = int(row["devices"])
            row["published"] = float(row["published"])
            if row["devices"] < 1 or not 0 < row["published"] <= 2:
                raise ValueError
        except ValueError:
            raise UsageError(f"{name}:{n} ({row['id']}): devices must be a positive count and published an "
                             f"efficiency in (0, 2], got {row['devices']!r} and {row['published']!r}") from None
        rows.append(row)
    if not rows:
        raise UsageError(f"{name}: a header and no rows")
    return name, rows


def check_row(row: dict, parser: argparse.ArgumentParser) -> dict:
    """``row`` through the planner: its predicted efficiency at its device count."""
    from . import plan

    flags = shlex.split(row["flags"])
    refused = [f for f in flags if f.split("=")[0] in REFUSED]
    if refused:
        raise ValueError(f"{refused[0]} is not a hardware description: the check sets the device count from "
                         "the devices column and prints the result")
    args = parser.parse_args(flags + ["--devices", str(row["devices"])])
    if args.measure:
        raise ValueError("--measure times a model on this machine: give the published --throughput")
    rows = plan.predict(args)[0]
    got = next(r for r in rows if r["devices"] == row["devices"])
    return {"id": row["id"], "run": row["run"], "devices": row["devices"], "predicted": got["efficiency"],
            "published": row["published"], "difference_points": 100 * (got["efficiency"] - row["published"]),
            "iteration_s": got["iteration_s"], "algorithm": got["algorithm"], "source": row["source"],
            "flags": row["flags"]}


def run(args) -> int:
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise UsageError(f"--json {args.json}: cannot write into {folder}")
    name, rows = read_rows(args.rows)
    parser, results = plan_parser(), []
    for row in rows:
        try:
            results.append(check_row(row, parser))
        except (ValueError, UsageError) as e:
            raise UsageError(f"{name}:{row['line']} ({row['id']}): {e}") from None
    within = [r for r in results if abs(r["difference_points"]) <= args.within + 1e-9]
    print(f"# plan-check: {len(results)} rows of {name}, each row's flags through `hpcjobs plan`")
    print(table(results))
    print(f"# within {args.within:g} points: {len(within)} of {len(results)}; predicted above published in "
          f"{sum(r['difference_points'] > 0 for r in results)}, mean difference "
          f"{sum(r['difference_points'] for r in results) / len(results):+.1f} points")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows_file": name, "within_points": args.within, "within": len(within), "rows": results},
                      f, indent=1)
    return 0


def table(results: list[dict]) -> str:
    cells = [["id", "run", "devices", "predicted", "published", "difference (points)"]]
    cells += [[r["id"], r["run"], str(r["devices"]), f"{r['predicted']:.3f}", f"{r['published']:.3f}",
               f"{r['difference_points']:+.2f}"] for r in results]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    return "\n".join("| " + " | ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in
                                       enumerate(zip(c, widths))) + " |" for c in cells)
