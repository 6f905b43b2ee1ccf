"""algorithm="auto": the tuning table, and the candidates it times in place."""

import json

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs import timing
from hpcjobs.collectives import ALGORITHMS, allreduce
from hpcjobs.collectives import auto, select
from hpcjobs.collectives._frame import Algorithm
from hpcjobs.collectives.auto import DEFAULT_TABLE, candidates, choose, load_tuning, same_bits, set_tuning

TABLE = {"version": 1, "tables": [
    {"ranks": 2, "nodes": 1, "rows": [{"max_bytes": 1024, "algorithm": "recursive_doubling"},
                                      {"max_bytes": None, "algorithm": "shm"}]},
    {"ranks": 8, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "tree"}]},
    {"ranks": 8, "nodes": 2, "rows": [{"max_bytes": 64, "algorithm": "rabenseifner"},
                                      {"max_bytes": None, "algorithm": "hierarchical"}]},
]}


def _hook(monkeypatch, name, wrapper):
    """Replace algorithm ``name``'s step in the registry by ``wrapper(real_step)``."""
    real = select.REGISTRY[name]
    monkeypatch.setitem(select.REGISTRY, name, Algorithm(real.name, real.public, wrapper(real.bound)))


@pytest.mark.parametrize("nbytes,ranks,nodes,want", [
    (8, 2, 1, "recursive_doubling"), (1024, 2, 1, "recursive_doubling"), (1025, 2, 1, "shm"),
    (1 << 30, 2, 1, "shm"),
    (8, 3, 1, "recursive_doubling"),   # nearest ranks on one node: the 2-rank table
    (8, 6, 1, "tree"),                 # nearer to 8 than to 2
    (64, 16, 2, "rabenseifner"), (65, 16, 2, "hierarchical"),
    (1 << 20, 2, 2, "hierarchical"),   # same nodes beats same ranks
    (1 << 20, 2, 4, "hierarchical"),   # no 4-node table: the nearest node count
])
def test_choose_reads_the_nearest_table_and_the_first_row_that_fits(nbytes, ranks, nodes, want):
    assert choose(nbytes, ranks, nodes, tuning=TABLE) == want


def test_shm_never_chosen_across_nodes():
    assert choose(1 << 30, 2, 3, tuning={"version": 1, "tables": [TABLE["tables"][0]]}) == "hierarchical"


def test_built_in_table_names_only_real_algorithms():
    for t in DEFAULT_TABLE["tables"]:
        assert {r["algorithm"] for r in t["rows"]} <= set(ALGORITHMS)
        assert all(r["candidates"][0] == r["algorithm"] and set(r["candidates"]) <= set(ALGORITHMS)
                   for r in t["rows"])
        assert t["rows"][-1]["max_bytes"] is None


def test_candidates_put_the_tables_choice_first_and_place_shm():
    table = {"version": 1, "tables": [{"ranks": 2, "nodes": 1, "rows": [
        {"max_bytes": 64, "algorithm": "tree", "candidates": ["tree", "shm", "ring"]},
        {"max_bytes": None, "algorithm": "ring",  # an older tune file: its runner-ups, in order, once each
         "measured": [{"runner_up": "shm"}, {"runner_up": "rabenseifner"}, {"runner_up": "shm"}, {"runner_up": "mpi"},
                      {"size_bytes": 8}]}]}]}
    assert candidates(8, 2, 1, tuning=table) == ["tree", "shm", "ring"]
    assert candidates(8, 2, 2, tuning=table) == ["tree", "hierarchical", "ring"]  # shm cannot span nodes
    assert candidates(1 << 20, 2, 1, tuning=table) == ["ring", "shm", "rabenseifner"]
    assert candidates(1 << 20, 2, 1, tuning=TABLE) == ["shm"]  # no contenders listed: the choice alone


