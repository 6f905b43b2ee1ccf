"""``hpcjobs plan-check``: the planner against published scaling results.

Each row of a CSV names a published run, its device count, its published
scaling efficiency and the hardware description ``hpcjobs plan`` gets for it
(``flags``: the parameters, one device's samples/s at its batch, devices per
node, the links, the fusion size). The planner predicts the efficiency at the
row's device count from those flags alone; the command prints predicted
against published, the difference in points and how many rows fall within
``--within`` points. Without a file it checks a shipped set
(``hpcjobs/data/``, each row with its source): ``published``, the rows
docs/results/planner.md (c) was written on, or ``heldout``, rows collected
after the planner and the rules for its flags were fixed::

    hpcjobs plan-check
    hpcjobs plan-check --shipped heldout
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

from .._files import atomic_write
from .args import UsageError, check_outputs, positive_float

COLUMNS = ("id", "run", "devices", "published", "source", "flags")
REFUSED = ("--devices", "--json", "--plot", "--metrics", "--target-loss", "--runs", "--against")  # not hardware
SHIPPED = {"published": "published_scaling.csv",  # the rows docs/results/planner.md (c) was written on
           "heldout": "published_scaling_heldout.csv"}  # collected after the planner and these rules were fixed


def configure(p) -> None:
    p.add_argument("rows", nargs="?", metavar="ROWS.csv",
                   help=f"rows to check ({', '.join(COLUMNS)}; default: --shipped published)")
    p.add_argument("--shipped", choices=tuple(SHIPPED), default=None,
                   help="a shipped set instead of ROWS.csv (hpcjobs/data/): published, the rows "
                        "docs/results/planner.md (c) was written on; heldout, rows collected after the planner was "
                        "fixed and never used to change it")
    p.add_argument("--within", type=positive_float, default=7.0, metavar="POINTS",
                   help="count the rows predicted within this many points of efficiency (default %(default)g)")
    p.add_argument("--json", metavar="PATH", help="write each row's prediction and difference as JSON")


class _Parser(argparse.ArgumentParser):
    """plan's parser, raising instead of exiting, so a bad row names its line."""

    def error(self, message):
        raise ValueError(message)


def plan_parser() -> argparse.ArgumentParser:
    from . import plan

    p = _Parser(prog="hpcjobs plan", add_help=False, allow_abbrev=False)  # --plo is not --plot here
    plan.configure(p)
    return p


def _data_lines(text: str):
    """``text``'s lines, comments and blank ones as empty lines (which csv
    reads as empty rows), so that the reader's line numbers are the file's."""
    for line in text.splitlines(keepends=True):
        yield "\n" if not line.strip() or line.lstrip().startswith("#") else line


def read_rows(path: str | None, shipped: str = "published") -> tuple[str, list[dict]]:
    """The rows of ``path`` (None: the ``shipped`` set) as dicts, each with
    its first line's number; every malformed row refused with its line."""
    if path is None:
        source = resources.files("hpcjobs") / "data" / SHIPPED[shipped]
        name, text = str(source), source.read_text(encoding="utf-8")
    else:
        try:
            with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark
                name, text = path, f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{path}: cannot read it ({e})")
    reader, header, rows = csv.reader(_data_lines(text)), None, []
    try:
        while True:
            first = reader.line_num + 1
            try:
                cells = next(reader)
            except StopIteration:
                break
            if not any(c.strip() for c in cells):  # a blank line, or a spreadsheet's row of commas
                continue
            if header is None:
                header = [h.strip() for h in cells]
                if sorted(header) != sorted(COLUMNS):
                    raise UsageError(f"{name}:{first}: expected the columns {','.join(COLUMNS)}, got "
                                     f"{','.join(header)}")
                continue
            if len(cells) != len(header):
                raise UsageError(f"{name}:{first}: {len(cells)} fields, the header has {len(header)} (quote "
                                 "fields with commas)")
            rows.append(_row(dict(zip(header, (c.strip() for c in cells))), name, first))
    except csv.Error as e:
        raise UsageError(f"{name}:{reader.line_num}: not CSV ({e})") from None
    if header is None:
        raise UsageError(f"{name}: no header and no rows (expected {','.join(COLUMNS)})")
    if not rows:
        raise UsageError(f"{name}: a header and no rows")
    return name, rows


def _row(row: dict, name: str, line: int) -> dict:
    row["line"] = line
    try:
        row["devices"] = int(row["devices"])
        row["published"] = float(row["published"])
        if row["devices"] < 1 or not 0 < row["published"] <= 2:
            raise ValueError
    except ValueError:
        raise UsageError(f"{name}:{line} ({row['id']}): devices must be a positive count and published an "
                         f"efficiency in (0, 2], got {row['devices']!r} and {row['published']!r}") from None
    return row


def check_row(row: dict, parser: argparse.ArgumentParser, folder: str | None = None) -> dict:
    """``row`` through the planner: its predicted efficiency at its device
    count. A relative ``--cost-model`` is read from ``folder`` (the rows')."""
    from . import plan

    flags = shlex.split(row["flags"])
    refused = [f for f in flags if f.split("=")[0] in REFUSED]
    if refused:
        raise ValueError(f"{refused[0]} is not a hardware description: the check sets the device count from "
                         "the devices column and prints the result")
    args = parser.parse_args(flags + ["--devices", str(row["devices"])])
    if args.measure:
        raise ValueError("--measure times a model on this machine: give the published --throughput")
    if args.cost_model and folder and not os.path.isabs(args.cost_model):
        args.cost_model = os.path.join(folder, args.cost_model)  # beside the rows, wherever the check runs
    rows = plan.predict(args)[0]
    got = next(r for r in rows if r["devices"] == row["devices"])
    return {"id": row["id"], "run": row["run"], "devices": row["devices"], "predicted": got["efficiency"],
            "published": row["published"], "difference_points": 100 * (got["efficiency"] - row["published"]),
            "iteration_s": got["iteration_s"], "algorithm": got["algorithm"], "source": row["source"],
            "flags": row["flags"]}


def run(args) -> int:
    if args.rows and args.shipped:
        raise UsageError("give ROWS.csv or --shipped, not both")
    check_outputs(None, [("--json", args.json, False)])
    name, rows = read_rows(args.rows, args.shipped or "published")
    parser, results = plan_parser(), []
    folder = os.path.dirname(os.path.abspath(args.rows)) if args.rows else None
    for row in rows:
        try:
            results.append(check_row(row, parser, folder))
        except (ValueError, UsageError) as e:
            raise UsageError(f"{name}:{row['line']} ({row['id']}): {e}") from None
    within = [r for r in results if abs(r["difference_points"]) <= args.within + 1e-9]
    print(f"# plan-check: {len(results)} rows of {name}, each row's flags through `hpcjobs plan`")
    print(table(results))
    print(f"# within {args.within:g} points: {len(within)} of {len(results)}; predicted above published in "
          f"{sum(r['difference_points'] > 0 for r in results)}, mean difference "
          f"{sum(r['difference_points'] for r in results) / len(results):+.1f} points")
    if args.json:
        with atomic_write(args.json) as f:
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
