"""Tuning-table construction from benchmark records."""

import json
import os

import pytest

from hpcjobs.bench.sweep import Record
from hpcjobs.bench.tune import applicable, best_rows, merge
from hpcjobs.collectives import ALGORITHMS
from hpcjobs.collectives.auto import choose


def _rec(size, impl, t):
    return Record(size, size // 4, "float32", "sum", impl, 2, 10, t, 0.0, 0.0, 0)


def test_winners_collapse_into_rows_with_an_open_last_row():
    records = [_rec(8, "rd", 5), _rec(8, "ring", 9), _rec(64, "rd", 6), _rec(64, "ring", 7),
               _rec(512, "rd", 20), _rec(512, "ring", 10), _rec(4096, "rd", 90), _rec(4096, "ring", 30)]
    rows = best_rows(records)
    assert [(r["max_bytes"], r["algorithm"]) for r in rows] == [(64, "rd"), (None, "ring")]
    assert rows[0]["measured"][0] == {"size_bytes": 8, "time_us": 5, "runner_up": "ring", "runner_up_ratio": 1.8}


def test_a_near_tie_does_not_switch_algorithms():
    records = [_rec(8, "rd", 5), _rec(8, "ring", 9), _rec(64, "rd", 10.3), _rec(64, "ring", 10),
               _rec(512, "rd", 20), _rec(512, "ring", 10)]
    rows = best_rows(records)
    assert [(r["max_bytes"], r["algorithm"]) for r in rows] == [(64, "rd"), (None, "ring")]
    assert rows[0]["measured"][1]["runner_up"] == "ring"


def test_each_row_lists_its_winner_and_the_most_frequent_runner_ups_as_candidates():
    records = [_rec(8, "rd", 5), _rec(8, "tree", 6), _rec(8, "shm", 7),
               _rec(64, "rd", 5), _rec(64, "shm", 6), _rec(64, "tree", 7),
               _rec(512, "rd", 5), _rec(512, "shm", 6), _rec(512, "ring", 9),
               _rec(4096, "ring", 5), _rec(4096, "rd", 50)]
    rows = best_rows(records)
    assert [r["candidates"] for r in rows] == [["rd", "shm", "tree"], ["ring", "rd"]]


def test_merge_replaces_only_the_same_shape(tmp_path):
    path = tmp_path / "t.json"
    old = {"version": 1, "tables": [{"ranks": 2, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "tree"}]},
                                    {"ranks": 4, "nodes": 2, "rows": [{"max_bytes": None, "algorithm": "ring"}]}]}
    path.write_text(json.dumps(old))
    new = {"ranks": 2, "nodes": 1, "rows": [{"max_bytes": None, "algorithm": "shm"}]}
    data = merge(str(path), new, {"host": "x"})
    assert [(t["ranks"], t["nodes"], t["rows"][0]["algorithm"]) for t in data["tables"]] == [
        (2, 1, "shm"), (4, 2, "ring")]
    assert choose(1 << 20, 2, 1, tuning=data) == "shm"


def test_winners_of_nearby_sizes_are_candidates_before_runner_ups():
    """A crossover moves between runs: the algorithm that won the sizes next
    to a row is timed there too, ahead of the row's own runner-ups."""
    mb = 1 << 20
    records = [_rec(4 * mb, "ring", 5), _rec(4 * mb, "tree", 6), _rec(4 * mb, "shm", 9),
               _rec(16 * mb, "shm", 5), _rec(16 * mb, "ring", 6),
               _rec(32 * mb, "ring", 5), _rec(32 * mb, "raben", 6), _rec(32 * mb, "shm", 9),
               _rec(64 * mb, "pipe", 5), _rec(64 * mb, "hier", 6), _rec(64 * mb, "shm", 9),
               _rec(1024 * mb, "raben", 5), _rec(1024 * mb, "pipe", 6)]
    rows = best_rows(records)
    assert [r["algorithm"] for r in rows] == ["ring", "shm", "ring", "pipe", "raben"]
    assert rows[2]["candidates"] == ["ring", "shm", "pipe", "raben"]  # 8-128 MB won by shm, pipe; then raben
    assert rows[3]["candidates"] == ["pipe", "shm", "ring", "hier"]  # 16-256 MB: shm, ring (first seen), pipe
    assert rows[4]["candidates"] == ["raben", "pipe"]  # nothing else won 256 MB-4 GB
    assert rows[0]["candidates"] == ["ring", "shm", "tree"]


