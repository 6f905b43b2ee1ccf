"""``hpcjobs train`` as a user runs it (hpcjobs/training/cli.py)."""

import json

import pytest

from launch import mpirun as _mpirun


@pytest.mark.parametrize("args,words", [
    (["--global-batch", "33"], "--global-batch 33 does not divide by 2 ranks x 1 passes"),
    (["--resume"], "--resume needs --checkpoint"),
    (["--dataset", "synthetic", "--num-samples", "100", "-b", "64"], "larger than the training set"),
    (["--lr", "-1"], "must be positive"),
    (["--dataset", "mnist"], "give data_dir"),
    (["--compression", "zip"], "unknown compression 'zip'"),
    (["--compression", "topk:2"], "ratio must be a number in (0, 1]"),
    (["--compression", "sign:3"], "takes no parameter"),
    (["--error-feedback"], "error feedback needs a compression"),
    (["--compression", "qsgd", "--algorithm", "shm"], "need a message-passing algorithm"),
])
def test_bad_train_arguments_exit_2_on_every_rank(args, words):
    out = _mpirun(2, "train", "--epochs", "1", *args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr


def test_train_writes_metrics_and_a_checkpoint_then_resumes(tmp_path):
    common = ["train", "--dataset", "synthetic", "--num-samples", "800", "--width", "16", "-b", "16",
              "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint", str(tmp_path / "c.pt"), "--no-progress"]
    out = _mpirun(2, *common, "--epochs", "2")
    assert out.returncode == 0, out.stderr
    assert "global batch 32" in out.stdout and "final test accuracy" in out.stdout
    out = _mpirun(2, *common, "--epochs", "3", "--resume")
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout
    epochs = [json.loads(line)["epoch"] for line in open(tmp_path / "m.jsonl")]
    assert epochs == [1, 2, 3]
    (tmp_path / "c.pt").write_bytes(b"garbage")
    out = _mpirun(2, *common, "--epochs", "4", "--resume")
    assert out.returncode == 1 and "truncated or corrupt" in out.stderr
