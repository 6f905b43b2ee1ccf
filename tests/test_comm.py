"""Private communicators and the world-size check."""

import os
import re

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.comm import SETTINGS, agree, exchange, expect_world_size, private, world


@pytest.mark.mpi(min_size=1)
def test_private_duplicate_is_cached_and_distinct_from_the_user_comm():
    w = world()
    assert w is world() and w is private(MPI.COMM_WORLD)
    assert MPI.Comm.Compare(w, MPI.COMM_WORLD) == MPI.CONGRUENT


@pytest.mark.mpi(min_size=1)
def test_private_duplicate_of_a_sub_communicator_is_freed_with_it():
    sub = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
    dup = private(sub)
    assert dup.Get_size() == sub.Get_size() and private(sub) is dup
    sub.Free()
    assert dup == MPI.COMM_NULL
    with pytest.raises(ValueError, match="COMM_NULL"):  # the last call's communicator, freed: not served from memory
        private(sub)


@pytest.mark.mpi(min_size=1)
def test_each_communicator_keeps_its_own_duplicate_call_after_call():
    """private() remembers the last communicator asked for; two used in
    turn, and a private duplicate passed back in, each get their own."""
    a = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
    b = MPI.COMM_WORLD.Split(0, -MPI.COMM_WORLD.Get_rank())
    da, db = private(a), private(b)
    assert da is not db and MPI.Comm.Compare(da, a) == MPI.CONGRUENT and MPI.Comm.Compare(db, b) == MPI.CONGRUENT
    assert all(x is y for x, y in zip([private(c) for c in (a, b, a, a, b)], [da, db, da, da, db]))
    ddb = private(db)  # the bench hands the suite's own duplicate back: a duplicate of it, cached too
    assert ddb is not db and private(db) is ddb and private(b) is db
    a.Free()
    b.Free()


def test_comm_null_and_non_communicators_are_refused():
    with pytest.raises(ValueError, match="COMM_NULL"):
        private(MPI.COMM_NULL)
    with pytest.raises(TypeError, match="mpi4py communicator"):
        private("world")


def test_expected_world_size_mismatch_fails_loudly(monkeypatch):
    monkeypatch.setenv("HPCJOBS_EXPECT_WORLD_SIZE", str(MPI.COMM_WORLD.Get_size() + 1))
    with pytest.raises(RuntimeError, match="did not find each other"):
        expect_world_size()
    monkeypatch.setenv("HPCJOBS_EXPECT_WORLD_SIZE", str(MPI.COMM_WORLD.Get_size()))
    expect_world_size()
    monkeypatch.setenv("HPCJOBS_EXPECT_WORLD_SIZE", "four")
    with pytest.raises(RuntimeError, match="not an integer"):
        expect_world_size()


@pytest.mark.mpi(min_size=1)
def test_agree_names_the_entries_that_differ_across_ranks():
    comm = MPI.COMM_WORLD
    values = np.array([7, comm.Get_rank(), 3], dtype=np.int64)
    assert agree(values, comm).tolist() == [True, comm.Get_size() == 1, True]


class _Recording:
    """The real communicator, with the names of the point-to-point calls made on it."""

    def __init__(self, comm):
        self._comm, self.calls = comm, []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name in ("Sendrecv", "Isend", "Irecv", "Recv", "Send"):
            self.calls.append(name)
        return attr


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("nbytes, calls", [(8, ["Sendrecv"]), ((64 << 10) - 4, ["Sendrecv"]),
                                           (64 << 10, ["Isend", "Recv"]), (1 << 20, ["Isend", "Recv"])])