@pytest.mark.parametrize("dtype,op,ranks,same", [
    ("float32", "sum", 2, True), ("float32", "sum", 3, False), ("bfloat16", "avg", 5, False),
    ("float64", "prod", 4, False), ("float16", "max", 5, True), ("float32", "min", 3, True),
    ("int32", "sum", 5, True), ("int64", "avg", 3, True), ("int64", "prod", 4, True),
])
def test_only_algorithms_with_bitwise_equal_results_are_compared(dtype, op, ranks, same):
    assert same_bits(dtype, op, ranks) is same


@pytest.mark.parametrize("content,words", [
    (None, "cannot read tuning table"), ("{not json", "is not JSON"), ("{}", "has no 'tables'"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "warp"}]}]}),
     "unknown algorithm 'warp'"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": 8, "algorithm": "ring"}]}]}),
     "max_bytes null"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "ring",
                                                              "candidates": ["ring", "warp"]}]}]}),
     "unknown algorithm 'warp'"),
    # hand-edited tables that failed later, inside a collective, with a KeyError or TypeError
    (json.dumps({"tables": [{"ranks": 2, "rows": [{"max_bytes": None, "algorithm": "ring"}]}]}),
     "integer 'ranks' and 'nodes'"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "ring",
                                                              "candidates": None}]}]}), "'candidates' must be a list"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": "1M", "algorithm": "ring"},
                                                              {"max_bytes": None, "algorithm": "ring"}]}]}),
     "max_bytes must be integers, increasing"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": 100, "algorithm": "ring"},
                                                              {"max_bytes": 50, "algorithm": "ring"},
                                                              {"max_bytes": None, "algorithm": "ring"}]}]}),
     "max_bytes must be integers, increasing"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "local_sizes": 2,
                             "rows": [{"max_bytes": None, "algorithm": "ring"}]}]}), "'local_sizes' must be a list"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "layout": 1,
                             "rows": [{"max_bytes": None, "algorithm": "ring"}]}]}), "'layout' must be a string"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "ring",
                                                              "measured": ["ring"]}]}]}),
     "'measured' must be a list of objects"),
])
def test_bad_tuning_files_are_refused_clearly(tmp_path, content, words):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=words):
        load_tuning(str(path))


@pytest.mark.mpi(min_size=2)  # one rank dispatches nothing
def test_auto_follows_the_tuning_file(tmp_path_factory, monkeypatch):
    comm = MPI.COMM_WORLD
    path = tmp_path_factory.mktemp(f"tune{comm.Get_rank()}") / "t.json"
    only_tree = {"version": 1, "tables": [{"ranks": comm.Get_size(), "nodes": 1,
                                           "rows": [{"max_bytes": None, "algorithm": "tree"}]}]}
    path.write_text(json.dumps(only_tree))
    calls = []
    _hook(monkeypatch, "tree", lambda real: lambda *a: (calls.append(1), real(*a)))
    try:
        set_tuning(str(path))
        buf = np.ones(100)
        allreduce(buf, "sum", "auto", comm)
        assert calls and buf[0] == comm.Get_size()
    finally:
        set_tuning(None)


@pytest.mark.mpi(min_size=2)
def test_a_tuning_file_without_this_layouts_table_says_so_once(tmp_path_factory, capsys):
    """A file tuned on another layout was followed without a word."""
    comm = MPI.COMM_WORLD
    path = tmp_path_factory.mktemp(f"other{comm.Get_rank()}") / "t.json"
    P = comm.Get_size()
    other = {"version": 1, "tables": [{"ranks": P + 6, "nodes": 1, "local_sizes": [P + 6],
                                       "rows": [{"max_bytes": None, "algorithm": "tree"}]}]}
    path.write_text(json.dumps(other))
    try:
        set_tuning(str(path))
        for _ in range(3):
            buf = np.ones(100)
            allreduce(buf, "sum", "auto", comm)
            assert buf[0] == P
        err = capsys.readouterr().err
        if comm.Get_rank() == 0:
            assert err.count("warning: tuning table") == 1, err
            assert (f"{path} has no table for {P} ranks on 1 node(s) [{P}]; auto follows the one of {P + 6} ranks "
                    f"on 1 node(s) [{P + 6}] (run `hpcjobs tune` on this layout)") in err, err
        else:
            assert "warning" not in err
        other["tables"][0].update(ranks=P, local_sizes=[P], layout="shared-memory")  # this layout's own: nothing to say
        path.write_text(json.dumps(other))
        set_tuning(str(path))
        allreduce(np.ones(100), "sum", "auto", comm)
        assert "warning" not in capsys.readouterr().err
        # the same shape, tuned where --ranks-per-node simulated the nodes on one host: said nothing either
        other["tables"][0].update(layout="override")
        path.write_text(json.dumps(other))
        set_tuning(str(path))
        for _ in range(2):
            allreduce(np.ones(100), "sum", "auto", comm)
        err = capsys.readouterr().err
        if comm.Get_rank() == 0:
            assert err.count("warning: tuning table") == 1, err
            assert (f"{path} has no table for {P} ranks on 1 node(s) [{P}] (real nodes); auto follows the one of "
                    f"{P} ranks on 1 node(s) [{P}] (nodes simulated on one host) (run `hpcjobs tune` on this "
                    "layout)") in err, err
        else:
            assert "warning" not in err
    finally:
        set_tuning(None)


