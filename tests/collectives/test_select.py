"""allreduce(algorithm=...) dispatch, auto and the tuning table."""

import json

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.collectives import ALGORITHMS, allreduce
from hpcjobs.collectives.select import DEFAULT_TABLE, choose, load_tuning, set_tuning

TABLE = {"version": 1, "tables": [
    {"ranks": 2, "nodes": 1, "rows": [{"max_bytes": 1024, "algorithm": "recursive_doubling"},
                                      {"max_bytes": None, "algorithm": "shm"}]},
    {"ranks": 8, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "tree"}]},
    {"ranks": 8, "nodes": 2, "rows": [{"max_bytes": 64, "algorithm": "rabenseifner"},
                                      {"max_bytes": None, "algorithm": "hierarchical"}]},
]}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["auto", *ALGORITHMS])
@pytest.mark.parametrize("count", [0, 5, 300_007])
def test_every_algorithm_gives_the_mpi_result(algorithm, count, comm):
    rank = comm.Get_rank()
    buf = (np.arange(count, dtype=np.int64) * (rank + 3)) % 1001
    want = buf.copy()
    comm.Allreduce(MPI.IN_PLACE, want, op=MPI.SUM)
    assert allreduce(buf, "sum", algorithm, comm) is buf
    np.testing.assert_array_equal(buf, want)


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
        assert t["rows"][-1]["max_bytes"] is None


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown algorithm 'butterfly'; choose one of auto, ring, ring_pipelined"):
        allreduce(np.zeros(3), algorithm="butterfly")


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="unknown op 'mean'"):
        allreduce(np.zeros(3), op="mean")


@pytest.mark.parametrize("content,words", [
    (None, "cannot read tuning table"), ("{not json", "is not JSON"), ("{}", "has no 'tables'"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "warp"}]}]}),
     "unknown algorithm 'warp'"),
    (json.dumps({"tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": 8, "algorithm": "ring"}]}]}),
     "max_bytes null"),
])
def test_bad_tuning_files_are_refused_clearly(tmp_path, content, words):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=words):
        load_tuning(str(path))


@pytest.mark.mpi(min_size=2)  # one rank dispatches nothing
def test_auto_follows_the_tuning_file(tmp_path_factory):
    comm = MPI.COMM_WORLD
    path = tmp_path_factory.mktemp(f"tune{comm.Get_rank()}") / "t.json"
    only_tree = {"version": 1, "tables": [{"ranks": comm.Get_size(), "nodes": 1,
                                           "rows": [{"max_bytes": None, "algorithm": "tree"}]}]}
    path.write_text(json.dumps(only_tree))
    calls = []
    import hpcjobs.collectives.select as select

    real = select._INTERNAL["tree"]
    select._INTERNAL["tree"] = lambda *a, **k: (calls.append(1), real(*a, **k))
    try:
        set_tuning(str(path))
        buf = np.ones(100)
        allreduce(buf, "sum", "auto", comm)
        assert calls and buf[0] == comm.Get_size()
    finally:
        select._INTERNAL["tree"] = real
        set_tuning(None)
