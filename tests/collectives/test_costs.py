"""One source of each algorithm's cost: the formula that the module
docstrings and docs/algorithms.md print is the critical path that
hpcjobs.machine.predict costs."""

import importlib
import re
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcjobs.collectives.costs import ACROSS, COSTS, across_path, evaluate
from hpcjobs.machine import Machine, predict
from hpcjobs.perfmodel import count_bytes, formula_bytes

ROOT = Path(__file__).resolve().parents[2]
MODULE = {"ring_pipelined": "ring"}  # the pipelined ring is the ring's module and formula


class Linear:
    alpha, beta, gamma = 2e-6, 1e-10, 5e-11

    def message(self, n):
        return self.alpha + n * self.beta

    oneway = message

    def reduce(self, n):
        return n * self.gamma


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("name", COSTS)
@pytest.mark.parametrize("P", [2, 3, 4, 5, 6, 8, 12, 16])
def test_the_critical_path_costed_linearly_is_the_formula(name, P):
    c = Linear()
    for L in sorted({1, 2, P // 2 or 1, P}):
        for N in (8.0, 4096.0, float(1 << 24)):
            want = evaluate(COSTS[name].formula, P=P, N=N, L=L, alpha=c.alpha, beta=c.beta, gamma=c.gamma)
            assert COSTS[name].path(N, P, L, c) == pytest.approx(want, rel=1e-12), (P, L, N)


@pytest.mark.parametrize("name", COSTS)
def test_predict_costs_that_path(name):
    sizes = [8, 1 << 20, 64 << 20]
    c = Linear()
    m = Machine(alpha=c.alpha, beta=c.beta, beta_pingpong=c.beta, gamma=c.gamma, dtype="float32", sizes=sizes,
                message_s=[c.message(n) for n in sizes], oneway_s=[c.message(n) for n in sizes],
                reduce_s=[c.reduce(n) for n in sizes])
    for P, L in ((2, 2), (5, 5), (8, 4)):
        want = evaluate(COSTS[name].formula, P=P, N=1 << 20, L=L, alpha=c.alpha, beta=c.beta, gamma=c.gamma)
        assert predict(name, 1 << 20, P, m, L, linear=True) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", COSTS)
def test_each_algorithms_docstring_gives_its_formula(name):
    module = importlib.import_module(f"hpcjobs.collectives.{MODULE.get(name, name)}")
    assert COSTS[name].formula in _flat(module.__doc__), f"{module.__name__}'s docstring lacks the formula"


def test_docs_algorithms_table_gives_every_formula_and_the_bytes_sent():
    rows = {}
    for line in (ROOT / "docs" / "algorithms.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3:
            rows[cells[0]] = cells
    for name, cost in COSTS.items():
        assert name in rows, f"docs/algorithms.md has no row for {name}"
        assert cost.formula in rows[name] and cost.sent in rows[name], rows[name]
        assert (cost.uplink or "–") in rows[name], rows[name]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["ring", "recursive_doubling", "rabenseifner", "tree", "parameter_server"])
def test_the_bytes_formula_is_what_rank_0_sends(name):
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    nbytes = 4 * P * 4096  # whole chunks at every P
    sent, _ = count_bytes(name, nbytes, comm)
    if P & (P - 1) == 0 or name in ("ring", "tree", "parameter_server"):
        assert comm.Get_rank() != 0 or sent == formula_bytes(name, nbytes, P)
    else:  # rank 0 folds in: it sends its buffer once to rank 1, then waits for the result
        assert comm.Get_rank() != 0 or sent == nbytes


class Linked(Linear):
    """The network: slower per message and per byte than inside a node."""
    alpha, beta = 3e-5, 8e-9


@pytest.mark.parametrize("name", [n for n in ACROSS if n != "ring_pipelined"])
@pytest.mark.parametrize("P,L", [(2, 1), (4, 1), (4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (16, 4)])
def test_the_two_level_path_costed_linearly_is_its_formula(name, P, L):
    node, net = Linear(), Linked()
    for N in (8.0, 4096.0, float(1 << 24)):
        got = across_path(name, N, P, L, node, net)
        if got is None:  # powers of two only for these two
            assert name in ("recursive_doubling", "rabenseifner") and (P & (P - 1) or L & (L - 1))
            continue
        want = evaluate(ACROSS[name].formula, P=P, N=N, L=L, alpha=node.alpha, beta=node.beta, gamma=node.gamma,
                        net_alpha=net.alpha, net_beta=net.beta)
        assert got == pytest.approx(want, rel=1e-12), (P, L, N)


def test_across_one_node_and_unwritten_algorithms_have_no_two_level_path():
    node, net = Linear(), Linked()
    assert across_path("ring", 1024, 4, 4, node, net) is None  # one node: the flat model
    assert across_path("tree", 1024, 4, 2, node, net) is None
    assert across_path("ring", 1024, 6, 4, node, net) is None  # unequal nodes


def test_pipelined_hierarchical_overlaps_its_two_levels():
    node, net = Linear(), Linked()
    N, P, L = float(1 << 24), 4, 2
    whole = across_path("hierarchical", N, P, L, node, net)
    piped = across_path("hierarchical", N, P, L, node, net, segments=16)
    node_part = evaluate("2(L-1)α + 2(L-1)/L·Nβ + (L-1)/L·Nγ", P=P, N=N / 16, L=L, alpha=node.alpha,
                         beta=node.beta, gamma=node.gamma) * 16
    net_part = evaluate("2(M-1)A + 2(M-1)/M·N·B + (M-1)/M·(N/L)γ", P=P, N=N / 16, L=L, gamma=node.gamma,
                        net_alpha=net.alpha, net_beta=net.beta) * 16
    assert piped == pytest.approx(max(node_part, net_part) + min(node_part, net_part) / 16, rel=1e-12)
    assert piped < whole


def test_docs_algorithms_gives_every_two_level_formula():
    text = _flat((ROOT / "docs" / "algorithms.md").read_text())
    for name, across in ACROSS.items():
        assert across.formula in text, f"docs/algorithms.md lacks {name}'s two-level formula"


def test_the_network_is_costed_one_way_at_its_sustained_rate():
    """predict_across: between nodes, the smallest one-way time plus n times
    the largest size's one-way time per byte (a token bucket's burst makes
    the sizes between read faster than a stream of them runs)."""
    from hpcjobs.machine import predict_across

    sizes = [8, 1 << 18, 16 << 20]
    node = Machine(alpha=1e-6, beta=1e-10, beta_pingpong=1e-10, gamma=5e-11, dtype="float32", sizes=sizes,
                   message_s=[1e-6 + n * 1e-10 for n in sizes], oneway_s=[1e-6 + n * 1e-10 for n in sizes],
                   reduce_s=[n * 5e-11 for n in sizes])
    burst = [1e-4, (1 << 18) * 4e-9, (16 << 20) * 8e-9]  # the middle size twice as fast per byte
    net = Machine(alpha=1e-4, beta=8e-9, beta_pingpong=8e-9, gamma=5e-11, dtype="float32", sizes=sizes,
                  message_s=[2 * t for t in burst], oneway_s=burst, reduce_s=[n * 5e-11 for n in sizes])
    N, P, L = 1 << 20, 4, 1  # one rank per node: the ring is all network
    per_byte = burst[-1] / sizes[-1]
    want = 2 * (P - 1) * (burst[0] + N / P * per_byte) + (P - 1) * node.reduce(N / P)
    assert predict_across("ring", N, P, L, node, net) == pytest.approx(want, rel=1e-12)