@pytest.mark.mpi(min_size=2)
def test_tuning_tables_that_differ_across_ranks_are_refused_on_every_rank(tmp_path_factory):
    """A table on some hosts only, or another one there: each rank would run
    its own algorithm (the job hung until the watchdog). Every rank raises,
    naming which ranks' tables give what, before anything is sent; a size
    where the tables agree still runs."""
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    path = tmp_path_factory.mktemp(f"differ{rank}") / "t.json"
    small = "tree" if rank == 0 else "ring"  # rank 0's table differs up to 1 KB, agrees above
    path.write_text(json.dumps({"version": 1, "tables": [{"ranks": comm.Get_size(), "nodes": 1, "rows": [
        {"max_bytes": 1024, "algorithm": small}, {"max_bytes": None, "algorithm": "recursive_doubling"}]}]}))
    try:
        set_tuning(str(path))
        buf = np.full(16, rank + 1.0)
        with pytest.raises(ValueError) as e:
            allreduce(buf, "sum", "auto", comm)
        others = "rank 1" if comm.Get_size() == 2 else f"ranks {','.join(map(str, range(1, comm.Get_size())))}"
        assert str(e.value) == ("auto at 128 bytes: the ranks' tuning tables give different algorithms -- rank 0: "
                                f"tree; {others}: ring -- give every rank the same table (HPCJOBS_TUNING or "
                                "set_tuning; `hpcjobs info --all-ranks` names each rank's)")
        assert (buf == rank + 1).all()  # nothing was sent
        # a compressed payload on auto (its allreduce times no contenders) is checked the same way: it hung
        torch = pytest.importorskip("torch")
        from hpcjobs.compression import FP16Compressor, compressed_allreduce

        with pytest.raises(ValueError, match=r"^auto at 32 bytes: the ranks' tuning tables give different algorithms "
                                             r"-- rank 0: tree; (rank|ranks) [\d,]+: ring -- give every rank"):
            compressed_allreduce(torch.full((16,), rank + 1.0), FP16Compressor(), comm=comm, algorithm="auto")
        big = np.full(1000, rank + 1.0)
        allreduce(big, "sum", "auto", comm)
        assert (big == comm.Get_size() * (comm.Get_size() + 1) / 2).all()
        # A table missing on one rank (the library's set_tuning, which the CLI's start-up check does not see):
        # every rank raises, naming that rank's error, where that rank alone raised and the others waited
        set_tuning(str(path if rank else path.parent / "missing.json"))
        with pytest.raises(ValueError) as e:
            allreduce(big, "sum", "auto", comm)
        assert str(e.value).startswith("auto at 8000 bytes: the ranks' tuning tables could not be read or give "
                                       "different algorithms -- rank 0: ValueError: "), str(e.value)
        assert f"; {others}: recursive_doubling -- give every rank the same table" in str(e.value)
    finally:
        set_tuning(None)
        comm.Free()


SLOW = 0.1  # seconds


