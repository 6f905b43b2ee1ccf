"""The soak: many allreduces of random shape, checked, with memory watched
(``hpcjobs soak`` runs it).

Each of ``--ops`` operations (default 10,000) draws, from a seed every rank
shares, an algorithm (every one of ours and ``auto``), a dtype, an op, a
count (log-uniform from 0 to ``--max-count``) and a numpy or torch buffer.
Each rank fills it with small random integers of its own, exactly
representable in every dtype, so the exact answer is known: ``MPI_Allreduce``
of the same values in int64/float64, cast back (and divided for ``avg`` as
the suite divides). Any element that differs is a wrong result.

Memory: before the random operations, every algorithm runs once at
``--max-count`` in float64 (the widest dtype; checked as the others are), so
the scratch buffers, shared windows and caches that grow to the largest
message seen have grown; each rank's resident set size (VmRSS) is read after
that and the first 1% of operations, and at the end; ``hpcjobs soak`` fails above ``--max-rss-growth`` percent of
growth, as it does on any wrong result. The agreement checks and the
stall watchdog stay on, so they are soaked too.

Launch::

    mpirun -n 3 hpcjobs soak --ops 10000
"""

from __future__ import annotations

import ctypes
import functools
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from .collectives import ALGORITHMS, OPS, allreduce
from .collectives.names import SHARED_MEMORY
from .collectives._buffers import OP_TABLE, finish_avg
from .collectives._shared import is_single_node

__all__ = ["DTYPES", "SoakResult", "algorithms", "soak", "rss_bytes"]

# The dtypes soaked: every width and kind whose small sums stay exact
# (_values keeps them so).
DTYPES = ("float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bfloat16")


