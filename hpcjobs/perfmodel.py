"""The alpha-beta-gamma cost model: measure the machine, predict each
algorithm, compare with what it actually does (``hpcjobs model`` prints it).

A message of n bytes costs α + n·β (α: latency, β: seconds per byte on the
wire) and reducing n bytes costs n·γ. Each algorithm's formula and its
critical path are in :data:`hpcjobs.collectives.costs.COSTS`, the one place
they are written; :func:`predict` costs that path.

Measuring: α and β by ping-pong between ranks 0 and 1 (one message in
flight), and β again by *exchange* -- both ranks sending at once, as every
algorithm here does. On a shared-memory node the two directions share the
memory bus, so the exchange β is the one that predicts; both are reported.
γ is timed with every rank reducing at once, for the same reason. Every
buffer is rewritten just before it is sent or reduced, as the benchmark's
inputs and real gradients are: fetching lines still dirty in another core's
cache is part of the cost (on this CI host, at times most of it). Caches make
the per-byte costs depend on size, so predictions cost each message and each
reduction at its own size from the measured curves (``linear=True`` gives
the plain fitted model; ``hpcjobs model`` prints both).

The bytes an implementation sends are *counted* (a communicator proxy adds
up every send buffer), not computed, and compared with the formula's.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

from .collectives._buffers import as_flat, reducer
from .collectives.costs import COSTS, evaluate
from .collectives.counting import CountingComm
from .collectives.messages import message_passing

__all__ = ["Machine", "measure", "predict", "compare", "count_bytes", "formula_bytes", "write", "MODELED"]

# The algorithms the model predicts (ring_pipelined is the ring's formula).
MODELED = tuple(name for name in COSTS if name != "ring_pipelined")


@dataclass
class Machine:
    """What ``measure`` found, in seconds and seconds per byte.

    The fitted constants give the classic linear model. Caches make real
    costs piecewise (a 2 MB message is cheaper per byte than a 32 MB one), so
    the measured per-size costs are kept too, and :func:`predict` uses them
    by default: the same formulas, each message and each reduction costed at
    its own size (log-interpolated between the measured sizes).
    """

    alpha: float          # latency per message (exchange fit)
    beta: float           # per byte, both directions at once
    beta_pingpong: float  # per byte, one message in flight
    gamma: float          # per byte reduced, every rank reducing at once (16 MB)
    dtype: str
    sizes: list           # bytes at which the costs below were measured
    message_s: list       # one simultaneous exchange of that many bytes
    oneway_s: list        # one message with nothing coming the other way
    reduce_s: list        # reducing that many bytes

    def to_dict(self) -> dict:
        return asdict(self)

    def message(self, n: float, linear: bool = False) -> float:
        if linear or n <= 0:
            return self.alpha + n * self.beta
        return _interp(n, self.sizes, self.message_s)

    def oneway(self, n: float, linear: bool = False) -> float:
        if linear or n <= 0:
            return self.alpha + n * self.beta_pingpong
        return _interp(n, self.sizes, self.oneway_s)

    def reduce(self, n: float, linear: bool = False) -> float:
        if linear or n <= 0:
            return n * self.gamma
        return _interp(n, self.sizes, self.reduce_s)


def _interp(n: float, sizes: list, costs: list) -> float:
    """Cost at ``n`` bytes: log-log interpolation between measured sizes,
    linear extrapolation (cost per byte of the nearest end) outside them."""
    if n <= sizes[0]:
        return costs[0]
    if n >= sizes[-1]:
        return costs[-1] * n / sizes[-1]
    return float(np.exp(np.interp(np.log(n), np.log(sizes), np.log(costs))))


def _fit(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Least squares of t = α + n·β, weighted by 1/t so small messages (α)
    and large ones (β) both count; α clamped at 0."""
    n = np.array(sizes, dtype=np.float64)
    t = np.array(times, dtype=np.float64)
    w = 1.0 / t
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    return max(float(alpha), 0.0), float(beta)


def _exchange_times(comm: MPI.Intracomm, sizes: list[int], both: bool, reps: int) -> list[float]:
    """One-way time per size between ranks 0 and 1: half a ping-pong round
    trip (``both=False``) or one simultaneous exchange (``both=True``)."""
    rank = comm.Get_rank()
    out = []
    for n in sizes:
        send = np.ones(n, dtype=np.uint8)
        recv = np.empty(n, dtype=np.uint8)
        samples = []
        for i in range(reps + 2):
            # Freshly written, as gradients (and the benchmark's inputs) are:
            # reading lines still dirty in the sender's cache is part of the
            # cost, and on some hosts most of it.
            send.fill(i)
            comm.Barrier()
            t0 = MPI.Wtime()
            if rank in (0, 1):
                peer = 1 - rank
                if both:
                    comm.Sendrecv(send, peer, 21, recv, peer, 21)
                elif rank == 0:
                    comm.Send(send, 1, 21)
                    comm.Recv(recv, 1, 21)
                else:
                    comm.Recv(recv, 0, 21)
                    comm.Send(send, 0, 21)
            dt = MPI.Wtime() - t0
            if i >= 2:
                samples.append(dt if both else dt / 2)
        t = np.array([statistics.median(samples)])
        comm.Bcast(t, root=0)
        out.append(float(t[0]))
    return out


