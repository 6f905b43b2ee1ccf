"""``hpcjobs plan``: how many devices, which algorithm, what it costs --
predicted from measurements (Hemingway's split, Optimus's fits, Pollux's
statistical efficiency).

The **system model** (:func:`iteration`): one data-parallel step on P devices
is the forward pass, the backward pass, and the optimizer's update. The
gradients are reduced in buckets as :class:`~hpcjobs.training.DistributedOptimizer`
makes them (parameters in reverse order, a bucket closed once it holds
``fusion_bytes``), each launched when its last gradient is ready and after
the bucket before it, one at a time; a bucket's allreduce costs what the
α-β-γ model says for the algorithm (:data:`hpcjobs.collectives.costs.COSTS`
inside a node, the two-level :data:`~hpcjobs.collectives.costs.ACROSS`
across nodes). The step ends when backward and the last bucket are both
done, then the update runs:

    iteration = forward + max(backward, last bucket's end - forward) + update

and without overlap ``forward + backward + Σ buckets + update``. When each
gradient is ready comes from a measured run (``--measure``: a hook on every
parameter), or, given only a throughput, from the assumption that backward
produces the gradient's bytes at an even rate over the backward share of
the step (2/3 by default: backward costs about twice forward).

Compression changes the bytes: a summable compressor's payload goes through
the allreduce, the others' through a ring allgather of every rank's payload
((P - 1) messages of one payload). A :class:`Payload` may also charge each
bucket its compress-and-decompress time and its own cost per byte reduced
(``hpcjobs plan --compression --measure`` times both here, the payload
reduced as the collectives reduce it). Other
compute time this model leaves out.

The **black-box cross-check** (:func:`fit_runs`, after Optimus's resource-speed
model): iteration time fitted to runs at a few device counts as
θ0 + θ1·2(P-1)/P + θ2·(P-1) (compute, a ring's bandwidth term, its latency
term), θ >= 0, with as many terms as there are distinct counts (at most
three). It knows nothing of the network, so it cannot carry a fit to other
hardware -- which is why the system model is the prediction.

The **statistical side**: epochs to a target loss at the run's global batch
come from Optimus's loss model (:mod:`hpcjobs.convergence`) fitted to a
``train --metrics`` file; at P devices the global batch is P·b, and with a
gradient noise scale (``train --noise-scale``) the epochs grow as
:func:`~hpcjobs.convergence.epochs_factor` says. Time to target = epochs ×
samples per epoch / samples per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .collectives.costs import COSTS, across_path, hierarchical_segments

__all__ = ["ALGORITHMS", "Linear", "Network", "Payload", "Target", "Workload", "allgather_s", "allreduce_s",
           "bucket_sizes", "fit_runs", "flat_shapes", "iteration", "plan", "recommend"]

# What the planner can cost: every modeled algorithm (the pipelined ring costs as the ring).
ALGORITHMS = tuple(name for name in COSTS if name != "ring_pipelined")
BACKWARD_SHARE = 2 / 3  # of a step's compute, when nothing was measured


@dataclass(frozen=True)
class Linear:
    """A link's costs: α seconds per message, β seconds per byte, γ seconds
    per byte reduced (the :class:`~hpcjobs.collectives.costs.Costing` shape)."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def message(self, n: float) -> float:
        return self.alpha + n * self.beta

    def oneway(self, n: float) -> float:
        return self.alpha + n * self.beta

    def reduce(self, n: float) -> float:
        return n * self.gamma


@dataclass(frozen=True)
class Payload:
    """What a compressor sends for a bucket: ``nbytes(bytes, shape)`` per
    device (a tuple of its parts' bytes where it sends several: a summable
    one's are allreduced one after another, as PowerSGD's P and Q are), through
    an allreduce (``summable``) or an allgather of ``parts``
    arrays a device (after a ring allgather of their sizes, as
    ``ring.allgatherv`` does); ``fusable``: buckets may hold several tensors;
    ``codec_s(bytes, shape, P)``: seconds to compress it and decode the
    result at P devices (an allgather's: every device's payload decompressed
    and added); ``reduce_s_per_byte``: seconds to reduce a byte of the
    payload's dtype (None: the links' γ)."""

    nbytes: object
    summable: bool
    fusable: bool
    codec_s: object = None
    reduce_s_per_byte: float | None = None
    parts: int = 1


