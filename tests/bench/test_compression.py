"""``hpcjobs bench compression``: every compressor in one run, bytes as the
payloads weigh, results identical on every rank, and the training study."""

import json

import pytest
from launch import mpirun, mpirun_script


def test_bench_compression_tensors_and_training(tmp_path):
    out = mpirun(2, "bench", "compression", "--elements", "3000,20K", "--iters", "2", "--train", "--epochs", "1",
                 "--num-samples", "1000", "--seeds", "1", "--compressors", "fp16,topk:0.01,sign,powersgd:1",
                 "--out", str(tmp_path), "--no-progress", timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.load(open(tmp_path / "results.json"))
    rows = {(r["elements"], r["compressor"]): r for r in data["tensors"]}
    assert len(rows) == 2 * 6 and all(r["differ"] == 0 for r in rows.values())
    n = 20_000
    assert rows[(n, "fp32 ring")]["wire_bytes"] == 4 * n  # 2(P-1)/P * 4n at P=2
    assert rows[(n, "fp16")]["ratio"] == 2.0
    assert rows[(n, "topk:0.01")]["wire_bytes"] == 8 * 200 + 16  # 200 values + indices, then the size table
    assert rows[(n, "sign")]["wire_bytes"] == -(-n // 64) * 8 + 8 + 16  # bits, padded to 8 bytes; the scale
    assert rows[(n, "powersgd:1")]["ratio"] > 50
    cells = [(r["compressor"], r["error_feedback"]) for r in data["training"]]
    assert cells[0] == ("none", False) and ("topk:0.01", True) in cells and len(cells) == 9
    assert all(0 <= r["test_acc"] <= 1 and r["sent_bytes"] > 0 for r in data["training"])
    assert "| topk:0.01 | yes |" in (tmp_path / "compression.md").read_text()


@pytest.mark.parametrize("flag,value,message", [("--compressors", "zip", "unknown compression 'zip'"),
                                                ("--compressors", "none", "baseline"),
                                                ("--elements", "1X", "not a count"),
                                                ("--algorithm", "shm", "invalid choice")])
def test_bad_arguments_are_usage_errors(flag, value, message):
    out = mpirun(2, "bench", "compression", flag, value)
    assert out.returncode == 2 and message in out.stderr


def test_the_auto_row_is_timed_after_auto_has_settled():
    """auto measures its candidates in place for its first calls at a size
    (at 2 ranks a float32 average has three); the fp32 auto row is timed
    after that, as the allreduce sweep is, not over its trials."""
    out = mpirun_script(2, """
import torch
from mpi4py import MPI
from hpcjobs.bench.compression import _shape, tensor_rows
from hpcjobs.collectives import auto
comm = MPI.COMM_WORLD
rows = tensor_rows(comm, [20_000], ["fp16"], 2, "ring")
assert auto.settled(torch.zeros(_shape(20_000)), "avg", comm) and len(rows) == 3
print("ok", comm.rank)
""", timeout=240)
    assert out.returncode == 0 and out.stdout.count("ok") == 2, out.stdout[-2000:] + out.stderr[-3000:]


def test_the_training_table_at_one_rank_has_no_byte_ratio_and_does_not_fail():
    """At 1 rank nothing is sent, so "fewer bytes" has no value: the table
    raised TypeError after every run had trained."""
    from hpcjobs.bench.compression import train_table

    row = dict(compressor="none", error_feedback=False, test_acc=0.5, test_acc_sd=0.0, accs=[0.5], diverged=0,
               sent_bytes=0.0, delta_points=0.0, fewer_bytes=None, time_ratio=1.0)
    assert "| none | no | 50.00 ± 0.00 | +0.00 | 0 | - | 1.00 |" in train_table([row])