def measure(comm: MPI.Intracomm, dtype: str = "float32", reps: int = 20) -> Machine:
    """Fit α, β (ping-pong and exchange) and γ on ``comm`` (collective; needs
    at least 2 ranks)."""
    if comm.Get_size() < 2:
        raise ValueError("the cost model needs at least 2 ranks to measure α and β")
    sizes = [8 << (3 * k) for k in range(8)] + [16 << 20, 32 << 20, 64 << 20]  # 8 B .. 64 MB
    sizes = sorted(set(sizes))
    oneway = _exchange_times(comm, sizes, both=False, reps=reps)
    _, b_pp = _fit(sizes, oneway)  # one-way alpha: the exchange fit gives the one predictions use
    exchange = _exchange_times(comm, sizes, both=True, reps=reps)
    a_x, b_x = _fit(sizes, exchange)
    reduce_s = _reduce_times(comm, sizes, dtype, reps)
    return Machine(alpha=a_x, beta=b_x, beta_pingpong=b_pp, gamma=reduce_s[sizes.index(16 << 20)] / (16 << 20),
                   dtype=dtype, sizes=sizes, message_s=exchange, oneway_s=oneway, reduce_s=reduce_s)


def _reduce_times(comm: MPI.Intracomm, sizes: list[int], dtype: str, reps: int) -> list[float]:
    """Seconds to reduce n bytes into n bytes, every rank at once (the max)."""
    np_dtype = np.dtype(dtype if dtype != "bfloat16" else "uint16")
    reduce = reducer("sum", dtype)
    out = []
    for n in sizes:
        a = np.ones(max(1, n // np_dtype.itemsize), dtype=np_dtype)
        b = np.ones_like(a)
        samples = []
        for i in range(reps + 2):
            a.fill(1)
            b.fill(1)
            comm.Barrier()
            t0 = MPI.Wtime()
            reduce(a, b)
            if i >= 2:
                samples.append(MPI.Wtime() - t0)
        t = np.array([statistics.median(samples)])
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        out.append(float(t[0]))
    return out


def predict(algorithm: str, nbytes: int, size: int, m: Machine, local_size: int | None = None,
            linear: bool = False) -> float:
    """Predicted seconds for ``algorithm`` on ``nbytes`` over ``size`` ranks
    (``local_size`` per node for hierarchical): its critical path from
    :data:`~hpcjobs.collectives.costs.COSTS`, each message and reduction
    costed with the fitted α + nβ and nγ (``linear=True``) or with the
    measured per-size costs.

    Raises:
        ValueError: an algorithm without a model (shm).
    """
    if algorithm not in COSTS:
        raise ValueError(f"no model for {algorithm!r}; modeled: {', '.join(MODELED)}")
    if size == 1:
        return 0.0
    return COSTS[algorithm].path(float(nbytes), size, local_size or size, _Costing(m, linear))


class _Costing:
    """A Machine's costs in the shape ``COSTS[...].path`` takes."""

    def __init__(self, m: Machine, linear: bool):
        self.m, self.linear = m, linear

    def message(self, n: float) -> float:
        return self.m.message(n, self.linear)

    def oneway(self, n: float) -> float:
        return self.m.oneway(n, self.linear)

    def reduce(self, n: float) -> float:
        return self.m.reduce(n, self.linear)


def compare(records, size: int, m: Machine, local_size: int | None = None) -> list[dict]:
    """Each benchmark record against the model: measured, predicted (per-size
    costs) and linear, with their relative errors."""
    rows = []
    for r in records:
        pred = predict(r.impl, r.size_bytes, size, m, local_size) * 1e6
        lin = predict(r.impl, r.size_bytes, size, m, local_size, linear=True) * 1e6
        rows.append({"size_bytes": r.size_bytes, "algorithm": r.impl, "measured_us": r.time_us,
                     "predicted_us": pred, "rel_error": (pred - r.time_us) / r.time_us, "linear_us": lin,
                     "linear_rel_error": (lin - r.time_us) / r.time_us})
    return rows


def count_bytes(algorithm: str, nbytes: int, comm: MPI.Intracomm) -> tuple[int, int]:
    """(sent, received) bytes of this rank in one float32 sum allreduce of
    ``nbytes`` with a message-passing ``algorithm`` (collective).

    Raises:
        ValueError: an algorithm that does not move data in messages on
            ``comm`` (shm, hierarchical).
    """
    step = message_passing(algorithm).bound
    buf = np.ones(nbytes // 4, dtype=np.float32)
    proxy = CountingComm(comm)
    step(as_flat(buf), "sum", proxy)
    return proxy.sent, proxy.received


def formula_bytes(algorithm: str, nbytes: int, size: int) -> int:
    """The bytes rank 0 sends by the formula (``COSTS[...].sent``)."""
    return round(evaluate(COSTS[algorithm].sent, P=size, N=nbytes))


def write(out: str, m: Machine, rows: list, counted: list, P: int) -> None:
    """``out``/model.json (the machine, every row, the counted bytes) and,
    with matplotlib, ``out``/model.png: predicted against measured."""
    import json
    import os

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "model.json"), "w") as f:
        json.dump({"ranks": P, "machine": m.to_dict(), "rows": rows, "bytes": counted}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for i, name in enumerate(sorted({r["algorithm"] for r in rows})):
        pts = sorted((r["size_bytes"], r["measured_us"], r["predicted_us"]) for r in rows if r["algorithm"] == name)
        color = f"C{i}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, markersize=3, label=f"{name} measured")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=color, label=f"{name} model")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time (µs)")
    ax.set_title(f"alpha-beta-gamma model vs measured, {P} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "model.png"))
    plt.close(fig)
