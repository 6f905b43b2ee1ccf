"""Each algorithm's cost, in one place.

The α-β-γ model (Hockney's, with Thakur & Gropp's reduction term): a message
of n bytes costs α + n·β, reducing n bytes costs n·γ. For N bytes over P ranks:

==================  =====================================================================
symbol              meaning
==================  =====================================================================
p2                  the largest power of two <= P
f                   1 when P is not a power of two (the fold: two more messages of N
                    bytes and one reduction), else 0
L, M                ranks per node and nodes (hierarchical)
⌈x⌉                 x rounded up
==================  =====================================================================

:data:`COSTS` holds, per algorithm, the formula (which every algorithm's
module docstring, ``docs/algorithms.md`` and ``hpcjobs model`` print), the
bytes rank 0 sends, the bytes each node sends off the node (its uplink)
across M nodes of L ranks each, and the critical path as messages and
reductions, which :func:`hpcjobs.machine.predict` costs with measured
per-size costs. A test checks that the critical path with linear costs is
the formula; another that the uplink formula is what the algorithm sends to
other nodes, counted; ``bench allreduce`` across hosts prints it beside
what each host's interface counters saw (:func:`uplink_bytes`).

The uplink formulas assume mpirun's default placement, a node's ranks
consecutive (ranks 0..L-1 on the first node, ...); for recursive doubling
and Rabenseifner P and L must be powers of two (elsewhere the fold and the
pairing depend on the layout, and :func:`uplink_bytes` gives None).

shm has no entry: it sends no messages, and its time is memory traffic
(its module docstring counts it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Protocol

__all__ = ["ACROSS", "Across", "Cost", "COSTS", "Costing", "across_path", "evaluate", "uplink_bytes"]


class Costing(Protocol):
    """Seconds for one step of an algorithm, by size in bytes."""

    def message(self, n: float) -> float:
        """An exchange: n bytes each way at once."""

    def oneway(self, n: float) -> float:
        """One message of n bytes, nothing coming back."""

    def reduce(self, n: float) -> float:
        """Reducing n bytes into n bytes."""


@dataclass(frozen=True)
class Cost:
    formula: str  # seconds, in α, β, γ
    sent: str  # bytes rank 0 sends (P a power of two): the ring's on every rank, the tree's and server's root
    path: Callable[[float, int, int, Costing], float]  # (N, P, L, costing) -> seconds on the critical path
    uplink: str | None = None  # bytes each node sends to other nodes per call (module docstring), None: no formula


def _fold(N: float, P: int, c: Costing) -> float:
    # _fold.fold_in and fold_out: a plain Send one way each, not an exchange
    p2 = 1 << (P.bit_length() - 1)
    return 0.0 if p2 == P else 2 * c.oneway(N) + c.reduce(N)


def _log2_p2(P: int) -> int:
    return P.bit_length() - 1


def _ring(N: float, P: int, L: int, c: Costing) -> float:
    return 2 * (P - 1) * c.message(N / P) + (P - 1) * c.reduce(N / P) if P > 1 else 0.0


def _recursive_doubling(N: float, P: int, L: int, c: Costing) -> float:
    return _log2_p2(P) * (c.message(N) + c.reduce(N)) + _fold(N, P, c)


def _rabenseifner(N: float, P: int, L: int, c: Costing) -> float:
    halves = [N / (2 << k) for k in range(_log2_p2(P))]  # N/2, N/4, ..., N/p2
    return sum(2 * c.message(h) + c.reduce(h) for h in halves) + _fold(N, P, c)


def _tree(N: float, P: int, L: int, c: Costing) -> float:
    return math.ceil(math.log2(P)) * (2 * c.oneway(N) + c.reduce(N))


def _parameter_server(N: float, P: int, L: int, c: Costing) -> float:
    return (P - 1) * (2 * c.oneway(N) + c.reduce(N))


def _hierarchical(N: float, P: int, L: int, c: Costing) -> float:
    M = -(-P // L)
    return _ring(N, L, L, c) + _ring(N / L, M, M, c)


# Hierarchical's pipeline across real nodes (hierarchical.py). Measured on the
# emulated cluster (2 hosts x 2 ranks, 1 Gbit/s links; docs/results/multinode.md,
# "Pipelined hierarchical"): 1 MiB segments took 16 MiB from 1.37x
# MPI_Allreduce's time to 1.01x; at 64 MiB 2 MiB segments did better than 1 MiB
# (1.03x against 1.19x, two runs alike): about 32 segments, none under 1 MiB.
# A segment's network stage is L rings over the M nodes, 2(M-1) steps of
# segment / (L·M) bytes each: the latencies it pays per byte grow with L·M.
# So the floor is per ring step, MIN_STEP_BYTES (the 256 KiB steps of those
# 1 MiB segments at 2 x 2), and a segment at least MIN_STEP_BYTES·L·M: 1 MiB
# at 2 x 2 as measured, 64 MiB at 8 x 32, where 1 MiB segments would send
# 4 KiB messages and pay 62 latencies each.
# On nodes simulated on one host (--ranks-per-node) every step competes for the
# same cores and pipelining cost 13-26%, so there it is off unless asked for.
MIN_STEP_BYTES = 256 << 10
SEGMENTS = 32


def default_segment_bytes(nbytes: int, ranks_per_node: int, nodes: int) -> int:
    """The pipelined path's segment for a buffer of ``nbytes`` across real
    nodes: ``nbytes / SEGMENTS``, at least ``MIN_STEP_BYTES`` per ring step
    across the nodes (``MIN_STEP_BYTES · ranks_per_node · nodes``)."""
    return max(MIN_STEP_BYTES * ranks_per_node * nodes, nbytes // SEGMENTS)


def segment_elements(count: int, itemsize: int, L: int, M: int, simulated: bool,
                     segment_bytes: int | None = None) -> int:
    """Elements per segment of the uniform path for ``count`` elements on
    ``M`` nodes of ``L`` ranks (a multiple of L); the whole main part, count
    // L * L, when not pipelined. ``segment_bytes``: as
    :func:`hierarchical_allreduce` takes it (None: the default, off on
    ``simulated`` nodes)."""
    if segment_bytes is None:  # across hosts the network step waits on a link; on simulated nodes on the CPU
        segment_bytes = 0 if simulated else default_segment_bytes(count * itemsize, L, M)
    return count // L * L if not segment_bytes else max(L, segment_bytes // itemsize // L * L)


def hierarchical_segments(nbytes: float, L: int, M: int, itemsize: int = 4) -> int:
    """The segments hierarchical pipelines ``nbytes`` in across ``M`` real
    nodes of ``L`` ranks, by default (1: one piece, too small to pipeline):
    the node-divisible main part cut as :func:`segment_elements` cuts it."""
    count = int(nbytes) // itemsize
    main = count // L * L
    per = segment_elements(count, itemsize, L, M, False)
    return -(-main // per) if main > per else 1


# Uplinks: the ring crosses each node boundary once (the node's last rank
# sends all it sends to the next node's first); recursive doubling's rounds
# at distance >= L cross (log2 M of them, N from each of the L ranks);
# Rabenseifner halves at the near distances first, so its crossing rounds are
# the small ones (N/2L ... N/P each way, from each of the L ranks);
# hierarchical sends N/L per local rank around the inter-node ring.
_RING = Cost("2(P-1)α + 2(P-1)/P·Nβ + (P-1)/P·Nγ", "2(P-1)/P·N", _ring, "2(P-1)/P·N")
COSTS = {
    "ring": _RING,
    "ring_pipelined": _RING,
    "recursive_doubling": Cost("log2(p2)·(α + Nβ + Nγ) + f·(2α + 2Nβ + Nγ)", "log2(P)·N", _recursive_doubling,
                               "L·log2(M)·N"),
    "rabenseifner": Cost("2log2(p2)·α + 2(p2-1)/p2·Nβ + (p2-1)/p2·Nγ + f·(2α + 2Nβ + Nγ)", "2(P-1)/P·N",
                         _rabenseifner, "2(M-1)/M·N"),
    "tree": Cost("2⌈log2(P)⌉·(α + Nβ) + ⌈log2(P)⌉·Nγ", "⌈log2(P)⌉·N", _tree),
    "parameter_server": Cost("2(P-1)·(α + Nβ) + (P-1)·Nγ", "(P-1)·N", _parameter_server),
    "hierarchical": Cost("2(L-1)α + 2(L-1)/L·Nβ + (L-1)/L·Nγ + 2(M-1)α + 2(M-1)/M·(N/L)β + (M-1)/M·(N/L)γ",
                         "2(L-1)/L·N + 2(M-1)/M·N/L", _hierarchical, "2(M-1)/M·N"),
}
_POWERS_ONLY = ("recursive_doubling", "rabenseifner")  # two-level formulas that need P and L powers of two


def _covers(algorithm: str, P: int, L: int) -> bool:
    """Whether the two-level formulas (uplink, ACROSS) hold for ``P`` ranks
    in equal nodes of ``L`` consecutive ranks."""
    return L >= 1 and P % L == 0 and not (algorithm in _POWERS_ONLY and (P & (P - 1) or L & (L - 1)))


def uplink_bytes(algorithm: str, N: float, P: int, L: int) -> float | None:
    """Bytes each node sends to the others in one allreduce of ``N`` bytes
    by ``algorithm`` over ``P`` ranks, ``L`` per node (consecutive ranks);
    None where no formula covers it (module docstring), 0 on one node."""
    cost = COSTS.get(algorithm)
    if cost is None or cost.uplink is None or L < 1 or P % L:
        return None
    if P == L:
        return 0.0
    return evaluate(cost.uplink, N=N, P=P, L=L) if _covers(algorithm, P, L) else None

# Across nodes: two link classes. α, β are a message inside a node (shared
# memory), A, B one between nodes (the network); M nodes of L consecutive
# ranks, M > 1. Flows that share a node's uplink at once (the L ranks of a
# node in recursive doubling's and Rabenseifner's rounds across, hierarchical's
# L inter-node rings) cost as one message of their total bytes: the uplink's
# bandwidth is what they share. A round whose messages cross the network
# and stay inside nodes at once (every ring round, with L > 1) costs as its
# slowest, the network's. Pipelined hierarchical (S segments) overlaps its
# node steps with its network steps: the longer of the two, plus one
# segment's share of the other for filling and draining the pipeline.
@dataclass(frozen=True)
class Across:
    formula: str  # seconds, in α, β (inside a node), A, B (between nodes), γ
    path: Callable[[float, int, int, "Costing", "Costing"], float]  # (N, P, L, node, network) -> seconds


def _ring_across(N: float, P: int, L: int, node: Costing, net: Costing) -> float:
    return 2 * (P - 1) * net.message(N / P) + (P - 1) * node.reduce(N / P)


def _rd_across(N: float, P: int, L: int, node: Costing, net: Costing) -> float:
    M = P // L
    return (_log2_p2(L) * node.message(N) + _log2_p2(M) * net.message(L * N)
            + _log2_p2(P) * node.reduce(N))


def _rabenseifner_across(N: float, P: int, L: int, node: Costing, net: Costing) -> float:
    near = [N / (2 << k) for k in range(_log2_p2(L))]  # N/2 .. N/L: inside the node
    far = [N / (2 << k) for k in range(_log2_p2(L), _log2_p2(P))]  # N/2L .. N/P: a node's L ranks across at once
    return (sum(2 * node.message(h) + node.reduce(h) for h in near)
            + sum(2 * net.message(L * h) + node.reduce(h) for h in far))


def _hierarchical_node(N: float, L: int, node: Costing) -> float:
    return _ring(N, L, L, node)


def _hierarchical_net(N: float, P: int, L: int, node: Costing, net: Costing) -> float:
    M = P // L
    return 2 * (M - 1) * net.message(N / M) + (M - 1) * node.reduce(N / (L * M))


def _hierarchical_across(N: float, P: int, L: int, node: Costing, net: Costing) -> float:
    return _hierarchical_node(N, L, node) + _hierarchical_net(N, P, L, node, net)


def _pipelined_across(N: float, P: int, L: int, node: Costing, net: Costing, segments: int) -> float:
    a = _hierarchical_node(N / segments, L, node) * segments
    b = _hierarchical_net(N / segments, P, L, node, net) * segments
    return max(a, b) + min(a, b) / segments


ACROSS = {
    "ring": Across("2(P-1)·(A + N/P·B) + (P-1)/P·Nγ", _ring_across),
    "recursive_doubling": Across("log2(L)·(α + Nβ) + log2(M)·(A + L·N·B) + log2(P)·Nγ", _rd_across),
    "rabenseifner": Across("2log2(L)·α + 2(L-1)/L·Nβ + 2log2(M)·A + 2(M-1)/M·N·B + (P-1)/P·Nγ",
                           _rabenseifner_across),
    "hierarchical": Across("2(L-1)α + 2(L-1)/L·Nβ + (L-1)/L·Nγ + 2(M-1)A + 2(M-1)/M·N·B + (M-1)/M·(N/L)γ",
                           _hierarchical_across),
}
ACROSS["ring_pipelined"] = ACROSS["ring"]


def across_path(algorithm: str, N: float, P: int, L: int, node: Costing, net: Costing,
                segments: int = 1) -> float | None:
    """Seconds for ``algorithm`` across M = P/L nodes of L consecutive
    ranks, messages inside a node costed by ``node`` and between nodes by
    ``net``; ``segments`` > 1: hierarchical pipelined in that many. None
    where no two-level path is written (tree, parameter server, unequal or
    non-power-of-two layouts for recursive doubling and Rabenseifner)."""
    if algorithm not in ACROSS or P == L or not _covers(algorithm, P, L):
        return None
    if algorithm == "hierarchical" and segments > 1 and L > 1:
        return _pipelined_across(N, P, L, node, net, segments)
    return ACROSS[algorithm].path(N, P, L, node, net)


_TOKEN = re.compile(r"\s*(log2|p2|[PNLMfαβγAB]|\d+|[()+\-/·⌈⌉])")
_NAMES = {"α": "alpha", "β": "beta", "γ": "gamma", "A": "net_alpha", "B": "net_beta", "⌈": "ceil(", "⌉": ")",
          "·": "*"}


def _python(formula: str) -> str:
    """The formula as a Python expression: names spelled out, implicit
    products made explicit ("2(P-1)/P·Nβ" -> "2*(P-1)/P*N*beta")."""
    tokens, pos = [], 0
    while pos < len(formula.rstrip()):
        m = _TOKEN.match(formula, pos)
        if not m:
            raise ValueError(f"cannot read {formula!r} at {formula[pos:]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    out = []
    for prev, tok in zip([None, *tokens], tokens):
        ends_value = prev is not None and (prev[0].isalnum() or prev in ("α", "β", "γ", ")", "⌉")) and prev != "log2"
        starts_value = tok[0].isalnum() or tok in ("α", "β", "γ", "(", "⌈")
        if ends_value and starts_value:
            out.append("*")
        out.append(_NAMES.get(tok, tok))
    return "".join(out)


def evaluate(formula: str, **values: float) -> float:
    """A formula of this module at the given ``P``, ``N``, ``alpha`` ... ;
    ``p2`` and ``f`` follow from ``P``, ``M`` from ``P`` and ``L``."""
    P = int(values["P"])
    p2 = 1 << (P.bit_length() - 1)
    scope = {"p2": p2, "f": int(p2 != P), "ceil": math.ceil, "log2": math.log2, **values}
    if "L" in values:
        scope["M"] = -(-P // int(values["L"]))
    return eval(_python(formula), {"__builtins__": {}}, scope)  # our own formulas, above