@pytest.fixture
def timed_table(tmp_path_factory, monkeypatch):
    """auto with tree then ring as candidates for every size, and a hook to
    make either slow on one rank: ``slow[name] = seconds`` sleeps that long
    after the real algorithm, on this rank only. The slow one loses by 80 ms
    or more: CI runs 5 ranks on 2 cores, where a ring's call alone took up
    to 32 ms under load. Five timed rounds at every size keep the
    measurement short."""
    comm = MPI.COMM_WORLD
    path = tmp_path_factory.mktemp(f"timed{comm.Get_rank()}") / "t.json"
    path.write_text(json.dumps({"version": 1, "tables": [{"ranks": comm.Get_size(), "nodes": 1, "rows": [
        {"max_bytes": None, "algorithm": "tree", "candidates": ["tree", "ring"]}]}]}))
    slow, calls = {}, []
    for name in ("tree", "ring"):
        def wrapper(real, _name=name):
            def hooked(*a):
                import time

                calls.append(_name)
                real(*a)
                time.sleep(slow.get(_name, 0))
            return hooked
        _hook(monkeypatch, name, wrapper)
    monkeypatch.setattr(auto, "SMALL_TIMED_ROUNDS", auto.TIMED_ROUNDS)
    set_tuning(str(path))
    yield slow, calls
    set_tuning(None)


def _measuring(names, nbytes=4000, measured=0):
    """The calls of the measurement of ``names`` at ``nbytes`` after ``measured`` others, in auto's order
    (each in orders of its own)."""
    rounds = timing.Rounds(len(names), auto.UNTIMED_TURNS, auto.timed_rounds(nbytes), (nbytes, measured))
    return [names[j] for j in rounds.order]


