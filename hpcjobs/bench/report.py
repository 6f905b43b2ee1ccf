"""Printing and saving benchmark records: the nccl-tests table, JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Iterable

from mpi4py import MPI

COLUMNS = ("size(B)", "count", "type", "redop", "impl", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong")
_WIDTHS = (12, 12, 9, 6, 22, 11, 12, 12, 7)


def header() -> str:
    cells = [f"{c:>{w}}" for c, w in zip(COLUMNS, _WIDTHS)]
    return "#" + " ".join(cells)[1:]


def row(rec) -> str:
    values = (rec.size_bytes, rec.count, rec.dtype, rec.op, rec.impl, f"{rec.time_us:.1f}",
              f"{rec.algbw_gbps:.3f}", f"{rec.busbw_gbps:.3f}", rec.wrong)
    return " ".join(f"{v:>{w}}" for v, w in zip(values, _WIDTHS))


def environment(comm: MPI.Comm) -> dict:
    """What the numbers were measured on, for headers and JSON."""
    import numpy

    env = {
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
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"environment": env, "records": [r.to_dict() for r in records]}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
