"""``hpcjobs train`` as a user runs it (hpcjobs/cli/train.py)."""

import json
import os
import re

import pytest

from launch import mpirun as _mpirun
from launch import mpirun_script


BAD_ARGS = [
    (["--global-batch", "33"], "--global-batch 33 does not divide by 2 ranks x 1 passes"),
    (["--resume"], "--resume needs --checkpoint"),
    (["--checkpoint-every", "10"], "--checkpoint-every needs --checkpoint"),
    (["--checkpoint-every", "0", "--checkpoint", "/tmp/x.pt"], "must be positive"),
    (["--dataset", "synthetic", "--num-samples", "100", "-b", "64"], "larger than the training set"),
    (["--lr", "-1"], "must be positive"),
    (["--data-seed", "-1"], "--data-seed: must be from 0 to 2**32 - 1, got -1"),  # it was MNIST-1D's traceback
    # a traceback mid-run in the modes without lockstep; taken and ignored (then refused by --resume); an epoch
    # line skipped (each move of the one worker covered 2.5 epochs)
    (["--dataset", "text", "--mode", "local", "--local-steps", "1"], "the text dataset is for the GPTs"),
    (["--dataset", "synthetic", "--seq-len", "64"], "seq_len cuts the text dataset's sequences"),
    (["--dataset", "synthetic", "--num-samples", "100", "--epochs", "5", "--mode", "easgd", "--easgd-form", "async",
      "--local-steps", "5"], "an elastic move every 5 steps is more than an epoch of its 1 worker(s)"),
    (["--target-loss", "0"], "must be positive"),
    (["--loss-model", "power"], "--loss-model picks the model that predicts --target-loss"),
    (["--loss-model", "cubic"], "invalid choice: 'cubic'"),
    (["--dataset", "mnist"], "give data_dir"),
    (["--num-samples", "1234"], "give a multiple of 10 (1234 would make 1230)"),  # mnist1d: 1230, silently
    (["--dataset", "digits", "--data-dir", "/tmp"], "digits is made in memory: leave data_dir out"),
    (["--compression", "zip"], "unknown compression 'zip'"),
    (["--compression", "topk:2"], "ratio must be a number in (0, 1]"),
    (["--compression", "sign:3"], "takes no parameter"),
    (["--error-feedback"], "error feedback needs a compression"),
    (["--compression", "qsgd", "--algorithm", "shm"], "need a message-passing algorithm"),
    (["--mode", "async", "--global-batch", "64"], "--global-batch is for --mode sync"),
    (["--mode", "async", "--servers", "2"], "mode async needs workers: 2 ranks and 2 server(s)"),
    (["--mode", "local", "--straggler", "2:3"], "straggler rank 2 is not one of the 2 ranks"),
    # knobs the mode would ignore, and periods and rates it cannot train with
    (["--mode", "local", "--servers", "1"], "--servers is for --mode async and easgd --easgd-form async"),
    (["--mode", "async", "--local-steps", "4"], "--local-steps is for --mode local and easgd, not mode async"),
    (["--mode", "easgd", "--elastic-alpha", "0.8"], "by -1.4 at each move, so it grows; give --elastic-alpha "
                                                    "below 2/(W+1) = 0.6667"),
    (["--mode", "local", "--local-steps", "1000"], "make no average every 1000 steps"),
    (["--mode", "async", "--algorithm", "ring"], "mode async would ignore it"),
    (["--final-lr", "0.01"], "final_lr is where cosine decay ends, and decay is 'none'"),
]


@pytest.fixture(scope="module")
def refusals():
    """Every case of BAD_ARGS through ``main`` on 2 ranks, in one launch (a
    launch each took 4 s, most of it starting MPI and torch)."""
    from launch import main_in_one_launch

    return main_in_one_launch(2, [["train", "--epochs", "1", *args] for args, _ in BAD_ARGS])