def test_exchange_swaps_and_shifts_every_byte_posting_a_long_swaps_send_first(nbytes, calls):
    """A pair swap (rank r with r ^ 1; the last rank of an odd count sits
    out) and a shift to the right neighbour deliver every byte. From 64 KiB a
    swap with one partner is Isend, then Recv (the order that keeps both
    directions moving over TCP; docs/results/multinode.md, "Pairs that take
    turns"); shorter swaps and shifts around a ring of 3 or more are one
    Sendrecv. A pair whose two sizes fall on either side of 64 KiB still
    swaps every byte."""
    comm = private(MPI.COMM_WORLD)
    rank, size = comm.Get_rank(), comm.Get_size()
    n = nbytes // 4

    def payload(r, count=n):
        return np.arange(count, dtype=np.int32) * 7 + r

    partner = rank ^ 1
    if partner < size:
        recording = _Recording(comm)
        got = np.full(n, -1, dtype=np.int32)
        exchange(recording, payload(rank), partner, got, partner, 5)
        assert recording.calls == calls
        assert np.array_equal(got, payload(partner))
        # one side 64 KiB, the other 4 bytes less: one path each, and no wait on either
        mine, theirs = (16 << 10) - rank % 2, (16 << 10) - partner % 2
        got = np.full(theirs, -1, dtype=np.int32)
        exchange(comm, payload(rank, mine), partner, got, partner, 8)
        assert np.array_equal(got, payload(partner, theirs))
    right, left = (rank + 1) % size, (rank - 1) % size
    recording = _Recording(comm)
    got = np.full(n, -1, dtype=np.int32)
    exchange(recording, payload(rank), right, got, left, 6)
    assert np.array_equal(got, payload(left))
    if size > 2:
        assert recording.calls == ["Sendrecv"]


_SCRIPT = """
import numpy as np
from mpi4py import MPI
from hpcjobs.collectives import allreduce
x = np.ones(4)
try:
    allreduce(x, algorithm="ring")
except ValueError as e:
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: {e}", flush=True)
else:
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: reduced {x[0]:g}", flush=True)
"""


def _mpmd(first: list[str], second: list[str]):
    """rank 0 runs ``first``, rank 1 ``second`` (python's arguments), in one
    launch without the settings these tests give one rank."""
    from launch import _mpirun_prefix, launch_env, run

    with launch_env() as env:
        for name in SETTINGS:
            env.pop(name, None)
        for name in ("HPCJOBS_TIMEOUT", "HPCJOBS_STALL_WARNING"):
            env.pop(name, None)
        exe, *over, _, _, python = _mpirun_prefix(1)
        return run([exe, *over, "-n", "1", python, *first, ":", "-n", "1", python, *second], 120, env)


@pytest.mark.parametrize("variable,value,words", [
    ("HPCJOBS_CHECKS", "0", "HPCJOBS_CHECKS differs across ranks (rank 0: on; rank 1: off): set it the same on every "
                            "host"),
    ("HPCJOBS_AGREE_VIA", "mpi", "HPCJOBS_AGREE_VIA differs across ranks (rank 0: oneshot; rank 1: mpi): set it the "
                                 "same on every host"),
    # read at import: it ended rank 1 alone there, and rank 0 waited in MPI for it
    ("HPCJOBS_TIMEOUT", "soon", "HPCJOBS_TIMEOUT='soon' is not a number of seconds (on rank 1 of 2)"),
    ("HPCJOBS_CUDA_IPC_ONE_SHOT", "64K", "HPCJOBS_CUDA_IPC_ONE_SHOT='64K' is not a number of bytes >= 0 (0: no "
                                         "one-shot) (on rank 1 of 2)"),
])
def test_a_script_whose_ranks_differ_in_a_shared_setting_gets_an_error_on_every_rank(variable, value, words):
    # A script of the user's, not `hpcjobs`: the library's first collective on the world compares them. With
    # HPCJOBS_CHECKS=0 on rank 1 alone, rank 0 waited in the check's exchange for it (until the test's 120 s).
    out = _mpmd(["-c", _SCRIPT], ["-c", f"import os; os.environ[{variable!r}] = {value!r}\n" + _SCRIPT])
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [f"rank 0: {words}", f"rank 1: {words}"], out.stdout


