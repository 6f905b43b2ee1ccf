"""``hpcjobs experiment async``: what its table computes from the runs
(time to the target, the ratios), and the command end to end on 3 ranks."""

import json

import pytest

from mpi4py import MPI

from hpcjobs.training import async_experiment
from hpcjobs.training.async_experiment import markdown_table, summarize
from hpcjobs.training.config import TrainConfig
from launch import mpirun


def _run(row, seed, slow, errors, walls, **extra):
    return {"row": row, "mode": row.split()[0], "seed": seed, "straggler": slow, "workers": 4,
            "history": [{"test_acc": 1 - e, "wall_s": w, "sent_bytes": 100.0, **extra} for e, w in zip(errors, walls)]}


def test_the_target_is_syncs_final_error_plus_a_point_and_time_is_when_a_run_first_reaches_it():
    results = [_run("sync", 0, 3.0, [0.30, 0.10], [10, 20]), _run("sync", 1, 3.0, [0.30, 0.115], [10, 22]),
               _run("async", 0, 3.0, [0.20, 0.115, 0.05], [3, 6, 9], staleness_mean=2.0, staleness_max=7),
               _run("async", 1, 3.0, [0.50, 0.40, 0.30], [3, 6, 9], staleness_mean=3.0, staleness_max=5)]
    s = summarize(results)
    sync, async_ = s[(3.0, "sync")], s[(3.0, "async")]
    assert sync["target"] == pytest.approx(0.1175)  # mean final error 0.1075, plus one point
    assert sync["sync_wall_s"] == pytest.approx(21)
    assert sync["time_to_target_s"] == pytest.approx(21) and sync["reached"] == 2  # 0.10 at 20 s, 0.115 at 22
    assert async_["time_to_target_s"] == 6 and async_["reached"] == 1  # seed 1 never gets there
    assert async_["error"][0] == pytest.approx(0.175)
    assert async_["staleness_mean"] == pytest.approx(2.5) and async_["staleness_max"] == 7
    table = markdown_table(s)
    assert "| async | 17.50 ± 17.68 | 9.0 | 6.0 (1/2 seeds) | 0.29 | 0.000 | 1.00 | 2.50 / 7 |" in table
    assert "target: sync's final error + 1 point = 11.75%" in table


def test_a_row_that_counted_no_bytes_has_none_in_the_table():
    """Not 0: each row's "sync's bytes ÷ row's" read 0.00 against it."""
    results = [_run("sync", 0, 1.0, [0.3, 0.1], [10, 20]), _run("local H=4", 0, 1.0, [0.3, 0.1], [5, 10])]
    for h in results[0]["history"]:
        del h["sent_bytes"]
    s = summarize(results)
    assert s[(1.0, "sync")]["sent_bytes"] is None
    table = markdown_table(s)
    assert "| sync | 10.00 ± 0.00 | 20.0 | 20.0 | 1.00 | — | — | — |" in table, table
    assert "| local H=4 | 10.00 ± 0.00 | 10.0 | 10.0 | 0.50 | 0.000 | — | — |" in table, table


def test_the_command_runs_sync_and_async_side_by_side(tmp_path):
    out = mpirun(3, "experiment", "async", "--rows", "sync,async,local H=4", "--seeds", "1", "--epochs", "2",
                 "--num-samples", "1000", "--straggler-factor", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(r["row"], r["straggler"]) for r in runs] == [("sync", 1.0), ("async", 1.0), ("local H=4", 1.0),
                                                           ("sync", 2.0), ("async", 2.0), ("local H=4", 2.0)]
    assert all(len(r["history"]) == 2 for r in runs)
    table = (tmp_path / "table.md").read_text()
    assert "**worker 0 2x slower**" in table and (tmp_path / "error_vs_time.png").stat().st_size > 0
    # local SGD with H = 4 sends one vector per 4 steps where sync sends one per step, on the same ring
    local = [r for r in runs if r["row"] == "local H=4"][0]["history"][0]["sent_bytes"]
    sync = [r for r in runs if r["row"] == "sync"][0]["history"][0]["sent_bytes"]
    assert sync / local == pytest.approx(4, rel=0.3)


def test_rows_it_does_not_know_are_a_usage_error():
    out = mpirun(2, "experiment", "async", "--rows", "sync,gossip")
    assert out.returncode == 2 and "unknown: gossip" in out.stderr


def test_a_row_whose_period_outlasts_the_run_is_refused_before_any_row_runs(tmp_path):
    # 480 training samples / (32 x 2 workers) = 7 steps: local SGD's H = 16 would never average
    out = mpirun(3, "experiment", "async", "--epochs", "1", "--num-samples", "600", "--rows", "sync,local H=16",
                 "--seeds", "1", "--out", str(tmp_path))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "row 'local H=16': mode local: 1 epoch(s) of 7 steps make no average every 16 steps" in out.stderr
    assert not (tmp_path / "runs.jsonl").exists()  # refused before the sync row ran


def test_every_row_can_be_named_in_rows():
    """--rows is comma-separated: no row's name may hold a comma."""
    from hpcjobs.cli.args import comma_list
    from hpcjobs.training.config import async_row_names

    names = async_row_names()
    assert comma_list(",".join(names)) == names and len(set(names)) == len(names)


@pytest.mark.parametrize("args,words", [
    (["--algorithm", "hierarchical"], "invalid choice: 'hierarchical'"),  # ran sync, async, hogwild, then failed
    (["--epochs", "2", "--rows", "sync,post-local H=8"], "row 'post-local H=8' averages every step for a quarter"),
    # ran sync, then failed naming --local-steps, a flag the experiment does not have: 480 training samples
    # at 128 a step are 3 steps an epoch of the 1 worker, fewer than tau = 4
    (["--rows", "sync,easgd async tau=4", "-b", "128"], "row 'easgd async tau=4': an elastic move every 4 steps is "
                                                         "more than an epoch of its 1 worker(s) (3 steps each"),
    (["--momentum", "0", "--rows", "sync,local H=8 + momentum avg"], "row 'local H=8 + momentum avg': "),
    (["--straggler-factor", "0.5"], "F >= 1 (1: none), got 0.5"),  # taken, and no straggler run made
    (["--algorithm", "auto"], "invalid choice: 'auto'"),  # the sync row counted no bytes: its ratios read 0
])
def test_settings_a_row_cannot_run_are_refused_before_any_row_runs(tmp_path, args, words):
    out = mpirun(2, "experiment", "async", "--seeds", "1", "--num-samples", "600", "--out", str(tmp_path), *args)
    assert out.returncode == 2 and words in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "runs.jsonl").exists()


@pytest.mark.mpi(min_size=2)
def test_a_row_that_fails_on_the_workers_fails_on_every_rank(monkeypatch, tmp_path_factory):
    """Rank 0 waits while the workers run a row on their own: a row the
    workers refused left it waiting for good, saying nothing."""
    comm = MPI.COMM_WORLD
    out = tmp_path_factory.mktemp(f"rows{comm.Get_rank()}")

    def refused(cfg, comm):
        raise ValueError("the workers' own refusal")

    monkeypatch.setattr(async_experiment, "train", refused)
    template = TrainConfig(model="mlp", width=4, num_samples=500, epochs=1, progress=False, quiet=True)
    with pytest.raises(ValueError) as e:
        async_experiment.run_rows(template, ["sync"], 1, 1.0, str(out), comm, log=lambda *a: None)
    assert str(e.value) == "row 'sync', seed 0: " + "; ".join(
        f"rank {r}: the workers' own refusal" for r in range(1, comm.Get_size()))
