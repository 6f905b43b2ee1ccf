"""The agreement check on oneshot's segment: one exchange for the check and
a small message together (the carry), a mismatch between a rank that
carries and one that does not, a bad buffer on one rank, and auto's call
count kept the same on every rank. (Every op and dtype, checked and not:
test_oneshot.py.)"""

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.collectives import agreement, allreduce, auto, oneshot, oneshot_allreduce
from hpcjobs.collectives.agreement import SIG_WORDS, MismatchError, checking
from hpcjobs.comm import private


def _calls(comm) -> int:
    """Calls made so far on ``comm``'s segment (the same on every rank; 0
    before it is made)."""
    segments = private(comm).Get_attr(oneshot._KEYVAL)
    return 0 if segments is None else segments.calls


def _fresh():
    """A new communicator over COMM_WORLD: the exchange is chosen per communicator."""
    return MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())


@pytest.mark.mpi(min_size=2)
def test_the_check_carries_a_small_message_in_one_exchange():
    sub = _fresh()
    size = sub.Get_size()
    with checking(True):
        oneshot_allreduce(np.ones(4), comm=sub)  # the segment and the exchange, made
        before = _calls(sub)
        for i in range(20):
            x = np.full(5, float(sub.Get_rank() + i))
            oneshot_allreduce(x, comm=sub)
            np.testing.assert_array_equal(x, sum(r + i for r in range(size)))
        per_call = (_calls(sub) - before) / 20
        big = np.ones(oneshot.MAX_BYTES // 8 + 1)  # two pieces: the check goes alone, then the pieces
        before = _calls(sub)
        oneshot_allreduce(big, comm=sub)
        np.testing.assert_array_equal(big, size)
        big_calls = _calls(sub) - before
    assert agreement.exchange_of(private(sub)) == "segment"
    assert per_call == 1 and big_calls == 3
    sub.Free()


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_carries_and_one_that_does_not_both_raise():
    sub = _fresh()
    rank = sub.Get_rank()
    with checking(True):
        oneshot_allreduce(np.ones(3), comm=sub)
        # rank 0's message fits one slot (carried); the others' does not (check alone)
        x = np.ones(8 if rank == 0 else oneshot.MAX_BYTES // 8 + 5)
        with pytest.raises(MismatchError, match="count differs: rank 0: 8; ") as info:
            oneshot_allreduce(x, comm=sub)
        np.testing.assert_array_equal(x, 1)  # nothing was reduced
        messages = sub.allgather(str(info.value))
        assert len(set(messages)) == 1
        y = np.full(8, 2.0)
        oneshot_allreduce(y, comm=sub)  # and the next call is fine
    np.testing.assert_array_equal(y, 2.0 * sub.Get_size())
    sub.Free()


@pytest.mark.mpi(min_size=2)
def test_a_bad_buffer_on_one_rank_fails_every_rank_and_the_next_call_works():
    sub = _fresh()
    rank = sub.Get_rank()
    with checking(True):
        x = np.ones(6)
        if rank == sub.Get_size() - 1:
            x.flags.writeable = False
        with pytest.raises(MismatchError, match="read-only"):
            allreduce(x, "sum", "oneshot", sub)
        if rank != sub.Get_size() - 1:
            np.testing.assert_array_equal(x, 1)
        y = np.ones(6)
        allreduce(y, "sum", "oneshot", sub)
    np.testing.assert_array_equal(y, sub.Get_size())
    sub.Free()


@pytest.mark.mpi(min_size=2)
def test_auto_counts_carried_calls_alike_on_every_rank(monkeypatch):
    """Where auto keeps oneshot the check carries its calls, and each counts
    toward the next measurement as the step's own would: every rank
    measures again at the same call (a rank that measured while another ran
    the kept algorithm would hang)."""
    monkeypatch.setattr(auto, "REMEASURE_EVERY", 200)
    sub = _fresh()
    size = sub.Get_size()
    auto.remeasure()
    x = np.ones(7)
    with checking(True):
        while not auto.settled(x, "sum", sub):
            x[:] = 1
            allreduce(x, comm=sub)
        timing = auto._decision(x.nbytes, "float64", "sum", sub)
        carried = 0
        for i in range(500):  # two measurements on the way
            if timing.left > 0:
                timing.fn = oneshot.allreduce  # as if it had measured fastest, on every rank alike
            before, left = _calls(sub), timing.left
            x[:] = sub.Get_rank() + i
            allreduce(x, comm=sub)
            np.testing.assert_array_equal(x, sum(r + i for r in range(size)))
            if left > 0:
                assert timing.left == left - 1 and _calls(sub) - before == 1
                carried += 1
            lefts = sub.allgather(timing.left)
            assert len(set(lefts)) == 1, lefts
    assert carried > 100
    sub.Free()


@pytest.mark.mpi(min_size=2)
def test_the_check_over_mpi_allreduce_still_catches_a_mismatch(monkeypatch):
    monkeypatch.setattr(agreement, "_VIA", "mpi")
    sub = _fresh()
    assert agreement.exchange_of(private(sub)) == "mpi"
    with checking(True):
        with pytest.raises(MismatchError, match="dtype differs"):
            allreduce(np.ones(4, np.float32 if sub.Get_rank() else np.float64), comm=sub)
        y = np.ones(4)
        allreduce(y, "sum", "oneshot", sub)
    np.testing.assert_array_equal(y, sub.Get_size())
    sub.Free()


def test_a_long_signature_is_folded_into_the_segments_words():
    fields = tuple(range(40))
    mpi, padded = agreement._encode(fields, False)
    assert len(padded) == SIG_WORDS and padded[0] == 40 and mpi.size == 81
    other = agreement._encode(fields[:-1] + (-1,), False)[1]
    assert other != padded  # a difference past the last whole word still shows
    failed = agreement._encode(fields, True)[1]
    assert failed != padded
    short = agreement._encode(("allreduce_auto", 8, "float32", "sum", "cpu", ""), False)[1]
    assert short[0] == 6 and short[7] == 0 and list(short[8:]) == [0] * (SIG_WORDS - 8)
