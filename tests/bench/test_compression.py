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


def test_the_training_cells_are_warmed_up_then_timed_in_turned_rounds(monkeypatch):
    """The cells ran in one fixed order, "none" always first, each seed's run timed whole: the data's first load
    and torch's first calls landed on "none" (0.72 s against 0.04 s the same run again), and every "time vs none"
    leaned the compressors' way. Each cell now has an untimed epoch, then rounds whose order turns."""
    from mpi4py import MPI

    from hpcjobs.bench import compression

    calls = []

    def train(cfg, comm):
        calls.append((cfg.compression, cfg.error_feedback, cfg.seed, cfg.epochs))
        return [dict(test_acc=0.5, loss=1.0, sent_bytes=10.0)] * cfg.epochs

    monkeypatch.setattr(compression, "train", train)
    rows = compression.train_rows(MPI.COMM_SELF, ["bf16"], "mlp", 100, 3, 8, 0.01, seeds=3)
    cells = [("none", False), ("bf16", False), ("bf16", True)]
    assert calls[:3] == [(*c, 0, 1) for c in cells]  # the untimed epochs
    assert [c[:3] for c in calls[3:]] == [(*c, s) for s, order in enumerate([cells, cells[1:] + cells[:1],
                                                                           cells[2:] + cells[:2]]) for c in order]
    assert all(c[3] == 3 for c in calls[3:])
    assert [(r["compressor"], r["error_feedback"], r["accs"]) for r in rows] == [(*c, [0.5] * 3) for c in cells]


def test_an_fp32_row_that_is_not_the_average_counts_as_differing():
    """The fp32 rows were checked for agreement across ranks only: a ring that summed and did not divide
    agreed on every rank and passed. Here it is made to sum; auto's row still averages."""
    out = mpirun_script(2, """
from mpi4py import MPI
from hpcjobs.bench import compression
plain = compression.counted_allreduce
compression.counted_allreduce = lambda buf, op, *a: plain(buf, "sum", *a)
rows = {r["compressor"]: r["differ"] for r in compression.tensor_rows(MPI.COMM_WORLD, [3000], ["fp16"], 2, "ring")}
print("differ", rows["fp32 ring"], rows["fp32 auto"], rows["fp16"])
""", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines().count("differ 2 0 0") == 2, out.stdout