def rss_bytes() -> int:
    """This process's resident set size in bytes (Linux /proc), 0 elsewhere;
    Python's garbage and the heap's free pages are let go first."""
    gc.collect()
    _trim()
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _trim() -> None:
    """Hands the C heap's free pages back to the kernel (glibc's malloc_trim;
    nothing elsewhere): the resident set then counts memory held, not memory
    the allocator keeps for reuse. Messages under 32 MiB live on the heap, and
    freed in its middle they stay resident: untrimmed, 1,500 operations up to
    4M elements held 90 bytes an element at their peak, where 40 are live."""
    if _malloc_trim() is not None:
        _malloc_trim()(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, found once (None where the C library has none)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


def _values(rng: np.random.Generator, count: int, dtype: str, op: str, size: int) -> np.ndarray:
    if op == "prod":
        return rng.integers(1, 3, count)                 # <= 2**size: exact, no overflow at size <= 6
    hi = 4 if dtype in ("int8", "uint8") else 64         # sums stay inside int8 / uint8 / float16
    if op in ("sum", "avg") and dtype in ("float16", "bfloat16"):
        # every partial sum an integer the format holds exactly (2048, 256), in any order: at 6 ranks values
        # up to 64 rounded bfloat16's partial sums, and the sum in another order was not wrong
        hi = max(1, min(hi, (2048 if dtype == "float16" else 256) // size))
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
    integer = dtype not in ("float16", "float32", "float64", "bfloat16")
    wide = values.astype(np.int64 if integer else np.float64)
    out = np.empty_like(wide)
    comm.Allreduce(wide, out, op=getattr(MPI, OP_TABLE[op].mpi))
    del wide
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


@dataclass
class SoakResult:
    """What :func:`soak` found: wrong results (the operations wrong on some
    rank, the warm-up's included, and the first of them; the elements summed
    over ranks) and each rank's resident memory after the warm-up and the
    first 1% of operations, and at the end."""

    ops: int
    warmup: int  # allreduces at max_count before the random ones, one per algorithm
    ranks: int
    elements: int  # per rank, over all operations
    seconds: float
    per_algorithm: dict
    wrong_ops: int  # operations wrong on some rank, each once
    wrong_elements: int  # summed over ranks
    rss: list  # (rank, bytes after 1%, bytes at the end), every rank's
    seed: int = 0
    max_count: int = 0
    wrong: list = field(default_factory=list)  # the first wrong draws, as dicts: what to run again

    @property
    def worst_growth_percent(self) -> float:
        return max([0.0] + [100.0 * (e - s) / s for _, s, e in self.rss if s])

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "ops": self.ops, "warmup_ops": self.warmup, "seed": self.seed,
                "max_count": self.max_count, "wrong_ops": self.wrong_ops, "wrong_elements": self.wrong_elements,
                "wrong": self.wrong,
                "rss": [{"rank": r, "start": s, "end": e} for r, s, e in self.rss],
                "max_rss_growth_percent": self.worst_growth_percent, "per_algorithm": self.per_algorithm}


def algorithms(comm: MPI.Intracomm) -> list[str]:
    """Every algorithm soaked on ``comm``: all of ours and auto, the shared-memory
    ones where every rank can map the others' memory (the test they make
    themselves, not the topology: nodes simulated with HPCJOBS_RANKS_PER_NODE
    still share it, and an override spanning real hosts does not)."""
    single = is_single_node(comm)
    return [a for a in (*ALGORITHMS, "auto") if a not in SHARED_MEMORY or single]


def _warm_up(comm: MPI.Intracomm, names: list[str], max_count: int) -> tuple[int, int]:
    """One allreduce of ``max_count`` float64 ones with each algorithm; returns
    how many operations and elements came back wrong. What an algorithm keeps for the largest message
    it has seen is then kept before the soak's baseline is read: with that
    baseline taken after 1% of the operations alone, a soak of few operations
    up to 20M elements read the first large message's scratch as 65% growth."""
    wrong, elements = [], 0
    for alg in names:
        buf = np.ones(max_count)
        allreduce(buf, op="sum", algorithm=alg, comm=comm)
        bad = int(np.count_nonzero(buf != comm.Get_size()))
        if bad:
            wrong.append(("warm-up", alg, "float64", "sum", max_count, False))
        elements += bad
        del buf
    return wrong, elements


def soak(comm: MPI.Intracomm, ops: int = 10_000, max_count: int = 1 << 16, seed: int = 0,
         progress: Callable[[int, float], None] | None = None) -> SoakResult:
    """Run ``ops`` random allreduces on ``comm`` (collective; the module
    docstring says what is drawn), checking every result; ``progress(done,
    seconds)`` is called on every rank after each tenth of them."""
    rank, size = comm.Get_rank(), comm.Get_size()
    names = algorithms(comm)
    shared = np.random.default_rng(seed)
    mine = np.random.default_rng([seed, rank + 1])
    elements = 0
    per_alg = {a: 0 for a in names}
    warm = max(1, ops // 100)
    t0 = time.perf_counter()
    wrong, wrong_elems = _warm_up(comm, names, max_count)  # this rank's wrong draws, and elements
    rss_start = rss_bytes()
    for i in range(ops):
        alg = names[shared.integers(len(names))]
        dtype = DTYPES[shared.integers(len(DTYPES))]
        op = OPS[shared.integers(len(OPS))]
        count = int(math.exp(shared.uniform(0, math.log(max_count + 2)))) - 1  # 0..max_count, log-uniformly
        torch_buffer = bool(shared.integers(2))
        values = _values(mine, count, dtype, op, size)
        want = _expected(values, dtype, op, comm)  # first, so its wide copies are gone before the buffer is made
        buf = _buffer(values, dtype, torch_buffer)
        del values
        allreduce(buf, op=op, algorithm=alg, comm=comm)
        bad = int(np.count_nonzero(_as_numpy(buf) != want))
        wrong_elems += bad
        if bad:
            wrong.append((i, alg, dtype, op, count, torch_buffer))
        elements += count
        per_alg[alg] += 1
        del buf, want
        if count >= 1 << 17:
            _trim()
        if i + 1 == warm:
            rss_start = rss_bytes()
        if progress is not None and (i + 1) % max(1, ops // 10) == 0:
            progress(i + 1, time.perf_counter() - t0)
    rss_end = rss_bytes()
    rows = comm.allgather((rank, rss_start, rss_end))
    # an operation wrong on every rank is one wrong operation (summed, it counted once a rank)
    draws = sorted(set().union(*comm.allgather(wrong)),
                   key=lambda d: (d[0] != "warm-up", names.index(d[1]) if d[0] == "warm-up" else d[0]))
    first = [dict(zip(("op_index", "algorithm", "dtype", "op", "count", "torch"), d)) for d in draws[:WRONG_KEPT]]
    return SoakResult(ops, len(names), size, elements, time.perf_counter() - t0, per_alg, len(draws),
                      comm.allreduce(wrong_elems, op=MPI.SUM), rows, seed, max_count, first)


WRONG_KEPT = 10  # wrong draws a result names