def test_a_script_that_reduces_on_its_own_communicator_only_is_checked_there():
    # the world's duplicate is never made: the check runs on the first communicator the library is given
    sub = _SCRIPT.replace('allreduce(x, algorithm="ring")', 'allreduce(x, algorithm="ring", comm=MPI.COMM_WORLD.Dup())')
    assert sub != _SCRIPT
    sub += "import hpcjobs.comm; print('world made:', hpcjobs.comm._world_dup is not None)\n"
    out = _mpmd(["-c", sub], ["-c", "import os; os.environ['HPCJOBS_CHECKS'] = '0'\n" + sub])
    words = "HPCJOBS_CHECKS differs across ranks (rank 0: on; rank 1: off): set it the same on every host"
    assert out.returncode == 0 and sorted(out.stdout.splitlines()) == [
        f"rank 0: {words}", f"rank 1: {words}", "world made: False", "world made: False"], out.stdout + out.stderr


def test_a_refused_duplicate_is_freed_and_made_again_once_all_is_well(monkeypatch):
    from hpcjobs.collectives import watchdog
    from hpcjobs.comm import _KEYVAL

    comm = MPI.COMM_WORLD.Dup()
    monkeypatch.setattr(watchdog, "ENV_ERROR", "HPCJOBS_TIMEOUT='soon' is not a number of seconds")
    with pytest.raises(ValueError, match="HPCJOBS_TIMEOUT='soon'"):
        private(comm)
    assert comm.Get_attr(_KEYVAL) is None  # nothing kept
    monkeypatch.setattr(watchdog, "ENV_ERROR", None)
    assert private(comm).Get_size() == comm.Get_size() and comm.Get_attr(_KEYVAL) is private(comm)
    comm.Free()


def test_ranks_that_agree_run_with_their_settings():
    from launch import mpirun_script

    out = mpirun_script(2, _SCRIPT, env={"HPCJOBS_CHECKS": "0", "HPCJOBS_AGREE_VIA": "mpi"})
    assert out.returncode == 0 and sorted(out.stdout.splitlines()) == ["rank 0: reduced 2", "rank 1: reduced 2"], \
        out.stdout + out.stderr


@pytest.mark.parametrize("value", ["oneshot", "", " oneshot "])
def test_a_setting_left_unset_and_one_set_to_its_default_agree(value):
    # compared as the code runs it: an empty or padded value is the default there too (the exchange read the raw
    # value, and " oneshot " on one rank would have exchanged over MPI beside the others' shared segment)
    out = _mpmd(["-c", _SCRIPT], ["-c", f"import os; os.environ['HPCJOBS_AGREE_VIA'] = {value!r}\n" + _SCRIPT
                                  + "from hpcjobs.collectives import agreement; print('via', agreement._VIA)"])
    assert out.returncode == 0 and sorted(out.stdout.splitlines()) == [
        "rank 0: reduced 2", "rank 1: reduced 2", "via oneshot"], out.stdout + out.stderr


