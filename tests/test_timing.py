"""The one timing loop: interleaved rounds, a fresh order each round, the same on every rank."""

import pytest
from mpi4py import MPI

from hpcjobs.timing import Rounds


@pytest.mark.parametrize("n", [2, 3, 4])
def test_auto_times_its_candidates_in_a_fresh_order_each_round(n):
    """Every round runs every candidate once; over the timed rounds no
    candidate always comes right after the same one (what ran just before a
    call changes its time); and the order is fixed, so every rank has it."""
    rounds, warmup = 5, 2
    order = Rounds(n, warmup, rounds).order
    turns = warmup + rounds
    assert len(order) == n * turns
    assert all(sorted(order[i * n:(i + 1) * n]) == list(range(n)) for i in range(turns))
    timed = order[warmup * n - 1:]  # with the call before the first timed one
    after = {c: {timed[i - 1] for i in range(1, len(timed)) if timed[i] == c} for c in range(n)}
    assert all(len(before) > 1 for before in after.values()), after
    assert Rounds(n, warmup, rounds).order == order


@pytest.mark.mpi(min_size=2)
def test_every_rank_times_the_candidates_in_the_same_order(comm):
    mine = Rounds(4, 2, 15).order
    assert all(theirs == mine for theirs in comm.allgather(mine))




@pytest.mark.mpi(min_size=1)
def test_rounds_time_each_call_after_the_warmup_and_say_which_is_last():
    comm = MPI.COMM_WORLD
    calls = []
    r = Rounds(3, 1, 2)
    assert r.calls == 9 and not r.done
    last = []
    while not r.done:
        j = r.current
        last.append(r.last_call)
        r.call(comm, calls.append, j)
    assert calls == r.order and last == [False] * 6 + [True] * 3
    assert r.times.shape == (2, 3) and (r.times > 0).all()


def test_each_size_and_pass_takes_its_own_orders():
    """Seeded by the count alone, every size and every pass had the same
    orders, so what ran before each call was the same bias everywhere."""
    orders = {seed: Rounds(4, 2, 10, seed).order for seed in [(1024, 0), (1024, 1), (4096, 0), (4096, 1)]}
    assert len({tuple(o) for o in orders.values()}) == 4
    assert Rounds(4, 2, 10, (1024, 1)).order == orders[(1024, 1)]  # the same on every rank
