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


def test_a_run_killed_mid_epoch_resumes_to_the_parameters_of_an_uninterrupted_one(tmp_path):
    """SIGKILL the whole job during epoch 3 or later, resume from the last
    checkpoint: the final parameters equal a run that was never stopped
    (and error-feedback residuals are restored, with top-k compression)."""
    import os
    import signal
    import subprocess
    import time

    import torch
    from launch import _mpirun_prefix, clean_env

    from hpcjobs.training.loop import load_checkpoint

    common = ["-m", "hpcjobs", "train", "--dataset", "synthetic", "--num-samples", "32768", "--width", "32",
              "-b", "16", "--epochs", "5", "--seed", "3", "--algorithm", "ring", "--compression", "topk:0.1",
              "--error-feedback", "--no-progress", "-q"]
    prefix = _mpirun_prefix(2)
    straight = subprocess.run([*prefix, *common, "--checkpoint", str(tmp_path / "a.pt")], capture_output=True,
                              text=True, timeout=300, env=clean_env())
    assert straight.returncode == 0, straight.stderr
    metrics = tmp_path / "m.jsonl"
    job = subprocess.Popen([*prefix, *common, "--checkpoint", str(tmp_path / "b.pt"), "--metrics", str(metrics)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(),
                           start_new_session=True)
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert job.poll() is None and time.monotonic() < deadline, "the job ended before epoch 2"
        time.sleep(0.05)
    time.sleep(0.3)  # into epoch 3
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    assert load_checkpoint(tmp_path / "b.pt")["epoch"] < 5  # it really was cut short
    resumed = subprocess.run([*prefix, *common, "--checkpoint", str(tmp_path / "b.pt"), "--resume"],
                             capture_output=True, text=True, timeout=300, env=clean_env())
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_checkpoint(tmp_path / "a.pt"), load_checkpoint(tmp_path / "b.pt")
    assert a["epoch"] == b["epoch"] == 5
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