def _reduce(comm, n=1000, dtype=np.float32) -> bool:
    """One auto allreduce; whether its result was right. Loops of them
    assert after the loop: a rank failing inside one would leave the others
    blocked in its next allreduce."""
    buf = np.full(n, comm.Get_rank() + 1, dtype=dtype)
    allreduce(buf, "sum", "auto", comm)
    return bool((buf == comm.Get_size() * (comm.Get_size() + 1) // 2).all())


def _reduces(comm, calls, dtype=np.float32) -> None:
    """``calls`` auto allreduces, each right."""
    right = [_reduce(comm, dtype=dtype) for _ in range(calls)]
    assert all(right), right


@pytest.mark.mpi(min_size=2)
def test_auto_times_its_candidates_and_every_rank_keeps_the_same_one(timed_table):
    """Each rank alone would pick a different one (rank 0 finds ring slow,
    the others tree): the maximum over ranks gives all ring, the one whose
    slowest rank is faster. Different picks would pair a tree with a ring.
    Integers, so that any number of ranks compares (same bits)."""
    slow, calls = timed_table
    comm = MPI.COMM_WORLD
    slow["ring" if comm.Get_rank() == 0 else "tree"] = SLOW / 5 if comm.Get_rank() == 0 else SLOW
    turns = auto.UNTIMED_TURNS + auto.timed_rounds(4000)
    buf = np.zeros(1000, np.int32)
    measuring = []
    for _ in range(2 * turns):
        settled = auto.settled(buf, "sum", comm)
        measuring.append((settled, _reduce(comm, dtype=np.int32)))
    assert measuring == [(False, True)] * (2 * turns), measuring
    assert auto.settled(buf, "sum", comm)
    assert not auto.settled(buf, "max", comm) and not auto.settled(buf[:10], "sum", comm)
    _reduces(comm, 5, dtype=np.int32)
    assert calls[:2 * turns] == _measuring(["tree", "ring"])
    assert calls[2 * turns:] == ["ring"] * 5


@pytest.mark.mpi(min_size=2)
def test_auto_measures_again_and_follows_a_change(timed_table, monkeypatch):
    slow, calls = timed_table
    comm = MPI.COMM_WORLD
    monkeypatch.setattr(auto, "REMEASURE_EVERY", 40)
    turns = auto.UNTIMED_TURNS + auto.timed_rounds(4000)
    slow["ring"] = SLOW
    _reduces(comm, 40, dtype=np.int32)
    assert calls[:2 * turns] == _measuring(["tree", "ring"]) and calls[2 * turns:40] == ["tree"] * (40 - 2 * turns)
    del slow["ring"]
    slow["tree"] = SLOW
    calls.clear()
    _reduces(comm, 2 * turns + 2, dtype=np.int32)
    assert calls == _measuring(["tree", "ring"], measured=1) + ["ring"] * 2


@pytest.mark.mpi(min_size=2)
def test_remeasure_makes_auto_time_its_candidates_again_at_once(timed_table):
    slow, calls = timed_table
    comm = MPI.COMM_WORLD
    turns = auto.UNTIMED_TURNS + auto.timed_rounds(4000)
    buf = np.zeros(1000, np.int32)
    slow["ring"] = SLOW
    _reduces(comm, 2 * turns + 1, dtype=np.int32)
    assert auto.settled(buf, "sum", comm) and auto.kept(4000, "int32", "sum", comm) == "tree"
    auto.remeasure()
    assert not auto.settled(buf, "sum", comm) and auto.kept(4000, "int32", "sum", comm) is None
    slow.clear()
    slow["tree"] = SLOW
    calls.clear()
    _reduces(comm, 2 * turns + 2, dtype=np.int32)
    assert calls == _measuring(["tree", "ring"]) + ["ring"] * 2  # as a fresh job's first measurement
    assert auto.kept(4000, "int32", "sum", comm) == "ring"


@pytest.mark.mpi(min_size=3)
def test_auto_keeps_the_tables_choice_for_float_sums_over_three_ranks(timed_table):
    """Their bits depend on the algorithm: the table decides, timing never."""
    slow, calls = timed_table
    comm = MPI.COMM_WORLD
    slow["tree"] = SLOW
    _reduces(comm, 8)
    assert calls == ["tree"] * 8
    calls.clear()
    turns = auto.UNTIMED_TURNS + auto.timed_rounds(4000)
    _reduces(comm, 2 * turns + 6, dtype=np.int32)  # integers: any algorithm gives the same bits, so it is timed
    assert calls == _measuring(["tree", "ring"]) + ["ring"] * 6


@pytest.mark.mpi(min_size=2)
def test_each_time_counts_for_the_candidate_that_ran_not_its_place_in_the_round(timed_table, monkeypatch):
    """Every round reversed, so the first call of each round is ring's: its
    slow times must count against ring, and tree be kept."""
    slow, calls = timed_table
    comm = MPI.COMM_WORLD
    monkeypatch.setattr(timing, "shuffled_rounds", lambda n, rounds, seed=0: [list(reversed(range(n)))] * rounds)
    slow["ring"] = SLOW
    turns = auto.UNTIMED_TURNS + auto.timed_rounds(4000)
    _reduces(comm, 2 * turns + 3, dtype=np.int32)
    assert calls == ["ring", "tree"] * turns + ["tree"] * 3
    assert auto.kept(4000, "int32", "sum", comm) == "tree"


@pytest.mark.mpi(min_size=2)
def test_bench_times_what_auto_settles_on_not_its_measuring_calls(timed_table):
    """`hpcjobs bench allreduce` runs auto's measuring calls before the
    warmup, untimed: the timed calls are all the kept algorithm."""
    from hpcjobs.bench.sweep import implementations, run

    slow, calls = timed_table
    slow["tree"] = SLOW
    comm = MPI.COMM_WORLD
    (record,) = run(comm, [4096], implementations(["auto"]), dtype="int32", iters=5, warmup=1)
    assert calls == _measuring(["tree", "ring"], 4096) + ["ring"] * 6  # then warmup + iters
    assert record.wrong == 0 and record.iters == 5


def test_one_rank_has_nothing_to_measure():
    """auto measures nothing on one rank (nothing is reduced): settled says
    so from the start, and the benchmarks that wait for it go on at once."""
    from hpcjobs.collectives.auto import settled

    assert settled(np.ones(16), "sum", MPI.COMM_SELF)
