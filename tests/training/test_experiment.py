"""``hpcjobs experiment large-batch``: the grid, the table, the plots."""

import json

import pytest

from hpcjobs.training.experiment import _runs, batch_sizes, markdown_table, summarize
from launch import mpirun as _mpirun


def test_experiment_runs_the_grid_and_writes_table_and_plots(tmp_path):
    out = _mpirun(2, "experiment", "large-batch", "--model", "mlp", "--width", "16", "--dataset", "synthetic",
                  "--num-samples", "1000", "--min-batch", "16", "--max-batch", "64", "--seeds", "2",
                  "--epochs", "2", "--warmup-epochs", "1", "--lr", "0.05", "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr
    # k=1 once per seed, then 2 batches x 3 warmups per seed
    runs = [json.loads(line) for line in open(tmp_path / "runs.jsonl")]
    assert len(runs) == 2 * (1 + 2 * 3)
    table = (tmp_path / "table.md").read_text()
    assert "| 64 | 4 | 0.2 |" in table and "gradual warmup" in table
    assert (tmp_path / "error_vs_batch.png").stat().st_size > 1000
    assert (tmp_path / "curves_largest_batch.png").stat().st_size > 1000


def test_experiment_refuses_batches_that_do_not_divide_by_the_ranks(tmp_path):
    out = _mpirun(3, "experiment", "large-batch", "--min-batch", "32", "--max-batch", "64", "--out", str(tmp_path))
    assert out.returncode == 2 and "do not divide by 3 ranks" in out.stderr


def test_experiment_refuses_a_batch_larger_than_the_data_before_the_grid_and_warns_of_a_long_warmup(tmp_path):
    # 480 training samples: batch 512 cannot make one step; before, batches 16..256 trained first
    out = _mpirun(2, "experiment", "large-batch", "--model", "mlp", "--width", "16", "--dataset", "synthetic",
                  "--num-samples", "600", "--min-batch", "16", "--max-batch", "512", "--out", str(tmp_path / "a"))
    assert out.returncode == 2 and "--max-batch 512 is larger than the 480 training samples" in out.stderr, out.stderr
    assert not (tmp_path / "a" / "runs.jsonl").exists()
    out = _mpirun(2, "experiment", "large-batch", "--model", "mlp", "--width", "16", "--dataset", "synthetic",
                  "--num-samples", "600", "--min-batch", "16", "--max-batch", "32", "--seeds", "1", "--epochs", "1",
                  "--warmup-epochs", "2", "--warmups", "gradual", "--out", str(tmp_path / "b"), timeout=300)
    assert out.returncode == 0, out.stderr
    assert "warning: 2 warmup epochs in a run of 1: the warmup rows never reach their peak rate" in out.stdout


def test_the_experiments_own_sample_count_goes_only_to_a_dataset_it_sizes(tmp_path):
    """20,000 samples is the experiment's default for MNIST-1D; digits is used
    whole (1,437 for training) and refuses a count, so it must not get one:
    the grid is checked against digits' own training set."""
    out = _mpirun(2, "experiment", "large-batch", "--model", "mlp", "--width", "16", "--dataset", "digits",
                  "--min-batch", "32", "--max-batch", "2048", "--out", str(tmp_path))
    assert out.returncode == 2 and "--max-batch 2048 is larger than the 1437 training samples" in out.stderr, \
        out.stderr[-2000:]
    out = _mpirun(2, "experiment", "large-batch", "--dataset", "digits", "--num-samples", "500", "--out",
                  str(tmp_path))
    assert out.returncode == 2 and "num_samples sizes mnist1d, synthetic, text; digits is used as it comes" in \
        out.stderr, out.stderr[-2000:]


def test_batches_at_or_below_the_base_run_once_per_seed_their_warmups_being_one_run():
    assert list(_runs([16, 32, 64], ["none", "gradual"], range(1), 32)) == [
        (16, "all", 0), (32, "all", 0), (64, "none", 0), (64, "gradual", 0)]


def test_a_warmup_of_no_epochs_is_refused_where_it_would_make_the_warmup_rows_no_warmup(tmp_path):
    out = _mpirun(1, "experiment", "large-batch", "--warmup-epochs", "0", "--out", str(tmp_path))
    assert out.returncode == 2 and "--warmup-epochs 0 makes the gradual and constant warmups no warmup" in \
        out.stderr, out.stderr[-2000:]


def test_batch_sizes_double():
    assert batch_sizes(32, 4096) == [32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert batch_sizes(32, 100) == [32, 64]


def test_summary_counts_the_k1_run_for_every_warmup():
    runs = [{"global_batch": 32, "warmup": "all", "test_error": 0.1},
            {"global_batch": 32, "warmup": "all", "test_error": 0.3},
            {"global_batch": 64, "warmup": "none", "test_error": 0.5, "diverged": True},
            {"global_batch": 64, "warmup": "gradual", "test_error": 0.2}]
    s = summarize(runs)
    assert s[(32, "none")] == s[(32, "gradual")] == pytest.approx((0.2, 0.1414213, 2, 0))
    assert s[(64, "gradual")] == (0.2, 0.0, 1, 0)
    table = markdown_table(s, 32, 0.02)
    assert "| 32 | 1 | 0.02 | 20.00 ± 14.14 | 20.00 ± 14.14 | +0.00 |" in table
    assert "| 64 | 2 | 0.04 | 50.00 (1/1 diverged) | 20.00 | +0.00 |" in table
