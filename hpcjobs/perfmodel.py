"""The alpha-beta-gamma cost model: measure the machine, predict each
algorithm, compare with what it actually does (``hpcjobs model`` prints it).

A message of n bytes costs α + n·β (α: latency, β: seconds per byte on the
wire) and reducing n bytes costs n·γ. Each algorithm's formula and its
critical path are in :data:`hpcjobs.collectives.costs.COSTS`, the one place
they are written; :func:`predict` costs that path. The measured Machine and
the predictions live in :mod:`hpcjobs.machine`, which starts no MPI (the
planner reads a model.json on a login node); they are re-exported here.

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

import numpy as np
from mpi4py import MPI

from ._files import atomic_write
from ._nnls import nonnegative_line
from ._plots import MISSING, pyplot
from .comm import exchange
from .collectives._buffers import as_flat, reducer
from .collectives.costs import COSTS, evaluate
from .collectives.counting import CountingComm
from .collectives.messages import message_passing
from .machine import MODELED, Machine, costing, predict, predict_across

__all__ = ["Machine", "costing", "link_gbps", "measure", "measure_links", "predict", "predict_across", "compare",
           "compare_across", "count_bytes", "formula_bytes", "write", "MODELED"]


def _fit(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Least squares of t = α + n·β, weighted by 1/t so small messages (α)
    and large ones (β) both count, with α, β >= 0: on a shaped link the
    small messages ride the token bucket's burst, and the unconstrained
    line can slope down (a negative β, 'negative GB/s')."""
    n = np.array(sizes, dtype=np.float64)
    t = np.array(times, dtype=np.float64)
    beta, alpha = nonnegative_line(n, t, 1.0 / t ** 2)
    return alpha, beta


def _exchange_times(comm: MPI.Intracomm, sizes: list[int], both: bool, reps: int,
                    pair: tuple[int, int] = (0, 1)) -> list[float]:
    """One-way time per size between the ranks of ``pair`` (the first of
    which reports): half a ping-pong round trip (``both=False``) or one
    simultaneous exchange (``both=True``)."""
    rank = comm.Get_rank()
    first, second = pair
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
            if rank in pair:
                peer = second if rank == first else first
                if both:
                    exchange(comm, send, peer, recv, peer, 21)
                elif rank == first:
                    comm.Send(send, peer, 21)
                    comm.Recv(recv, peer, 21)
                else:
                    comm.Recv(recv, peer, 21)
                    comm.Send(send, peer, 21)
            dt = MPI.Wtime() - t0
            if i >= 2:
                samples.append(dt if both else dt / 2)
        t = np.array([statistics.median(samples)])
        comm.Bcast(t, root=first)
        out.append(float(t[0]))
    return out


def measure(comm: MPI.Intracomm, dtype: str = "float32", reps: int = 20, pair: tuple[int, int] = (0, 1),
            max_bytes: int = 64 << 20) -> Machine:
    """Fit α, β (ping-pong and exchange, between the ranks of ``pair``)
    and γ on ``comm`` (collective; needs at least 2 ranks); messages up to
    ``max_bytes``."""
    if comm.Get_size() < 2:
        raise ValueError("the cost model needs at least 2 ranks to measure α and β")
    sizes = [8 << (3 * k) for k in range(8)] + [16 << 20, 32 << 20, 64 << 20]  # 8 B .. 64 MB
    sizes = sorted(n for n in set(sizes) if n <= max_bytes)
    oneway = _exchange_times(comm, sizes, both=False, reps=reps, pair=pair)
    _, b_pp = _fit(sizes, oneway)  # one-way alpha: the exchange fit gives the one predictions use
    exchange = _exchange_times(comm, sizes, both=True, reps=reps, pair=pair)
    a_x, b_x = _fit(sizes, exchange)
    reduce_s = _reduce_times(comm, sizes, dtype, reps)
    return Machine(alpha=a_x, beta=b_x, beta_pingpong=b_pp, gamma=_per_byte_at(16 << 20, sizes, reduce_s),
                   dtype=dtype, sizes=sizes, message_s=exchange, oneway_s=oneway, reduce_s=reduce_s)


def _per_byte_at(n: int, sizes: list, costs: list) -> float:
    """Seconds per byte at ``n`` bytes if measured there, else at the largest size measured."""
    i = sizes.index(n) if n in sizes else len(sizes) - 1
    return costs[i] / sizes[i]


