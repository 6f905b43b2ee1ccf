"""What a machine's links and reductions cost, as ``hpcjobs model`` measured
them (:class:`Machine`, read back from its model.json), and the predictions
made from them: :func:`predict` inside one machine, :func:`predict_across`
between nodes. Nothing here starts MPI: ``hpcjobs plan --cost-model`` runs on
a login node. Measuring is :mod:`hpcjobs.perfmodel`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .collectives.costs import COSTS, across_path

__all__ = ["Machine", "MODELED", "costing", "predict", "predict_across"]

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
    """A Machine's costs in the shape ``COSTS[...].path`` takes. ``link``:
    the network's, as :func:`predict_across` costs it -- an exchange costs
    what one direction does, the smallest message's one-way time plus n
    times the largest's one-way time per byte."""

    def __init__(self, m: Machine, linear: bool, link: bool = False):
        self.m, self.linear, self.link = m, linear, link

    def message(self, n: float) -> float:
        if self.link and not self.linear:
            return self.m.oneway_s[0] + n * self.m.oneway_s[-1] / self.m.sizes[-1]
        return self.m.oneway(n, self.linear) if self.link else self.m.message(n, self.linear)

    def oneway(self, n: float) -> float:
        return self.m.oneway(n, self.linear)

    def reduce(self, n: float) -> float:
        return self.m.reduce(n, self.linear)


def costing(m: Machine, link: bool = False, linear: bool = False):
    """``m``'s costs in the :class:`~hpcjobs.collectives.costs.Costing` shape
    (``link``: a network's, as :func:`predict_across` costs it)."""
    return _Costing(m, linear, link)


def predict_across(algorithm: str, nbytes: int, size: int, local_size: int, node: Machine, net: Machine,
                   linear: bool = False, segments: int = 1) -> float | None:
    """Predicted seconds across ``size / local_size`` nodes: the two-level
    path of :data:`hpcjobs.collectives.costs.ACROSS`, messages inside a node
    costed by ``node``, between nodes by ``net``, reductions by ``node``;
    ``segments`` for pipelined hierarchical. None where no path is written.

    Between nodes a message of n bytes costs the smallest message's one-way
    time plus n times the largest's one-way time per byte (``linear``: the
    exchange fit's α + n times the ping-pong fit's β, :meth:`Machine.oneway`),
    and an exchange what one direction does:

    - a host's uplink and downlink are separate, so the algorithms' flows in
      the two directions do not slow each other. What ``measure`` calls an
      exchange -- both directions at once on one connection -- does not
      predict them there: on the emulated cluster at 1 Gbit/s it reached
      0.54 of the rate at 16 MB where one direction reached 0.97, and the
      ring, whose flows each go one way, ran at the rate;
    - a shaped link (a token bucket, as tbf's or a switch's) lets a single
      message of up to its burst through at more than its rate when it has
      been idle, as between ping-pongs (262 KB went at 1.97x the rate), but
      not the back-to-back segments of an algorithm: the per-size curve
      would put pipelined hierarchical below the floor the link's rate sets.
      The largest size measures the sustained rate."""
    return across_path(algorithm, float(nbytes), size, local_size, _Costing(node, linear),
                       _Costing(net, linear, link=True), segments)
