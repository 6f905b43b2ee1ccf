"""The alpha-beta-gamma cost model: measure the machine, predict each
algorithm, compare with what it actually does; ``hpcjobs model``.

A message of n bytes costs α + n·β (α: latency, β: seconds per byte on the
wire) and reducing n bytes costs n·γ (Hockney's model with Thakur &
Gropp's reduction term). For N bytes over P ranks (p2 = largest power of two
<= P; folding a non-power of two adds two messages of N and one reduction):

    ring                 2(P-1)α + 2(P-1)/P·Nβ + (P-1)/P·Nγ
    recursive doubling   log2(p2)·(α + Nβ + Nγ)            (+ fold)
    rabenseifner         2·log2(p2)·α + 2(p2-1)/p2·Nβ + (p2-1)/p2·Nγ   (+ fold)
    tree                 2⌈log2 P⌉(α + Nβ) + ⌈log2 P⌉·Nγ
    parameter server     2(P-1)(α + Nβ) + (P-1)·Nγ         (the server's link)
    hierarchical         ring inside a node (L ranks) + ring across M nodes
                         on N/L bytes, each level with its own α, β

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
up every send buffer), not computed, and printed beside 2(P-1)/P·N (ring)
and 2N(P-1) (parameter-server root).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

__all__ = ["Machine", "measure", "predict", "count_bytes", "MODELED"]

MODELED = ("ring", "recursive_doubling", "rabenseifner", "tree", "parameter_server", "hierarchical")


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
    from .collectives._buffers import reducer

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
    """Predicted seconds for ``algorithm`` on ``nbytes`` over ``size`` ranks.

    The formulas of the module docstring, written as the messages and
    reductions on the critical path; ``linear=True`` costs them with the
    fitted α + nβ and nγ, else with the measured per-size costs.
    """
    P, N = size, float(nbytes)
    if P == 1:
        return 0.0

    def msg(n):  # both directions at once (exchanges)
        return m.message(n, linear)

    def one(n):  # one direction (tree and server hops)
        return m.oneway(n, linear)

    def red(n):
        return m.reduce(n, linear)

    p2 = 1 << (P.bit_length() - 1)
    fold = 0.0 if p2 == P else 2 * msg(N) + red(N)
    steps = int(math.log2(p2))
    if algorithm in ("ring", "ring_pipelined"):
        return 2 * (P - 1) * msg(N / P) + (P - 1) * red(N / P)
    if algorithm == "recursive_doubling":
        return steps * (msg(N) + red(N)) + fold
    if algorithm == "rabenseifner":
        halves = [N / (2 << k) for k in range(steps)]  # N/2, N/4, ..., N/p2
        return sum(2 * msg(h) + red(h) for h in halves) + fold
    if algorithm == "tree":
        c = math.ceil(math.log2(P))
        return c * (2 * one(N) + red(N))
    if algorithm == "parameter_server":
        return (P - 1) * (2 * one(N) + red(N))
    if algorithm == "hierarchical":
        L = local_size or P
        M = -(-P // L)
        intra = predict("ring", nbytes, L, m, linear=linear) if L > 1 else 0.0
        inter = predict("ring", nbytes // L, M, m, linear=linear) if M > 1 else 0.0
        return intra + inter
    raise ValueError(f"no model for {algorithm!r}; modeled: {', '.join(MODELED)}")


def count_bytes(algorithm: str, nbytes: int, comm: MPI.Intracomm) -> tuple[int, int]:
    """(sent, received) bytes of this rank in one float32 sum allreduce of
    ``nbytes`` with a flat ``algorithm`` (collective)."""
    from .collectives._buffers import as_flat
    from .collectives.counting import CountingComm
    from .collectives.select import flat_algorithm

    if algorithm in ("hierarchical", "shm"):
        raise ValueError(f"{algorithm} runs on sub-communicators; count_bytes covers the flat algorithms")
    buf = np.ones(nbytes // 4, dtype=np.float32)
    proxy = CountingComm(comm)
    flat_algorithm(algorithm)(as_flat(buf), "sum", proxy)
    return proxy.sent, proxy.received


def _configure(p) -> None:
    from .bench.allreduce import add_sweep_arguments

    add_sweep_arguments(p, factor=4)
    p.add_argument("--out", metavar="DIR", help="write model.json and model.png (predicted vs measured)")


def _main(args) -> int:
    from .bench.allreduce import apply_placement, implementations, run, size_sweep, unchecked_benchmarks
    from .cli import UsageError
    from .comm import print0, private
    from .topology import detect_private

    if args.min_bytes > args.max_bytes or args.factor < 2:
        raise UsageError("need --min-bytes <= --max-bytes and --factor >= 2")
    apply_placement(args)
    unchecked_benchmarks()
    comm = private()
    P = comm.Get_size()
    if P < 2:
        raise UsageError("the cost model needs at least 2 ranks (mpirun -n 2 or more)")
    topo = detect_private(comm)
    print0(f"# hpcjobs model: {P} ranks on {topo.num_nodes} node(s); measuring alpha, beta, gamma")
    m = measure(comm)
    print0(f"#   alpha = {m.alpha * 1e6:.2f} us    beta = {1 / m.beta / 1e9:.2f} GB/s (exchange), "
           f"{1 / m.beta_pingpong / 1e9:.2f} GB/s (ping-pong)    gamma = {1 / m.gamma / 1e9:.2f} GB/s reduced")
    sizes = size_sweep(args.min_bytes, args.max_bytes, args.factor)
    names = [a for a in MODELED if a != "hierarchical" or topo.num_nodes > 1]
    records = run(comm, sizes, implementations(names), iters=args.iters)
    print0("# predicted: the formulas costed with measured per-size message and reduction costs;")
    print0("# linear: the same formulas with the fitted alpha + n*beta and n*gamma")
    print0("#    size(B)  algorithm              measured(us)  predicted(us)   error   linear(us)   error")
    rows = []
    local = topo.local_size if topo.uniform else None
    for r in records:
        pred = predict(r.impl, r.size_bytes, P, m, local) * 1e6
        lin = predict(r.impl, r.size_bytes, P, m, local, linear=True) * 1e6
        err, lin_err = (pred - r.time_us) / r.time_us, (lin - r.time_us) / r.time_us
        rows.append({"size_bytes": r.size_bytes, "algorithm": r.impl, "measured_us": r.time_us,
                     "predicted_us": pred, "rel_error": err, "linear_us": lin, "linear_rel_error": lin_err})
        print0(f"{r.size_bytes:>12}  {r.impl:<20} {r.time_us:>13.1f} {pred:>14.1f} {err:>+7.0%} "
               f"{lin:>12.1f} {lin_err:>+7.0%}")
    print0("# |error| over the rows >= 1 MB, mean (max): per-size model | linear model")
    for name in names:
        big = [x for x in rows if x["algorithm"] == name and x["size_bytes"] >= 1 << 20]
        if big:
            e = [abs(x["rel_error"]) for x in big]
            le = [abs(x["linear_rel_error"]) for x in big]
            print0(f"#   {name:<20} {statistics.mean(e):>4.0%} ({max(e):.0%})  |  "
                   f"{statistics.mean(le):>4.0%} ({max(le):.0%})")
    print0("# bytes sent per rank, counted (rank 0; parameter server: rank 0 is the server):")
    print0("#    size(B)  algorithm            sent(B)  received(B)  formula")
    counted = []
    for nbytes in (1 << 20, 16 << 20):
        for name, formula, want in (
                ("ring", "2(P-1)/P*N sent", 2 * (P - 1) * nbytes // P),
                ("recursive_doubling", "log2(P)*N sent (P power of 2)", int(math.log2(P)) * nbytes),
                ("parameter_server", "2N(P-1) through the root", 2 * nbytes * (P - 1))):
            sent, received = count_bytes(name, nbytes, comm)
            counted.append({"size_bytes": nbytes, "algorithm": name, "sent": sent, "received": received})
            shown = sent + received if name == "parameter_server" else sent
            print0(f"{nbytes:>12}  {name:<20} {sent:>9} {received:>12}  {formula} = {want}"
                   f" ({'matches' if shown == want else f'counted {shown}'})")
    if args.out and comm.Get_rank() == 0:
        _write(args.out, m, rows, counted, P)
        print0(f"# written to {args.out}/model.json and {args.out}/model.png")
    return 0


def _write(out: str, m: Machine, rows: list, counted: list, P: int) -> None:
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


def _register() -> None:
    from .cli import arguments, command

    command("model", "fit alpha/beta/gamma here, predict every algorithm, compare with measured; count bytes")(
        arguments(_configure)(_main))


_register()