class _Reducing:
    """A Costing whose reductions cost ``per_byte`` seconds a byte."""

    def __init__(self, base, per_byte: float):
        self.base, self.per_byte = base, per_byte

    def message(self, n: float) -> float:
        return self.base.message(n)

    def oneway(self, n: float) -> float:
        return self.base.oneway(n)

    def reduce(self, n: float) -> float:
        return n * self.per_byte


@dataclass(frozen=True)
class Network:
    """``devices_per_node`` devices share a node (costed by ``node``); nodes
    talk through ``net`` (None: one node only)."""

    devices_per_node: int
    node: object  # a Costing
    net: object | None = None


@dataclass(frozen=True)
class Workload:
    """One device's step at ``batch`` samples: seconds forward, backward
    and update, and each gradient tensor in the order backward makes them:
    its bytes, the fraction of backward after which it is ready, its shape."""

    batch: int
    forward_s: float
    backward_s: float
    update_s: float
    tensors: tuple  # ((bytes, ready fraction of backward in [0, 1], shape), ...) in backward order
    grad_bytes: int = field(init=False)

    def __post_init__(self):
        if self.batch < 1 or min(self.forward_s, self.backward_s, self.update_s) < 0 or not self.tensors:
            raise ValueError("a workload needs a batch >= 1, non-negative times and at least one tensor")
        object.__setattr__(self, "grad_bytes", int(sum(t[0] for t in self.tensors)))

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.update_s

    @classmethod
    def from_throughput(cls, shapes: list, throughput: float, batch: int, bytes_per_param: int = 4,
                        backward_share: float = BACKWARD_SHARE) -> "Workload":
        """From one device's ``throughput`` (samples/s) at ``batch`` and the
        gradient's tensor ``shapes`` in backward order: their bytes made at
        an even rate over the backward share of the step, the update inside
        the step."""
        if not (shapes and throughput > 0 and 0 < backward_share <= 1 and batch >= 1):
            raise ValueError("tensors, throughput > 0, batch >= 1 and 0 < backward_share <= 1 are needed")
        step = batch / throughput
        sizes = [int(np.prod(s)) * bytes_per_param for s in shapes]
        done = (np.cumsum(sizes) / sum(sizes)).tolist()
        return cls(batch, step * (1 - backward_share), step * backward_share, 0.0,
                   tuple(zip(sizes, done, (tuple(s) for s in shapes))))