def test_several_passes_rank_by_median_and_pool_nearby_winners():
    """Pass 2 is a slow spell for rd: the median keeps rd the winner at 64 B,
    and ring, which won 64 B in that pass alone, is timed there too."""
    one = [_rec(8, "rd", 5), _rec(8, "tree", 6), _rec(64, "rd", 5), _rec(64, "tree", 6), _rec(64, "ring", 9)]
    two = [_rec(8, "rd", 5), _rec(8, "tree", 6), _rec(64, "rd", 20), _rec(64, "tree", 6), _rec(64, "ring", 5.9)]
    three = [_rec(8, "rd", 5), _rec(8, "tree", 6), _rec(64, "rd", 5.5), _rec(64, "tree", 6), _rec(64, "ring", 8)]
    (row,) = best_rows(one, two, three)
    assert row["algorithm"] == "rd" and row["measured"][1] == {
        "size_bytes": 64, "time_us": 5.5, "runner_up": "tree", "runner_up_ratio": round(6 / 5.5, 3)}
    assert row["candidates"] == ["rd", "ring", "tree"]
    (alone,) = best_rows(one)
    assert alone["candidates"] == ["rd", "tree"]
    assert best_rows(one, one, one) == best_rows(one)


@pytest.mark.parametrize("shared_memory,nodes,out", [
    (True, 1, {"hierarchical"}),  # one node: hierarchical is the ring
    (True, 2, {"shm", "oneshot"}),  # simulated nodes on one host: auto runs others in their place there
    (False, 2, {"shm", "oneshot"}),  # real nodes: no shared memory across them
    (False, 1, {"shm", "oneshot", "hierarchical"}),
])
def test_tune_times_only_the_algorithms_that_differ_here(shared_memory, nodes, out):
    names, left_out = applicable(shared_memory, nodes)
    assert set(ALGORITHMS) - set(names) == out
    assert names == [a for a in ALGORITHMS if a not in out]  # in ALGORITHMS' order
    assert sorted(line.split(":")[0] for line in left_out) == sorted(out)


def test_merge_keeps_one_table_per_layout_and_auto_takes_the_matching_one(tmp_path):
    """4 ranks on 2 nodes as 2+2 and as 3+1 are two tables; a table without
    a layout (an older file) matches any, after the ones that match."""
    path = tmp_path / "t.json"
    even = {"ranks": 4, "nodes": 2, "local_sizes": [2, 2], "link_gbps": 0.98,
            "rows": [{"max_bytes": None, "algorithm": "hierarchical"}]}
    uneven = {"ranks": 4, "nodes": 2, "local_sizes": [3, 1], "rows": [{"max_bytes": None, "algorithm": "ring"}]}
    path.write_text(json.dumps(merge(str(path), even, {"host": "a"})))
    data = merge(str(path), uneven, {"host": "b"})
    assert [t["local_sizes"] for t in data["tables"]] == [[2, 2], [3, 1]]
    assert set(data["environments"]) == {"4x2[2,2]", "4x2[3,1]"}
    assert choose(1 << 20, 4, 2, tuning=data) in ("hierarchical", "ring")  # no layout given: either
    from hpcjobs.collectives.auto import candidates

    assert candidates(1 << 20, 4, 2, tuning=data, local_sizes=(3, 1))[0] == "ring"
    assert candidates(1 << 20, 4, 2, tuning=data, local_sizes=(2, 2))[0] == "hierarchical"
    older = {"version": 1, "tables": [{"ranks": 4, "nodes": 2, "rows": [{"max_bytes": None, "algorithm": "tree"}]},
                                      even]}
    assert candidates(1 << 20, 4, 2, tuning=older, local_sizes=(2, 2))[0] == "hierarchical"
    assert candidates(1 << 20, 4, 2, tuning=older, local_sizes=(3, 1))[0] == "tree"  # the layout-free table