def test_a_host_with_another_copy_of_hpcjobs_is_named(tmp_path):
    # rank 1 imports a copy of the package in which one file is one line longer, as a host whose install is
    # older or newer than the others'
    import shutil

    import hpcjobs

    copy = tmp_path / "hpcjobs"
    shutil.copytree(hpcjobs.__path__[0], copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "comm.py", "a") as f:
        f.write("# another version\n")
    out = _mpmd(["-c", _SCRIPT], ["-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + _SCRIPT])
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    found = re.fullmatch(r"rank 0: hpcjobs differs across ranks \(rank 0: (\S+) \((\w{8})\); rank 1: (\S+) "
                         r"\((\w{8})\)\): install the same on every host \(rank 0: (\S+); rank 1: (\S+)\)", lines[0])
    assert found and found[1] == found[3] == hpcjobs.__version__ and found[2] != found[4], out.stdout
    assert (found[5], found[6]) == (os.path.dirname(os.path.abspath(hpcjobs.__file__)), str(copy)), out.stdout
    assert lines[1] == "rank 1" + found[0][len("rank 0"):], out.stdout


_CHOICES = {"HPCJOBS_CHECKS": ("1", "on", "TRUE", " yes", "0", "Off", "false", "no", ""),
            "HPCJOBS_AGREE_VIA": ("oneshot", "mpi", ""), "HPCJOBS_CUDA_IPC_SYNC": ("events", "host"),
            "HPCJOBS_TORCH_ALGORITHM": ("auto", "ring", "hierarchical", "cuda_ipc"), "HPCJOBS_BIND_GPU": ("0", "1", "")}


@pytest.mark.parametrize("variable,value,words", [
    ("HPCJOBS_CHECKS", "maybe", "HPCJOBS_CHECKS='maybe': choose one of 1, on, true, yes, 0, off, false, no"),
    ("HPCJOBS_AGREE_VIA", "xyz", "HPCJOBS_AGREE_VIA='xyz': choose one of oneshot, mpi"),
    ("HPCJOBS_CUDA_IPC_SYNC", "fence", "HPCJOBS_CUDA_IPC_SYNC='fence': choose one of events, host"),
    ("HPCJOBS_TORCH_ALGORITHM", "xyz", "HPCJOBS_TORCH_ALGORITHM='xyz': choose one of auto, ring, ring_pipelined,"),
    ("HPCJOBS_BIND_GPU", "yes", "HPCJOBS_BIND_GPU='yes': choose 1 (each rank its own GPU) or 0"),
])
def test_a_choice_outside_its_values_is_an_environment_problem(monkeypatch, variable, value, words):
    """Each of these ran as another value before (HPCJOBS_CHECKS=maybe left
    the checks on, HPCJOBS_AGREE_VIA=xyz exchanged over MPI) or failed late
    (HPCJOBS_TORCH_ALGORITHM=xyz at a script's first allreduce); now they are
    refused where the others are, on every rank (test_cli)."""
    from hpcjobs.comm import environment_problem

    for name in _CHOICES:
        monkeypatch.delenv(name, raising=False)
    assert environment_problem() is None
    for good in _CHOICES[variable]:
        monkeypatch.setenv(variable, good)
        assert environment_problem() is None, good
    monkeypatch.setenv(variable, value)
    assert words in environment_problem()
    monkeypatch.setenv("HPCJOBS_CHECKS" if variable != "HPCJOBS_CHECKS" else "HPCJOBS_AGREE_VIA", "bad")
    assert words in environment_problem() and environment_problem().count("; ") == 1  # both, said at once


@pytest.mark.mpi(min_size=2)
def test_a_refusal_meets_every_rank_but_does_not_wait_for_ranks_that_never_come():
    """main's UsageError on every rank: rank 0 prints, and no rank leaves before every rank has come (srun's
    --kill-on-bad-exit ends the others when one exits). One raised on rank 0 alone gives up after its bound."""
    from hpcjobs.cli import _meet

    comm = MPI.COMM_WORLD.Dup()
    assert _meet(comm, 30.0) is None  # every rank: met
    pending = _meet(comm, 0.2) if comm.Get_rank() == 0 else None  # the others are not coming (not before the
    assert (pending is None) == (comm.Get_rank() != 0)             # barrier below)
    MPI.COMM_WORLD.Barrier()
    if comm.Get_rank() != 0:
        assert _meet(comm, 30.0) is None  # meets rank 0's barrier left behind
    else:
        pending.Wait()  # completed before the communicator is freed: a pending one crashed a later test's progress
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_another_numpy_or_torch_stops_every_rank_naming_it():
    """Only hpcjobs' own install was compared across ranks: a host with another numpy (whose generators draw
    random-k's positions and each epoch's order on every rank alone; NEP 19 keeps them equal across versions
    of no promise) reduced values from other positions without a word (the rank-divergence review)."""
    from hpcjobs.comm import libraries, refusals, shared_settings

    comm = MPI.COMM_WORLD
    mine = libraries()
    assert mine["numpy"] == np.__version__ and set(mine) == {"numpy", "torch", "mpi4py", "python"}
    assert refusals(None, shared_settings(), private(comm)) == []
    for name in ("numpy", "torch"):
        settings = shared_settings() | ({name: "0.0.1"} if comm.rank == 1 else {})
        (found,) = refusals(None, settings, private(comm))
        assert found.startswith(f"{name} differs across ranks (") and "rank 1: 0.0.1" in found, found
        assert found.endswith("): install the same on every host"), found
