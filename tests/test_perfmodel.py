"""The cost model: its formulas, its fit, and bytes counted on the wire."""

import math

import pytest
from mpi4py import MPI

from hpcjobs.perfmodel import Machine, _fit, count_bytes, predict

SIZES = [8, 1024, 1 << 20, 64 << 20]


def _linear_machine(alpha=2e-6, beta=1e-10, gamma=5e-11):
    return Machine(alpha=alpha, beta=beta, beta_pingpong=beta, gamma=gamma, dtype="float32",
                   sizes=SIZES, message_s=[alpha + n * beta for n in SIZES],
                   oneway_s=[alpha + n * beta for n in SIZES], reduce_s=[n * gamma for n in SIZES])


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_linear_predictions_are_the_textbook_formulas(P):
    m = _linear_machine()
    a, b, g, N = m.alpha, m.beta, m.gamma, float(1 << 24)
    p2 = 1 << (P.bit_length() - 1)
    fold = 0 if p2 == P else 2 * (a + N * b) + N * g
    lg = math.log2(p2)
    assert predict("ring", N, P, m, linear=True) == pytest.approx(2 * (P - 1) * a + 2 * (P - 1) / P * N * b
                                                                  + (P - 1) / P * N * g)
    assert predict("recursive_doubling", N, P, m, linear=True) == pytest.approx(lg * (a + N * b + N * g) + fold)
    assert predict("rabenseifner", N, P, m, linear=True) == pytest.approx(
        2 * lg * a + 2 * (p2 - 1) / p2 * N * b + (p2 - 1) / p2 * N * g + fold)
    assert predict("parameter_server", N, P, m, linear=True) == pytest.approx(2 * (P - 1) * (a + N * b)
                                                                              + (P - 1) * N * g)


def test_measured_costs_interpolate_between_sizes_and_scale_beyond():
    m = _linear_machine()
    m.message_s = [1e-6, 2e-6, 100e-6, 8000e-6]
    assert m.message(1024) == pytest.approx(2e-6)
    assert 2e-6 < m.message(32 << 10) < 100e-6
    assert m.message(128 << 20) == pytest.approx(16000e-6)


def test_fit_recovers_alpha_and_beta():
    sizes = [8, 512, 32 << 10, 1 << 20, 16 << 20]
    alpha, beta = _fit(sizes, [3e-6 + n * 2e-10 for n in sizes])
    assert alpha == pytest.approx(3e-6, rel=1e-6) and beta == pytest.approx(2e-10, rel=1e-6)


def test_fit_never_slopes_down_or_starts_below_zero():
    """On a shaped link small messages ride the burst and the best line can slope down: the fit keeps
    beta >= 0 and alpha >= 0 at the constrained optimum instead of printing negative GB/s."""
    sizes = [8, 64, 512, 4096, 32768]
    falling = [10e-6, 9e-6, 8e-6, 7e-6, 6e-6]
    alpha, beta = _fit(sizes, falling)
    w = [1 / t ** 2 for t in falling]  # beta = 0: alpha is the weighted mean of the times
    assert beta == 0.0 and alpha == pytest.approx(sum(wi * t for wi, t in zip(w, falling)) / sum(w), rel=1e-12)
    low_start = [n * 1e-9 for n in sizes]
    low_start[0] /= 2  # the smallest below the line through the origin: the unconstrained alpha is negative
    w = [1 / t ** 2 for t in low_start]
    assert (sum(wi * t for wi, t in zip(w, low_start)) * sum(wi * n * n for wi, n in zip(w, sizes))
            < sum(wi * n for wi, n in zip(w, sizes)) * sum(wi * n * t for wi, n, t in zip(w, sizes, low_start)))
    alpha, beta = _fit(sizes, low_start)  # alpha = 0: beta is the weighted least squares through the origin
    assert alpha == 0.0
    assert beta == pytest.approx(sum(wi * n * t for wi, n, t in zip(w, sizes, low_start))
                                 / sum(wi * n * n for wi, n in zip(w, sizes)), rel=1e-12)


def test_unmodeled_algorithm_is_refused():
    with pytest.raises(ValueError, match="no model for 'shm'"):
        predict("shm", 1024, 2, _linear_machine())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("nbytes", [4096, 1 << 20])
def test_counted_bytes_match_the_formulas(nbytes):
    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    # ring: 2(P-1) chunks of N/P each way (chunks differ by at most one element)
    sent, received = count_bytes("ring", nbytes, comm)
    assert abs(sent - 2 * (P - 1) * nbytes / P) <= 2 * (P - 1) * 4
    assert abs(received - 2 * (P - 1) * nbytes / P) <= 2 * (P - 1) * 4
    # parameter server: 2N(P-1) through rank 0, 2N on every other rank
    sent, received = count_bytes("parameter_server", nbytes, comm)
    assert (sent, received) == ((nbytes * (P - 1),) * 2 if rank == 0 else (nbytes, nbytes))
    # recursive doubling: N per round, log2 P rounds, when P is a power of two
    if P & (P - 1) == 0:
        assert count_bytes("recursive_doubling", nbytes, comm) == (nbytes * int(math.log2(P)),) * 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "ring_pipelined", "recursive_doubling", "rabenseifner"])
def test_uplink_formulas_are_what_each_node_sends_to_the_others(algorithm):
    """costs.uplink_bytes against the bytes counted per destination, for
    every split of this run's ranks into equal nodes of consecutive ranks
    (the layouts whose formula exists). At 4 ranks in nodes of 2,
    Rabenseifner halving far first sent twice its formula."""
    from hpcjobs.collectives.costs import uplink_bytes
    from hpcjobs.collectives.counting import CountingComm
    from hpcjobs.collectives._buffers import as_flat
    from hpcjobs.collectives.messages import message_passing
    import numpy as np

    comm = MPI.COMM_WORLD
    P, N = comm.Get_size(), 1 << 20
    proxy = CountingComm(comm)
    message_passing(algorithm).bound(as_flat(np.ones(N // 4, np.float32)), "sum", proxy)
    sent_to = comm.allgather(proxy.sent_to)  # every rank's bytes by destination
    checked = 0
    for L in range(1, P + 1):
        want = uplink_bytes(algorithm, N, P, L)
        if want is None:
            continue
        for node in range(P // L):
            members = range(node * L, (node + 1) * L)
            off = sum(n for r in members for dest, n in sent_to[r].items() if dest // L != node)
            # the ring's chunks differ by at most one element
            assert abs(off - want) <= 2 * (P - 1) * 4, (algorithm, P, L, node, off, want)
        checked += 1
    # one node of P and P nodes of 1 at least (for the powers-of-two formulas, only P = 2^k has the second)
    assert checked >= (2 if algorithm == "ring" or P & (P - 1) == 0 else 1)
