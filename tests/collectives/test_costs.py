"""One source of each algorithm's cost: the formula that the module
docstrings and docs/algorithms.md print is the critical path that
hpcjobs.perfmodel.predict costs."""

import importlib
import re
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcjobs.collectives.costs import COSTS, evaluate
from hpcjobs.perfmodel import Machine, count_bytes, formula_bytes, predict

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
    if P & (P - 1) == 0 or name in ("ring", "tree", "parameter_server"):  # the folds send otherwise
        assert comm.Get_rank() != 0 or sent == formula_bytes(name, nbytes, P)