def flat_shapes(params: int, chunk: int = 1 << 18) -> list[tuple[int]]:
    """``params`` parameters as 1-D tensors of ``chunk`` (a model known only
    by its size)."""
    if params < 1:
        raise ValueError(f"params must be >= 1, got {params}")
    return [(chunk,)] * (params // chunk) + ([(params % chunk,)] if params % chunk else [])


def bucket_sizes(workload: Workload, fusion_bytes: int, fused: bool = True) -> list[tuple]:
    """(bytes, ready fraction, shape) of each bucket, as ``buckets.layout``
    closes them: once it holds ``fusion_bytes`` (every tensor its own with
    ``fused=False``); ready when its last tensor is; the shape is the
    tensor's for a bucket of one, else the flat buffer's."""
    out, acc, n = [], 0, 0
    for i, (nbytes, ready, shape) in enumerate(workload.tensors):
        acc, n = acc + nbytes, n + 1
        if not fused or acc >= fusion_bytes or i == len(workload.tensors) - 1:
            elem = max(1, nbytes // max(1, int(np.prod(shape))))  # bytes per element
            out.append((acc, ready, tuple(shape) if n == 1 else (acc // elem,)))
            acc, n = 0, 0
    return out


def _layout(P: int, net: Network) -> int:
    """Devices per node at P devices (P itself on one node)."""
    G = net.devices_per_node
    if P <= G:
        return P
    if P % G:
        raise ValueError(f"{P} devices do not fill nodes of {G}: give multiples of --devices-per-node above one node")
    if net.net is None:
        raise ValueError(f"{P} devices need {P // G} nodes of {G} (--devices-per-node), and no network between "
                         "nodes was given (--inter-bw, or a --cost-model measured across nodes)")
    return G


def allreduce_s(nbytes: float, P: int, net: Network, algorithm: str = "auto") -> tuple[float, str]:
    """Seconds to allreduce ``nbytes`` over ``P`` devices, and the algorithm
    costed ("auto": the cheapest that has a formula for this layout).

    Raises:
        ValueError: an unknown algorithm, one without a formula for this
            layout, or devices that do not fill nodes.
    """
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from auto, {', '.join(ALGORITHMS)}")
    if P == 1:
        return 0.0, "none"
    L = _layout(P, net)
    best = None
    for name in (ALGORITHMS if algorithm == "auto" else (algorithm,)):
        t = (COSTS[name].path(float(nbytes), P, L, net.node) if L == P
             else across_path(name, float(nbytes), P, L, net.node, net.net,
                              hierarchical_segments(nbytes, L, P // L) if name == "hierarchical" else 1))
        if t is not None and (best is None or t < best[0]):
            best = (t, name)
    if best is None:
        raise ValueError(f"{algorithm} has no two-level formula for {P} devices in nodes of {L} "
                         "(recursive doubling and Rabenseifner need powers of two; tree and parameter_server "
                         "are single-node formulas)")
    return best


def allgather_s(nbytes: float, P: int, net: Network, parts: int = 1) -> float:
    """A ring allgather of ``nbytes`` per device in ``parts`` arrays, as
    ``ring.allgatherv`` runs it: P - 1 steps of the size table's rows (8
    bytes an array), then P - 1 of one payload, each at the slowest link it
    crosses."""
    if P == 1:
        return 0.0
    L = _layout(P, net)
    link = net.node if L == P else net.net
    return (P - 1) * (link.message(8.0 * parts) + link.message(float(nbytes)))


def iteration(workload: Workload, P: int, net: Network, algorithm: str = "auto", overlap: bool = True,
              fusion_bytes: int = 1 << 20, payload: Payload | None = None) -> dict:
    """The system model (module docstring) at ``P`` devices, uncompressed or
    with a compressor's :class:`Payload`. Returns ``iteration_s``,
    ``compute_s``, ``comm_s`` (the buckets' allreduce time, summed),
    ``exposed_s`` (what did not hide), ``algorithm`` (the one that carried
    the most bytes: ``auto`` picks per bucket), ``algorithms`` (bytes each
    carried) and ``buckets``."""
    buckets = bucket_sizes(workload, fusion_bytes, fused=payload is None or payload.fusable)
    if payload is not None and payload.reduce_s_per_byte is not None:
        net = Network(net.devices_per_node, _Reducing(net.node, payload.reduce_s_per_byte),
                      net.net and _Reducing(net.net, payload.reduce_s_per_byte))
    costs, carried = [], {}
    for nbytes, _, shape in buckets:
        sizes = payload.nbytes(nbytes, shape) if payload else nbytes
        sizes = sizes if isinstance(sizes, tuple) else (sizes,)
        if payload is None or payload.summable:
            each = [allreduce_s(n, P, net, algorithm) for n in sizes]  # (seconds, algorithm) of each part
            t, used = sum(s for s, _ in each), each[sizes.index(max(sizes))][1]
        else:
            t, used = allgather_s(sum(sizes), P, net, payload.parts), "allgather"
        if P == 1:
            used = "none"  # one device: nothing reduced or gathered
        carried[used] = carried.get(used, 0) + nbytes
        if payload is not None and payload.codec_s is not None and P > 1:
            t += payload.codec_s(nbytes, shape, P)
        costs.append(t)
    f, b, u = workload.forward_s, workload.backward_s, workload.update_s
    if P == 1 and payload is None:
        costs = [0.0] * len(buckets)  # one device: nothing reduced (the optimizer copies nothing either)
    if overlap:
        end = f
        for (_, ready, _), t in zip(buckets, costs):
            end = max(end, f + ready * b) + t
        total = max(f + b, end) + u
    else:
        total = f + b + sum(costs) + u
    return {"iteration_s": total, "compute_s": workload.step_s, "comm_s": float(sum(costs)),
            "exposed_s": total - workload.step_s, "algorithm": max(carried, key=carried.get, default="none"),
            "algorithms": carried, "buckets": len(buckets)}


def fit_runs(runs: list[tuple[int, float]]) -> tuple[list[float], object]:
    """Optimus-style black-box fit of iteration seconds at device counts
    ``runs`` [(P, seconds), ...]: θ >= 0 for θ0 + θ1·2(P-1)/P + θ2·(P-1),
    with as many terms as distinct counts. Returns (θ, predict(P)).

    Raises:
        ValueError: no runs, or a non-positive count or time.
    """
    if not runs or any(p < 1 or not t > 0 for p, t in runs):
        raise ValueError("the black-box fit needs runs as (devices >= 1, seconds > 0)")
    P = np.array([p for p, _ in runs], dtype=float)
    y = np.array([t for _, t in runs], dtype=float)
    columns = [np.ones_like(P), 2 * (P - 1) / P, P - 1][:min(3, len(set(P.tolist())))]
    A = np.stack(columns, axis=1)
    best = None
    for mask in range(1, 1 << A.shape[1]):  # non-negative least squares by trying every support
        keep = [i for i in range(A.shape[1]) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(A[:, keep], y, rcond=None)
        if np.any(sol < 0):
            continue
        theta = np.zeros(A.shape[1])
        theta[keep] = sol
        err = float(np.sum((A @ theta - y) ** 2))
        if best is None or err < best[0] - 1e-18:
            best = (err, theta)
    theta = [float(v) for v in best[1]] + [0.0] * (3 - A.shape[1])

    def predict(p: int) -> float:
        return theta[0] + theta[1] * 2 * (p - 1) / p + theta[2] * (p - 1)

    return theta, predict


@dataclass(frozen=True)
class Target:
    """Time to a target loss: ``epochs`` (low, high) at ``base_batch``,
    ``samples_per_epoch``, and the gradient noise scale (None: unknown)."""

    loss: float
    epochs: float
    low: float
    high: float
    base_batch: int
    samples_per_epoch: int
    noise_scale: float | None


def plan(workload: Workload, devices: list[int], net: Network, algorithm: str = "auto", overlap: bool = True,
         fusion_bytes: int = 1 << 20, payload: Payload | None = None, target: Target | None = None,
         fitted=None) -> list[dict]:
    """One row per device count: the system model's iteration, samples/s,
    efficiency (samples/s over devices × one device's), the black-box fit's
    iteration (``fitted``: :func:`fit_runs`'s predictor), and with a
    ``target`` the predicted epochs, time and device-hours to it."""
    from .convergence import epochs_factor

    one = workload.batch / workload.step_s
    rows = []
    for P in devices:
        r = iteration(workload, P, net, algorithm, overlap, fusion_bytes, payload)
        rate = P * workload.batch / r["iteration_s"]
        row = {"devices": P, "nodes": max(1, P // net.devices_per_node) if P > net.devices_per_node else 1,
               "global_batch": P * workload.batch, **r, "samples_per_s": rate, "efficiency": rate / (P * one)}
        if fitted is not None:
            row["fit_iteration_s"] = fitted(P)
        if target is not None:
            factor = epochs_factor(target.noise_scale, target.base_batch, P * workload.batch)
            for key, epochs in (("epochs", target.epochs), ("epochs_low", target.low),
                                ("epochs_high", target.high)):
                row[key] = epochs * factor
            secs = row["epochs"] * target.samples_per_epoch / rate
            row.update({"time_to_target_s": secs, "device_hours": secs * P / 3600})
        rows.append(row)
    return rows


def recommend(rows: list[dict], slack: float = 0.10) -> dict:
    """The fastest device count (least time to target, else most samples/s)
    and the cheapest within ``slack`` of it: the fewest device-hours, else
    the highest efficiency (device-hours per sample are 1 / efficiency; not
    always the fewest devices: a power of two can beat the count below it),
    ties to fewer devices."""
    finite = [r for r in rows if "time_to_target_s" in r and math.isfinite(r["time_to_target_s"])]
    if finite:
        fastest = min(finite, key=lambda r: r["time_to_target_s"])
        near = [r for r in finite if r["time_to_target_s"] <= fastest["time_to_target_s"] * (1 + slack)]
        cheapest = min(near, key=lambda r: (r["device_hours"], r["devices"]))
        by = "time to target"
    else:
        fastest = max(rows, key=lambda r: r["samples_per_s"])
        near = [r for r in rows if r["samples_per_s"] >= fastest["samples_per_s"] / (1 + slack)]
        cheapest = min(near, key=lambda r: (-r["efficiency"], r["devices"]))
        by = "samples/s"
    return {"fastest": fastest["devices"], "cheapest_within": slack, "cheapest": cheapest["devices"], "by": by}
