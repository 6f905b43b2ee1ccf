"""Printing and saving benchmark records: the nccl-tests table, JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Iterable

from mpi4py import MPI

from .._files import atomic_write, write_text
from .._plots import MISSING, pyplot
from .names import BASELINES

COLUMNS = ("size(B)", "count", "type", "redop", "impl", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong")
_WIDTHS = (12, 12, 9, 6, 22, 11, 12, 12, 7)
# Across hosts (hpcjobs.bench.wire): the busiest host's bytes sent per call,
# what the algorithm's formula says a node sends, and their ratio.
WIRE_COLUMNS = ("wire(B)", "model(B)", "wire/model")
_WIRE_WIDTHS = (12, 12, 10)


def header(wire: bool = False) -> str:
    cells = [f"{c:>{w}}" for c, w in zip(COLUMNS, _WIDTHS)]
    if wire:
        cells += [f"{c:>{w}}" for c, w in zip(WIRE_COLUMNS, _WIRE_WIDTHS)]
    return "#" + " ".join(cells)[1:]


def row(rec) -> str:
    values = (rec.size_bytes, rec.count, rec.dtype, rec.op, rec.impl, f"{rec.time_us:.1f}",
              f"{rec.algbw_gbps:.3f}", f"{rec.busbw_gbps:.3f}", rec.wrong)
    cells = [f"{v:>{w}}" for v, w in zip(values, _WIDTHS)]
    if getattr(rec, "wire_hosts", None):
        model = rec.wire_model
        wire = (f"{rec.wire_bytes:.0f}", "-" if model is None else f"{model:.0f}",
                f"{rec.wire_bytes / model:.3f}" if model else "-")
        cells += [f"{v:>{w}}" for v, w in zip(wire, _WIRE_WIDTHS)]
    return " ".join(cells)


def environment(comm: MPI.Comm) -> dict:
    """What the numbers were measured on, for headers and JSON."""
    import numpy

    from ..comm import install

    env = {
        "hpcjobs": install()[0],  # version (crc32 of its modules' names and sizes)
        "ranks": comm.Get_size(),
        "mpi_library": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
        "mpi4py": __import__("mpi4py").__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    return env


def preamble(env: dict, title: str) -> list[str]:
    return [f"# {title}", *(f"#   {k}: {v}" for k, v in env.items())]


def write_json(path: str, records: Iterable, env: dict) -> None:
    """Write ``{"environment": ..., "records": [...]}`` atomically."""
    with atomic_write(path) as f:
        json.dump({"environment": env, "records": [r.to_dict() for r in records]}, f, indent=1)
        f.write("\n")


def write_csv(path: str, records: Iterable) -> None:
    """One row per record, the Record fields as columns, atomically."""
    import csv

    records = list(records)
    with atomic_write(path, newline="") as f:
        if records:
            writer = csv.DictWriter(f, fieldnames=list(records[0].to_dict()))
            writer.writeheader()
            writer.writerows(r.to_dict() for r in records)


def _size_label(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n}"


def plot(records: Iterable, path: str, metric: str, title: str) -> None:
    """Log-log plot of ``metric`` ("busbw_gbps" or "time_us") against message
    size, one line per implementation.

    Raises:
        RuntimeError: matplotlib is missing (install hpcjobs[report]).
    """
    plt = pyplot()
    if plt is None:
        raise RuntimeError(f"plots need matplotlib: {MISSING}")
    by_impl: dict[str, list] = {}
    for r in records:
        by_impl.setdefault(r.impl, []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for impl, rows in by_impl.items():
        rows = sorted(rows, key=lambda r: r.size_bytes)
        # dashed: a library's, whatever its label (mpi/tuned:N, horovod-gloo, the doors); solid: ours
        style = "--" if impl in BASELINES or impl.startswith("mpi") else "-"
        ax.plot([r.size_bytes for r in rows], [getattr(r, metric) for r in rows], style, marker="o",
                markersize=3, label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r.size_bytes for rows in by_impl.values() for r in rows})
    ticks = sizes[::max(1, len(sizes) // 8)]
    ax.set_xticks(ticks, [_size_label(t) for t in ticks])
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel({"busbw_gbps": "bus bandwidth (GB/s)", "time_us": "time (µs)"}[metric])
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(out_dir: str, records: list, env: dict, title: str, command: str) -> list[str]:
    """``out_dir``/report.md (table, environment, plots), busbw.png,
    latency.png, records.json and records.csv. Returns the paths written
    (without matplotlib: no plots, and report.md says so)."""
    os.makedirs(out_dir, exist_ok=True)
    plots = pyplot() is not None
    names = ("report.md", "busbw.png", "latency.png", "records.json", "records.csv")
    paths = {name: os.path.join(out_dir, name) for name in names if plots or not name.endswith(".png")}
    write_json(paths["records.json"], records, env)
    write_csv(paths["records.csv"], records)
    if plots:
        plot(records, paths["busbw.png"], "busbw_gbps", f"allreduce bus bandwidth, {env['ranks']} ranks")
        plot(records, paths["latency.png"], "time_us", f"allreduce time, {env['ranks']} ranks")
    lines = [f"# {title}", "", f"Command: `{command}`", "", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if k != "verdicts"]
    lines += ["", "## Verdicts", "", *(f"- {v}" for v in env["verdicts"])] if env.get("verdicts") else []
    lines += ["", "## Results", "", "Time is the slowest rank's median; busbw = algbw·2(P−1)/P; "
              "`#wrong` counts elements that differ from the exact result, after every call (the inputs "
              "take turns among three variants), over all calls and ranks.", "", "```",
              header(any(getattr(r, "wire_hosts", None) for r in records)), *(row(r) for r in records), "```", "",
              *(["![bus bandwidth](busbw.png)", "", "![latency](latency.png)"] if plots
                else [f"No plots: {MISSING}."]), ""]
    write_text(paths["report.md"], "\n".join(lines))
    return list(paths.values())
