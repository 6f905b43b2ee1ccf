"""``train``'s epoch lines as a reader takes them: strict JSON where a run
diverged (and the run failing), on stdout once, training time without
the checkpoints' writes, and plan naming a file of another mode."""

import json
import subprocess
import sys

from hpcjobs.training.checkpoint import SLOW_CKPT_ENV
from launch import clean_env, hpcjobs_here

TINY = ["--model", "mlp", "--width", "16", "--dataset", "synthetic", "--num-samples", "400", "--batch-per-rank",
        "16", "--no-progress"]


def _train(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, "-m", "hpcjobs", "train", *TINY, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**clean_env(), **(env or {})})


def _strict(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines() if line.startswith("{")]


def test_a_diverged_run_writes_null_not_nan_and_fails_saying_so_under_q_too(tmp_path):
    # --nonfinite skip keeps the parameters finite: the diverged epoch's checkpoint had been written, to resume from
    out = _train(tmp_path, "--epochs", "3", "--lr", "1e20", "--metrics", "m.jsonl", "-q", "--nonfinite", "skip",
                 "--checkpoint", "c.pt")
    assert out.returncode == 1, out.stderr
    assert "the run diverged" in out.stderr and "c.pt is not written of that epoch" in out.stderr
    assert out.stdout == ""
    lines = _strict((tmp_path / "m.jsonl").read_text())  # Python had written NaN, which JSON has not
    assert lines[-1]["loss"] is None and len(lines) < 3
    assert not (tmp_path / "c.pt").exists()  # (it diverged in its first epoch)


def test_metrics_on_stdout_is_written_there_once(tmp_path):
    for where in ("-", "/dev/stdout"):
        out = _train(tmp_path, "--epochs", "2", "--metrics", where)
        assert out.returncode == 0, out.stderr
        assert [line["epoch"] for line in _strict(out.stdout)] == [1, 2], out.stdout  # (each line twice before)
    assert not (tmp_path / "-").exists()


def test_an_epochs_time_leaves_out_its_checkpoints_writes(tmp_path):
    # each write held 2 s (the tests' slow file system), at steps 5, 10 and 15 of the 20 in the epoch: 6 s; the
    # 20 steps alone take about 0.05 s, so one write counted shows however loaded the machine
    out = _train(tmp_path, "--epochs", "1", "--checkpoint", "c.pt", "--checkpoint-every", "5", "--metrics",
                 "m.jsonl", "-q", env={SLOW_CKPT_ENV: "2"})
    assert out.returncode == 0, out.stderr
    line = _strict((tmp_path / "m.jsonl").read_text())[0]
    assert line["step"] == 20 and line["epoch_s"] < 2.0 and line["samples_per_s"] > 160, line


def test_plan_names_a_metrics_file_of_another_mode(tmp_path):
    path = tmp_path / "local.jsonl"
    path.write_text("".join(json.dumps({"epoch": e, "mode": "local", "loss": 2.0 / e + 0.1, "samples": 320,
                                        "workers": 2}) + "\n" for e in range(1, 7)))
    r = hpcjobs_here("plan", "--params", "1M", "--throughput", "100", "--batch-per-device", "8", "--devices", "1",
                     "--metrics", str(path), "--target-loss", "0.5")
    assert r.returncode == 2 and "a run of --mode local; plan predicts synchronous training" in r.stderr, r.stderr