@pytest.mark.parametrize("case", range(len(BAD_ARGS)), ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_train_arguments_exit_2_on_every_rank(refusals, case):
    (rc0, _, err0), (rc1, _, err1) = refusals[case]
    assert (rc0, rc1) == (2, 2), (err0, err1)
    assert BAD_ARGS[case][1] in err0


@pytest.mark.parametrize("args,words", [BAD_ARGS[0], BAD_ARGS[16]])  # refused by the flags; inside training
def test_a_refused_train_ends_every_rank_process_with_exit_2(args, words):
    out = _mpirun(2, "train", "--epochs", "1", *args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr


def test_cosine_decay_ends_at_the_final_lr_given(tmp_path):
    """--final-lr had no flag: cosine decay always ended at 0."""
    metrics = tmp_path / "m.jsonl"
    out = _mpirun(2, "train", "--epochs", "2", "--lr", "0.1", "--warmup", "none", "--decay", "cosine",
                  "--final-lr", "0.03", "--no-progress", "--metrics", str(metrics))
    assert out.returncode == 0, out.stderr
    rates = [json.loads(line)["lr"] for line in metrics.read_text().splitlines()]
    assert 0.03 < rates[0] < 0.1 and rates[-1] == pytest.approx(0.03, abs=1e-3)


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
    words = "is not an hpcjobs training checkpoint (not the zip file torch.save writes: it begins b'garb')"
    assert out.returncode == 1 and words in out.stderr and "weights_only" not in out.stderr, out.stderr


def test_a_run_killed_mid_epoch_resumes_to_the_parameters_of_an_uninterrupted_one(tmp_path):
    """SIGKILL the whole job in the middle of epoch 3 (or 4), after a mid-epoch
    checkpoint (--checkpoint-every), resume: the final parameters, BatchNorm
    statistics and every epoch's metrics equal a run that was never stopped
    (error-feedback residuals restored too, with top-k compression)."""
    import subprocess
    import time

    import torch
    from launch import _mpirun_prefix, kill_session, launch_env, run

    from hpcjobs.training.loop import CheckpointError, load_checkpoint

    common = ["-m", "hpcjobs", "train", "--dataset", "synthetic", "--num-samples", "12288", "--width", "32",
              "-b", "16", "--epochs", "4", "--seed", "3", "--algorithm", "ring", "--compression", "topk:0.1",
              "--error-feedback", "--batch-norm", "--no-progress", "-q", "--checkpoint-every", "40"]
    prefix = _mpirun_prefix(2)
    # The killed mpirun leaves its session folder behind: in a TMPDIR of this
    # test's own, which launch_env removes.
    with launch_env() as env:
        straight = run([*prefix, *common, "--checkpoint", str(tmp_path / "a.pt"),
                        "--metrics", str(tmp_path / "a.jsonl")], 300, env)
        assert straight.returncode == 0, straight.stderr
        metrics, ckpt = tmp_path / "b.jsonl", tmp_path / "b.pt"
        job = subprocess.Popen([*prefix, *common, "--checkpoint", str(ckpt), "--metrics", str(metrics)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                               start_new_session=True)

        def where():
            try:
                state = load_checkpoint(ckpt)
                return state["epoch"], state["step"]
            except (FileNotFoundError, CheckpointError):
                return 0, 0

        deadline = time.monotonic() + 240
        while where() < (2, 1):  # 2 epochs and the first checkpoint of epoch 3 (step 26 of 307)
            assert job.poll() is None and time.monotonic() < deadline, f"the job ended at {where()}"
            time.sleep(0.02)
        kill_session(job.pid)  # mpirun and both ranks (killpg would leave the ranks running)
        job.wait(timeout=30)
        epoch, step = where()
        # killed mid-epoch, after a mid-epoch checkpoint: of epoch 3 as a rule, of epoch 4 where this process was
        # held up for the 281 steps to epoch 3's end (the flake review: tiny steps, 2 ranks busy on 2 cores)
        assert epoch in (2, 3) and step > 0, (epoch, step)
        resumed = run([*prefix, *common, "--checkpoint", str(ckpt), "--metrics", str(metrics), "--resume"],
                      300, env)
        assert resumed.returncode == 0, resumed.stderr
    a, b = load_checkpoint(tmp_path / "a.pt"), load_checkpoint(ckpt)
    assert a["epoch"] == b["epoch"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for ra, rb in zip(a["ranks"], b["ranks"]):  # each rank's own state
        for k in ra["buffers"]:
            assert torch.equal(ra["buffers"][k], rb["buffers"][k]), k
    keep = ("epoch", "step", "lr", "loss", "train_acc", "test_loss", "test_acc", "sent_bytes")
    lines = [[{k: json.loads(line)[k] for k in keep} for line in open(f)] for f in (tmp_path / "a.jsonl", metrics)]
    assert lines[0] == lines[1] and len(lines[0]) == 4


def test_a_signal_to_one_rank_stops_every_rank_after_a_checkpoint_and_resume_finishes_the_run(tmp_path):
    """SIGTERM (Slurm's at a time limit or preemption) to one rank alone
    after epoch 1 of 4: every rank stops at the same step after a checkpoint
    of it, exit status 143; --resume ends with the parameters, BatchNorm
    statistics and metrics of a run never stopped. Before, the run died where
    it stood and lost everything since its last checkpoint."""
    import signal
    import subprocess
    import time

    import torch
    from launch import _mpirun_prefix, launch_env, run, session_pids

    from hpcjobs.training.loop import load_checkpoint

    common = ["-m", "hpcjobs", "train", "--dataset", "synthetic", "--num-samples", "12288", "--width", "32", "-b", "8",
              "--epochs", "4", "--seed", "5", "--algorithm", "ring", "--batch-norm", "--no-progress", "-q"]
    prefix = _mpirun_prefix(2)
    with launch_env() as env:
        # HPCJOBS_STOP_FILE (`slurm launch --requeue` sets it): where a run a signal stopped says so
        straight = run([*prefix, *common, "--checkpoint", str(tmp_path / "a.pt"), "--metrics",
                        str(tmp_path / "a.jsonl")], 300, {**env, "HPCJOBS_STOP_FILE": str(tmp_path / "a.stop")})
        assert straight.returncode == 0, straight.stderr
        assert not (tmp_path / "a.stop").exists()  # not stopped: nothing to say
        metrics, ckpt = tmp_path / "b.jsonl", tmp_path / "b.pt"
        job = subprocess.Popen([*prefix, *common, "--checkpoint", str(ckpt), "--metrics", str(metrics)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**env, "HPCJOBS_STOP_FILE": str(tmp_path / "b.stop")}, start_new_session=True)
        deadline = time.monotonic() + 240
        while not ckpt.exists():  # epoch 1's checkpoint: 3 epochs of 512 steps to go
            assert job.poll() is None and time.monotonic() < deadline, "the job ended before its first checkpoint"
            time.sleep(0.01)
        time.sleep(0.05)  # into epoch 2, most likely: where it stops, the message says and the test follows
        ranks = [pid for pid in session_pids(job.pid) if pid != job.pid]
        os.kill(max(ranks), signal.SIGTERM)  # one rank, the last started
        out, err = job.communicate(timeout=120)
        state = load_checkpoint(ckpt)
        assert job.returncode == 128 + signal.SIGTERM, err
        where = (f"at step {state['step']} of epoch {state['epoch'] + 1}" if state["step"] else
                 f"after epoch {state['epoch']}")
        words = f"hpcjobs train: SIGTERM: checkpoint {ckpt} written {where}; stopped"
        assert 1 <= state["epoch"] < 4 and words in err, (state["epoch"], state["step"], err)
        assert json.loads((tmp_path / "b.stop").read_text()) == {
            "signal": "SIGTERM", "epoch": state["epoch"], "step": state["step"], "checkpoint": str(ckpt),
            "written": True}
        resumed = run([*prefix, *common, "--checkpoint", str(ckpt), "--metrics", str(metrics), "--resume"], 300, env)
        assert resumed.returncode == 0, resumed.stderr
    a, b = load_checkpoint(tmp_path / "a.pt"), load_checkpoint(ckpt)
    assert a["epoch"] == b["epoch"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for ra, rb in zip(a["ranks"], b["ranks"]):
        for k in ra["buffers"]:
            assert torch.equal(ra["buffers"][k], rb["buffers"][k]), k
    keep = ("epoch", "step", "lr", "loss", "train_acc", "test_loss", "test_acc")
    lines = [[{k: json.loads(line)[k] for k in keep} for line in open(f)] for f in (tmp_path / "a.jsonl", metrics)]
    assert lines[0] == lines[1] and len(lines[0]) == 4


def test_each_ranks_own_state_comes_back_from_a_mid_epoch_checkpoint(tmp_path):
    """Rank 0 SIGKILLs itself right after the last mid-epoch checkpoint of
    epoch 2, a few steps before the epoch ends, when the ranks' BatchNorm
    statistics still differ (they are averaged at the epoch's end) and
    their loss sums are half-counted: the resumed run must restore each
    rank's own, or the statistics and the epoch's metrics come out different."""
    import torch

    from hpcjobs.training.loop import load_checkpoint

    args = ["train", "--dataset", "synthetic", "--num-samples", "8192", "--width", "32", "-b", "16",
            "--epochs", "3", "--seed", "5", "--batch-norm", "--no-progress", "-q", "--checkpoint-every", "40"]

    def run(name, kill=None, resume=False):
        extra = ["--checkpoint", str(tmp_path / f"{name}.pt"), "--metrics", str(tmp_path / f"{name}.jsonl")]
        return mpirun_script(2, f"""
import os, signal, sys
from hpcjobs.cli import main
from hpcjobs.training import checkpoint
save = checkpoint.write
def checkpoint_then_die(cfg, comm, model, inner, opt, history, epoch, step, partial, scaler=None):
    save(cfg, comm, model, inner, opt, history, epoch, step, partial, scaler)
    if comm.Get_rank() == 0 and (epoch, step) == {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.write = checkpoint_then_die
sys.exit(main({args + extra + (["--resume"] if resume else [])!r}))
""", timeout=300)

    straight = run("a")
    assert straight.returncode == 0, straight.stderr
    spe = json.loads(open(tmp_path / "a.jsonl").readline())["step"]
    last = max(k for k in range(1, spe) if (spe + k) % 40 == 0)  # epoch 2's last mid-epoch checkpoint
    assert spe - last < 40
    killed = run("b", kill=(1, last))
    assert killed.returncode != 0
    state = load_checkpoint(tmp_path / "b.pt")
    assert (state["epoch"], state["step"]) == (1, last)
    bn = [k for k in state["ranks"][0]["buffers"] if k.endswith("running_mean")]
    assert bn and not all(torch.equal(state["ranks"][0]["buffers"][k], state["ranks"][1]["buffers"][k]) for k in bn)
    resumed = run("b", resume=True)
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_checkpoint(tmp_path / "a.pt"), load_checkpoint(tmp_path / "b.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    keep = ("epoch", "step", "lr", "loss", "train_acc", "test_loss", "test_acc")
    lines = [[{k: json.loads(line)[k] for k in keep} for line in open(tmp_path / f)] for f in ("a.jsonl", "b.jsonl")]
    assert lines[0] == lines[1] and len(lines[0]) == 3


@pytest.mark.parametrize("mode", [["--mode", m] for m in ("sync", "async", "local", "easgd", "hogwild")]
                         + [["--mode", "easgd", "--easgd-form", "async"]])
def test_every_mode_takes_the_train_templates_checkpoint_and_resume(mode):
    """slurm/train.sbatch passes --checkpoint and --resume to every train (HPCJOBS_CHECKPOINT=1, its default):
    asynchronous EASGD refused them until 2026-11-30."""
    from hpcjobs.cli import _parser_for
    from hpcjobs.cli.train import config_from_args

    argv = ["train", *mode, "--checkpoint", "c.pt", "--resume"]
    cfg = config_from_args(_parser_for(argv)[1].parse_args(argv), 4)
    assert (cfg.checkpoint, cfg.resume) == ("c.pt", True)


EARLY = """
import os, signal, sys
import hpcjobs.training.loop as loop
from hpcjobs.cli import main

load = loop.load_dataset_of


def signalled_then_load(*args, **kwargs):  # while the rank loads its data: before the run's handlers
    if os.environ.get("OMPI_COMM_WORLD_RANK", "0") == os.environ["SIGNALLED_RANK"]:
        os.kill(os.getpid(), signal.SIGUSR1)
    return load(*args, **kwargs)


loop.load_dataset_of = signalled_then_load
sys.exit(main(["train", "--dataset", "synthetic", "--num-samples", "4096", "--width", "16", "-b", "8",
               "--epochs", "2", "--seed", "5", "--no-progress", "-q", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("ranks,checkpoint", [(1, True), (2, True), (1, False)])
def test_a_sigusr1_before_the_runs_handlers_stops_a_requeueable_run_at_its_first_step(tmp_path, ranks, checkpoint):
    """A rank of `slurm launch --requeue` (HPCJOBS_STOP_FILE set) notes a
    SIGUSR1 from the start, before torch, MPI, the data or a resumed
    checkpoint are loaded, and the run takes it over: every rank stops two
    steps in (the signal reaches one rank of two: the other stops there
    too) with a checkpoint, exit status 138, and says so in the stop file,
    which requeues the job. Before, the signal killed the rank there (the
    job failed and was not requeued). A run without --checkpoint takes no
    signals: the signal noted is raised again and ends it, as it had."""
    import signal
    import sys

    from launch import _mpirun_prefix, launch_env, run

    script, stop, ckpt = tmp_path / "early.py", tmp_path / "stopped.json", tmp_path / "c.pt"
    script.write_text(EARLY)
    args = ["--checkpoint", str(ckpt)] if checkpoint else []
    cmd = [*_mpirun_prefix(ranks), str(script)] if ranks > 1 else [sys.executable, str(script)]
    with launch_env() as env:
        out = run([*cmd, *args], 120, {**env, "HPCJOBS_STOP_FILE": str(stop), "SIGNALLED_RANK": str(ranks - 1)})
    if not checkpoint:
        assert out.returncode == -signal.SIGUSR1 and not stop.exists(), (out.returncode, out.stderr[-2000:])
        return
    assert out.returncode == 128 + signal.SIGUSR1, (out.returncode, out.stderr[-2000:])
    record = json.loads(stop.read_text())
    assert record == {"signal": "SIGUSR1", "epoch": 0, "step": 2, "checkpoint": str(ckpt), "written": True}, record
    assert f"hpcjobs train: SIGUSR1: checkpoint {ckpt} written at step 2 of epoch 1" in out.stderr, out.stderr


@pytest.mark.parametrize("every", [None, "20"], ids=["epoch end", "mid-epoch"])
def test_a_stalled_checkpoint_write_is_named_by_the_watchdog(tmp_path, every):
    """Rank 0's write held longer than HPCJOBS_TIMEOUT: mid-epoch the others
    went on into the next allreduce and the report named rank 0 as missing
    from it; at an epoch's end they waited in an unwatched gather for good.
    Now every rank waits in checkpoint_write, and that is what is said."""
    from launch import mpirun

    args = ["train", "--dataset", "synthetic", "--num-samples", "800", "--width", "16", "-b", "8", "--epochs", "1",
            "--no-progress", "-q", "--checkpoint", str(tmp_path / "c.pt")] + (["--checkpoint-every", every] if every
                                                                               else [])
    out = mpirun(2, *args, env={"HPCJOBS_FAULT_SLOW_CHECKPOINT": "30", "HPCJOBS_TIMEOUT": "3"}, timeout=60)
    assert out.returncode != 0, out.stderr[-3000:]
    assert re.search(r"rank \d: checkpoint_write \(call #\d+\) did not complete within 3 s", out.stderr), \
        out.stderr[-3000:]


def test_a_checkpoint_write_that_fails_on_rank_0_fails_every_rank_at_once(tmp_path):
    """A full disk on rank 0: the others waited for its write until the
    watchdog, and the cause was on rank 0's stderr alone."""
    from launch import mpirun

    ckpt = tmp_path / "c.pt"
    ckpt.symlink_to("/proc/no-such-folder/c.pt")  # written through: its temp file cannot be made there
    out = mpirun(2, "train", "--dataset", "synthetic", "--num-samples", "400", "--width", "16", "-b", "8",
                 "--epochs", "1", "--no-progress", "-q", "--checkpoint", str(ckpt), env={"HPCJOBS_TIMEOUT": "60"},
                 timeout=60)
    assert out.returncode != 0 and "did not complete within" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.count(f"writing the checkpoint {ckpt} failed on rank 0") == 2, out.stderr[-3000:]