def _next_node_rank(comm: MPI.Intracomm, topo) -> int | None:
    """The first rank not on rank 0's node, or None on one node (collective)."""
    nodes = comm.allgather(topo.node_id)
    return next((r for r, n in enumerate(nodes) if n != nodes[0]), None)


def link_gbps(comm: MPI.Intracomm, topo, nbytes: int = 16 << 20, reps: int = 3) -> float | None:
    """The network's sustained one-way rate in Gbit/s: ``nbytes`` between
    rank 0 and the first rank of the next node, median of ``reps``
    (collective); None on one node."""
    other = _next_node_rank(comm, topo)
    if other is None:
        return None
    t = _exchange_times(comm, [nbytes], both=False, reps=reps, pair=(0, other))[0]
    return nbytes * 8 / t / 1e9


# Across nodes the network is measured to 16 MB with fewer repetitions: a
# 64 MB ping-pong over a 1 Gbit/s link takes a second, and the per-byte cost
# of a link is flat beyond a few MB (larger sizes extrapolate linearly).
NETWORK_MAX_BYTES = 16 << 20
NETWORK_REPS = 6


def measure_links(comm: MPI.Intracomm, topo, dtype: str = "float32", reps: int = 20) -> tuple[Machine, Machine]:
    """The two link classes of ``comm``'s ranks on ``topo``'s nodes
    (collective; more than one node): (inside a node, between nodes). Inside:
    ranks 0 and 1 if they share a node (else the network's machine stands in:
    a node of one rank sends nothing inside it); between: rank 0 and the
    first rank of the next node."""
    other = _next_node_rank(comm, topo)
    if other is None:
        raise ValueError("measure_links needs ranks on more than one node")
    net = measure(comm, dtype, NETWORK_REPS, pair=(0, other), max_bytes=NETWORK_MAX_BYTES)
    node = measure(comm, dtype, reps, pair=(0, 1)) if other > 1 else net
    return node, net


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


def compare_across(records, size: int, local_size: int, node: Machine, net: Machine,
                   segments=lambda nbytes: 1) -> list[dict]:
    """Each benchmark record against the two-level model (as :func:`compare`);
    records without a two-level path are left out. ``segments(nbytes)``:
    how many hierarchical runs in."""
    rows = []
    for r in records:
        name = r.impl.split("/")[0]
        seg = segments(r.size_bytes) if r.impl == "hierarchical" else 1
        pred = predict_across(name, r.size_bytes, size, local_size, node, net, segments=seg)
        if pred is None:
            continue
        lin = predict_across(name, r.size_bytes, size, local_size, node, net, linear=True, segments=seg)
        rows.append({"size_bytes": r.size_bytes, "algorithm": r.impl, "measured_us": r.time_us,
                     "predicted_us": pred * 1e6, "rel_error": (pred * 1e6 - r.time_us) / r.time_us,
                     "linear_us": lin * 1e6, "linear_rel_error": (lin * 1e6 - r.time_us) / r.time_us,
                     "segments": seg})
    return rows


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


def write(out: str, m: Machine, rows: list, counted: list, P: int, node: Machine | None = None,
          ranks_per_node: int | None = None, source: str | None = None) -> str:
    """``out``/model.json (the machine, every row, the counted bytes) and,
    with matplotlib, ``out``/model.png: predicted against measured. Across
    nodes ``m`` is the network's machine and ``node`` the one inside a node,
    measured with ``ranks_per_node`` (1: the network's stands in), the
    nodes found by ``source`` (topology's: "override" where --ranks-per-node
    simulated them on one machine). Returns what was written, in words."""
    import json
    import os

    os.makedirs(out, exist_ok=True)
    data = {"ranks": P, "machine": m.to_dict(), "rows": rows, "bytes": counted}
    if node is not None:
        data["node_machine"] = node.to_dict()
    if ranks_per_node is not None:
        data["ranks_per_node"] = ranks_per_node
    if source is not None:
        data["topology_source"] = source
    with atomic_write(os.path.join(out, "model.json")) as f:
        json.dump(data, f, indent=1)
    plt = pyplot()
    if plt is None:
        return f"{out}/model.json (no model.png: {MISSING})"
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
    return f"{out}/model.json and {out}/model.png"
