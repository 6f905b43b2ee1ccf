"""``hpcjobs soak``: many allreduces of random shape, checked, with memory watched.

Each of ``--ops`` operations (default 10,000) draws, from a seed every rank
shares, an algorithm (every one of ours and ``auto``), a dtype, an op, a
count (log-uniform from 0 to ``--max-count``) and a numpy or torch buffer.
Each rank fills it with small random integers of its own, exactly
representable in every dtype, so the exact answer is known: ``MPI_Allreduce``
of the same values in int64/float64, cast back (and divided for ``avg`` as
the suite divides). Any element that differs is a wrong result.

Memory: each rank's resident set size (VmRSS) is read after the first 1% of
operations -- once scratch buffers, shared windows and caches exist -- and
at the end; growth is reported, and above ``--max-rss-growth`` percent the
command fails, as it does on any wrong result. The agreement checks and the
stall watchdog stay on, so they are soaked too.

Launch::

    mpirun -n 3 hpcjobs soak --ops 10000
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
from mpi4py import MPI

__all__ = ["main", "rss_bytes"]

_DTYPES = ("float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bfloat16")


def rss_bytes() -> int:
    """This process's resident set size in bytes (Linux /proc), 0 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _configure(p) -> None:
    from .cli import nonnegative_float, positive_int

    p.add_argument("--ops", type=positive_int, default=10_000, help="allreduces to run (default 10000)")
    p.add_argument("--max-count", type=positive_int, default=1 << 16,
                   help="largest element count, drawn log-uniformly (default 65536)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth", type=nonnegative_float, default=10.0,
                   help="fail when a rank's RSS grows more than this many percent (default 10)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON (rank 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def _values(rng: np.random.Generator, count: int, dtype: str, op: str) -> np.ndarray:
    if op == "prod":
        return rng.integers(1, 3, count)                 # <= 2**size: exact, no overflow at size <= 6
    hi = 4 if dtype in ("int8", "uint8") else 64         # sums stay inside int8 / uint8 / float16
    lo = 0 if dtype == "uint8" or op in ("sum", "avg") and dtype == "int8" else -hi
    return rng.integers(lo, hi, count)


def _buffer(values: np.ndarray, dtype: str, torch_buffer: bool):
    import torch

    if dtype == "bfloat16":
        return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
    arr = values.astype(dtype)
    return torch.from_numpy(arr) if torch_buffer else arr


def _as_numpy(buf) -> np.ndarray:
    import torch

    if isinstance(buf, torch.Tensor):
        return buf.float().numpy() if buf.dtype == torch.bfloat16 else buf.numpy()
    return buf


def _expected(values: np.ndarray, dtype: str, op: str, comm: MPI.Intracomm) -> np.ndarray:
    from .collectives._buffers import finish_avg

    integer = dtype not in ("float16", "float32", "float64", "bfloat16")
    wide = values.astype(np.int64 if integer else np.float64)
    out = np.empty_like(wide)
    mpi_op = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op]
    comm.Allreduce(wide, out, op=mpi_op)
    if dtype == "bfloat16":
        import torch

        t = torch.from_numpy(out.astype(np.float32)).to(torch.bfloat16)
        if op == "avg":
            t.div_(comm.Get_size())
        return t.float().numpy()
    res = out.astype(dtype)
    if op == "avg":
        finish_avg(res, dtype, comm.Get_size())
    return res


def main(args) -> int:
    from .collectives import ALGORITHMS, OPS, allreduce
    from .comm import print0, private
    from .topology import detect_private

    comm = private()
    rank, size = comm.Get_rank(), comm.Get_size()
    algorithms = [a for a in (*ALGORITHMS, "auto") if a != "shm" or detect_private(comm).num_nodes == 1]
    print0(f"# hpcjobs soak: {args.ops} allreduces at {size} ranks, counts 0..{args.max_count}, "
           f"algorithms {', '.join(algorithms)}, dtypes {', '.join(_DTYPES)}, ops {', '.join(OPS)}")
    shared = np.random.default_rng(args.seed)
    mine = np.random.default_rng([args.seed, rank + 1])
    wrong_ops, wrong_elems, elements = 0, 0, 0
    per_alg = {a: 0 for a in algorithms}
    warm = max(1, args.ops // 100)
    rss_start = rss_bytes()
    t0 = time.perf_counter()
    for i in range(args.ops):
        alg = algorithms[shared.integers(len(algorithms))]
        dtype = _DTYPES[shared.integers(len(_DTYPES))]
        op = OPS[shared.integers(len(OPS))]
        count = int(math.exp(shared.uniform(0, math.log(args.max_count + 1)))) - 1
        torch_buffer = bool(shared.integers(2))
        values = _values(mine, count, dtype, op)
        buf = _buffer(values, dtype, torch_buffer)
        allreduce(buf, op=op, algorithm=alg, comm=comm)
        want = _expected(values, dtype, op, comm)
        bad = int(np.count_nonzero(_as_numpy(buf) != want))
        wrong_elems += bad
        wrong_ops += bad > 0
        elements += count
        per_alg[alg] += 1
        if i + 1 == warm:
            rss_start = rss_bytes()
        if args.progress and rank == 0 and (i + 1) % max(1, args.ops // 10) == 0:
            print(f"# {i + 1}/{args.ops} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rss_end = rss_bytes()
    rows = comm.allgather((rank, rss_start, rss_end))
    wrong = comm.allreduce(np.array([wrong_ops, wrong_elems]), op=MPI.SUM)
    worst = max([0.0] + [100.0 * (e - s) / s for _, s, e in rows if s])
    if rank == 0:
        print(f"# {args.ops} allreduces, {elements:,} elements per rank, {time.perf_counter() - t0:.1f} s; "
              f"per algorithm: " + ", ".join(f"{a} {n}" for a, n in per_alg.items()))
        print(f"# {'rank':>4s} {'RSS after 1% (MiB)':>19s} {'RSS at end (MiB)':>17s} {'growth':>7s}")
        for r, s, e in rows:
            print(f"  {r:4d} {s / 2**20:19.1f} {e / 2**20:17.1f} {100.0 * (e - s) / s if s else 0:6.1f}%")
        print(f"# wrong results: {int(wrong[0])} operations, {int(wrong[1])} elements (summed over ranks); "
              f"largest RSS growth {worst:.1f}% (limit {args.max_rss_growth:g}%)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "ops": args.ops, "wrong_ops": int(wrong[0]), "wrong_elements": int(wrong[1]),
                           "rss": [{"rank": r, "start": s, "end": e} for r, s, e in rows],
                           "max_rss_growth_percent": worst, "per_algorithm": per_alg}, f, indent=1)
    return 1 if wrong[0] or worst > args.max_rss_growth else 0


def _register():
    from .cli import arguments, command

    command("soak", "many random allreduces (sizes, dtypes, ops, algorithms) checked against MPI_Allreduce, "
            "with each rank's memory watched")(arguments(_configure)(main))


_register()