def test_a_table_tuned_on_simulated_nodes_is_kept_apart_from_one_on_real_hosts(tmp_path):
    path = tmp_path / "t.json"
    real = {"ranks": 4, "nodes": 2, "local_sizes": [2, 2], "layout": "shared-memory",
            "rows": [{"max_bytes": None, "algorithm": "hierarchical"}]}
    simulated = {"ranks": 4, "nodes": 2, "local_sizes": [2, 2], "layout": "override",
                 "rows": [{"max_bytes": None, "algorithm": "ring"}]}
    path.write_text(json.dumps(merge(str(path), real, {})))
    data = merge(str(path), simulated, {})
    assert len(data["tables"]) == 2 and set(data["environments"]) == {"4x2[2,2]", "4x2[2,2] simulated"}
    from hpcjobs.collectives.auto import candidates

    assert candidates(1 << 20, 4, 2, tuning=data, local_sizes=(2, 2), simulated=False)[0] == "hierarchical"
    assert candidates(1 << 20, 4, 2, tuning=data, local_sizes=(2, 2), simulated=True)[0] == "ring"


def test_an_out_file_that_is_not_a_tuning_file_is_refused_before_measuring(tmp_path):
    """The new table is added to --out after every pass; a file there that
    cannot take it (truncated, hand-broken) is refused first, on every rank,
    instead of losing the run at the end on rank 0."""
    from launch import mpirun

    # truncated; a table auto could not read (it had run every pass, then failed in merge); another command's JSON
    cases = {'{"tables": [': "", '{"tables": [1]}': "each table needs integer 'ranks' and 'nodes'",
             '{"environment": {}, "records": []}': "no list of 'tables'"}
    for i, (text, why) in enumerate(cases.items()):
        broken = tmp_path / f"t{i}.json"
        broken.write_text(text)
        out = mpirun(2, "tune", "--out", str(broken), "--max", "4K")
        assert out.returncode == 2 and "exists and is not a tuning file to add to" in out.stderr, out.stderr
        assert why in out.stderr and "pass 1" not in out.stdout
        assert broken.read_text() == text
    # a pipe: its read for the merge, after every pass, waited for good (the watchdog watches collectives only)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = mpirun(2, "tune", "--out", str(fifo), "--max", "4K", timeout=60)
    assert out.returncode == 2 and "is not a regular file: tune adds its table to those already in the file" \
        in out.stderr and "pass 1" not in out.stdout, out.stderr



def test_sizes_above_the_sweep_take_the_built_in_tables_rows():
    """A sweep to 64 KB left its last row open to every size: auto ran 64
    KB's winner (oneshot) on 16 MB, slower there than the built-in table's
    shm (7.8 against 5.0 ms, once, at 3 ranks). The measured rows end at the
    largest size measured; the built-in table's rows above it follow."""
    from hpcjobs.bench.tune import above_measured
    from hpcjobs.collectives.auto import candidates

    rows = best_rows([_rec(s, "oneshot", 10) for s in (1024, 65536)] + [_rec(s, "ring", 20) for s in (1024, 65536)])
    table = {"ranks": 2, "nodes": 1, "local_sizes": [2], "layout": "shared-memory"}
    out = above_measured(rows, table)
    assert [(r["max_bytes"], r["algorithm"], len(r["measured"])) for r in out] == [
        (65536, "oneshot", 2), (4 << 20, "shm", 0), (None, "shm", 0)]
    data = {"version": 1, "tables": [{**table, "rows": out}]}
    assert candidates(16 << 20, 2, 1, tuning=data)[0] == "shm" and candidates(60 << 10, 2, 1, tuning=data)[0] == \
        "oneshot"
    past = above_measured(best_rows([_rec(s, "ring", 10) for s in (1024, 64 << 20)]), table)
    assert [(r["max_bytes"], r["algorithm"]) for r in past] == [(64 << 20, "ring"), (None, "shm")]
