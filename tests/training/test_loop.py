"""The training loop: metrics, checkpoints, resume, and bad checkpoints."""

import json
import math
import os
import re
import types

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcjobs.training import checkpoint
from hpcjobs.training.data import opened_fingerprint
from hpcjobs.training.loop import (CHECKPOINT_VERSION, CheckpointError, TrainConfig, load_checkpoint, save_checkpoint,
                                   train)

torch.set_num_threads(1)


def shared_dir(tmp_path_factory, name):
    comm = MPI.COMM_WORLD
    return comm.bcast(str(tmp_path_factory.mktemp(name)) if comm.rank == 0 else None)


def cfg(**kw):
    base = dict(model="mlp", width=16, dataset="synthetic", num_samples=600, batch_per_rank=8, lr=0.05,
                warmup="gradual", warmup_epochs=1, epochs=4, seed=3, quiet=True, progress=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.mpi(min_size=1)
def test_training_learns_and_reports_every_epoch(tmp_path_factory):
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "metrics")
    size = comm.Get_size()
    history = train(cfg(metrics=f"{d}/m.jsonl", batch_per_rank=max(1, 16 // size)), comm)
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["test_acc"] > 0.3          # 10 classes: chance is ~0.1
    assert all(0 <= h["comm_share"] <= 1 and h["samples_per_s"] > 0 for h in history)
    if comm.rank == 0:
        lines = [json.loads(x) for x in open(f"{d}/m.jsonl")]
        assert [x["epoch"] for x in lines] == [1, 2, 3, 4]
        assert lines[-1]["global_batch"] == size * max(1, 16 // size)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("compression", ["none", "topk:0.1", "randomk:0.2", "powersgd:1"])
def test_resume_continues_to_the_same_parameters(tmp_path_factory, compression):
    """4 epochs straight == 2 epochs, stop, resume to 4 (deterministic mode);
    with compression the checkpoint carries every rank's error-feedback
    residuals, the step count and PowerSGD's warm start."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "resume-" + compression.replace(":", ""))
    kw = dict(optimizer="sgd", momentum=0.9, batch_norm=True, compression=compression,
              error_feedback=compression != "none")
    straight = train(cfg(checkpoint=f"{d}/a.pt", **kw), comm)
    train(cfg(checkpoint=f"{d}/b.pt", epochs=2, **kw), comm)
    resumed = train(cfg(checkpoint=f"{d}/b.pt", resume=True, **kw), comm)
    assert [h["epoch"] for h in resumed] == [1, 2, 3, 4]
    assert resumed[-1]["loss"] == pytest.approx(straight[-1]["loss"], rel=1e-6)
    if comm.rank == 0:
        a, b = load_checkpoint(f"{d}/a.pt"), load_checkpoint(f"{d}/b.pt")
        assert a["epoch"] == b["epoch"] == 4
        for k in a["model"]:
            torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=1)
def test_resume_with_fp16_ends_where_the_unbroken_run_does(tmp_path_factory):
    """fp16's GradScaler starts at 2**16, halves on each overflowing step
    (which it skips) and counts the clean steps since, to grow again after
    2000. Resumed from the saved scale and count, the run's scaler ends where
    the unbroken run's does, and so do the parameters."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "resume-fp16")
    kw = dict(optimizer="sgd", momentum=0.9, amp="fp16")
    straight = train(cfg(checkpoint=f"{d}/a.pt", **kw), comm)
    train(cfg(checkpoint=f"{d}/b.pt", epochs=2, **kw), comm)
    resumed = train(cfg(checkpoint=f"{d}/b.pt", resume=True, **kw), comm)
    assert resumed[-1]["loss"] == pytest.approx(straight[-1]["loss"], rel=1e-6)
    if comm.rank == 0:
        a, b = load_checkpoint(f"{d}/a.pt"), load_checkpoint(f"{d}/b.pt")
        assert b["scaler"] == a["scaler"] and a["scaler"]["_growth_tracker"] > 0
        for k in a["model"]:
            torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-6, atol=1e-7)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("compression", ["topk:0.1", "powersgd:1"])
# the overflowed steps' inf - inf in numpy's sums: what this test makes happen, and the scaler skips
@pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")
def test_fp16_with_error_feedback_lives_through_the_scalers_overflows(compression, monkeypatch):
    """fp16's GradScaler starts high and overflows, by design, until it has
    halved enough; those steps are skipped. Their residuals (inf - inf) and
    PowerSGD's warm start must not keep NaN, or every later step is NaN and
    skipped too; and the residuals, kept in the loss scale's units, follow
    the scale down. The run must learn as it does without the overflows:
    its last loss within 10% of the same run's in float32 (1 to 5 ranks
    here: within 6%; a run stuck on NaN steps stays at 2.3, 40% above).
    On the CPU no step overflows at the scaler's first scale, 2**16, so it
    starts here at 2**20, where the autocast's float16 gradients do: 4 to 6
    of 120 steps are skipped (at 2**40, 22; the runs fell behind
    float32 by more than 10%), and the records count them in skipped_steps.
    (It asked for a test accuracy above 0.3 on 120 samples, which the run at
    4 ranks with PowerSGD met by 3 samples, and missed by none -- 0.30 --
    once a skipped step kept every bucket's residual.)"""
    comm = MPI.COMM_WORLD
    kw = dict(optimizer="sgd", momentum=0.9, compression=compression, error_feedback=True,
              batch_per_rank=max(1, 16 // comm.Get_size()))
    scaler = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device: scaler(device, init_scale=2.0 ** 20))
    history = train(cfg(amp="fp16", **kw), comm)
    monkeypatch.undo()
    losses = [h["loss"] for h in history]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert sum(h.get("skipped_steps", 0) for h in history) >= 1, history
    fp32 = train(cfg(**kw), comm)[-1]["loss"]
    assert losses[-1] == pytest.approx(fp32, rel=0.1), (losses, fp32)


@pytest.mark.mpi(min_size=2)
def test_ranks_start_from_one_model_and_then_draw_their_own_random_numbers():
    """Every rank builds the same model from the seed; what draws from torch's
    generator after that (QSGD's stochastic rounding) draws per rank, or the
    ranks' rounding errors would be the same and their average no less noisy."""
    from hpcjobs.training.loop import _setup

    comm = MPI.COMM_WORLD
    run = _setup(cfg(compression="qsgd"), comm)
    flat = torch.cat([p.detach().flatten() for p in run.model.parameters()])
    assert all(torch.equal(flat, other) for other in comm.allgather(flat))
    draws = comm.allgather(torch.rand(4))
    assert not any(torch.equal(draws[0], d) for d in draws[1:])


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_gives_every_rank_the_saved_gradscaler_state(tmp_path_factory):
    """write() saves rank 0's scaler; read() gives its scale and count to a
    fresh scaler on every rank; a checkpoint without one (no fp16, or older)
    leaves the fresh scaler as it is."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "scaler")
    c = cfg(checkpoint=f"{d}/s.pt", amp="fp16")
    model, saved = torch.nn.Linear(3, 2), torch.amp.GradScaler("cpu")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    saved.load_state_dict({"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                           "_growth_tracker": 7})
    no_compression = types.SimpleNamespace(compression=None)
    checkpoint.write(c, comm, model, inner, no_compression, [], 1, 0, None, saved)
    fresh = torch.amp.GradScaler("cpu")
    assert checkpoint.read(c, model, inner, comm, fresh)[0] == 1
    assert fresh.state_dict() == saved.state_dict()
    checkpoint.write(c, comm, model, inner, no_compression, [], 1, 0, None)      # no scaler saved
    untouched = torch.amp.GradScaler("cpu")
    checkpoint.read(c, model, inner, comm, untouched)
    assert untouched.state_dict() == torch.amp.GradScaler("cpu").state_dict()


@pytest.mark.mpi(min_size=1)
def test_a_corrupt_checkpoint_fails_on_every_rank(tmp_path_factory):
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "corrupt")
    train(cfg(checkpoint=f"{d}/c.pt", epochs=1), comm)
    comm.Barrier()
    if comm.rank == 0:
        raw = open(f"{d}/c.pt", "rb").read()
        open(f"{d}/c.pt", "wb").write(raw[: len(raw) // 2])
    comm.Barrier()
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        train(cfg(checkpoint=f"{d}/c.pt", resume=True), comm)


@pytest.mark.mpi(min_size=1)
def test_resuming_another_experiment_is_refused(tmp_path_factory):
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "other")
    train(cfg(checkpoint=f"{d}/o.pt", epochs=1), comm)
    with pytest.raises(CheckpointError, match="another experiment: model 'mlp' -> 'cnn1d'"):
        train(cfg(checkpoint=f"{d}/o.pt", resume=True, model="cnn1d"), comm)
    # the optimizer's saved settings would come back with its state and overrule the flag: refused, not ignored
    with pytest.raises(CheckpointError, match="another experiment: momentum 0.9 -> 0.5"):
        train(cfg(checkpoint=f"{d}/o.pt", resume=True, momentum=0.5), comm)
    # the checkpoint records the data's fingerprint: other data (files changed since) is refused, saying so
    if comm.rank == 0:
        state = torch.load(f"{d}/o.pt", weights_only=False)
        assert state["data"] == opened_fingerprint(cfg()) and len(state["data"]) == 32
        torch.save(dict(state, data="0" * 32), f"{d}/d.pt")
    comm.Barrier()
    with pytest.raises(CheckpointError, match=r"d\.pt was trained on other synthetic data than this run opened "
                                              r"\(fingerprint 000000000000, now [0-9a-f]{12}\): its files changed; "):
        train(cfg(checkpoint=f"{d}/d.pt", resume=True, epochs=2), comm)
    # the bucket size may change without error feedback on a cast (a setting the optimizer does not take, as
    # plain SGD's trust coefficient, is refused by the configuration itself)
    history = train(cfg(checkpoint=f"{d}/o.pt", resume=True, epochs=2, fusion_bytes=4096), comm)
    assert [h["epoch"] for h in history] == [1, 2]
    # fp16's residuals are kept per fused bucket: other buckets would take another bucket's
    train(cfg(checkpoint=f"{d}/f.pt", epochs=1, compression="fp16", error_feedback=True), comm)
    with pytest.raises(CheckpointError, match="another experiment: fusion_bytes"):
        train(cfg(checkpoint=f"{d}/f.pt", resume=True, epochs=2, compression="fp16", error_feedback=True,
                  fusion_bytes=4096), comm)
    # fp16 keeps the residuals in loss-scale units: a checkpoint of an fp16 run (its config made so here: fp16
    # runs on GPUs) resumed without it would add them 2**16 times too large
    if comm.rank == 0:
        state = torch.load(f"{d}/f.pt", weights_only=False)
        state["config"]["amp"] = "fp16"
        torch.save(state, f"{d}/f.pt")
    comm.Barrier()
    with pytest.raises(CheckpointError, match="another experiment: amp 'fp16' -> 'none'"):
        train(cfg(checkpoint=f"{d}/f.pt", resume=True, epochs=2, compression="fp16", error_feedback=True), comm)
    # digits with a sample count and a seed, as runs saved them before the flags were refused where the dataset
    # ignores them (its config made so here): the same experiment, resumed; a changed seed still splits it anew
    digits = dict(dataset="digits", num_samples=None, batch_per_rank=4)
    train(cfg(checkpoint=f"{d}/d.pt", epochs=1, **digits), comm)
    if comm.rank == 0:
        state = torch.load(f"{d}/d.pt", weights_only=False)
        state["config"]["num_samples"] = 600
        torch.save(state, f"{d}/d.pt")
    comm.Barrier()
    assert [h["epoch"] for h in train(cfg(checkpoint=f"{d}/d.pt", resume=True, epochs=2, **digits), comm)] == [1, 2]
    with pytest.raises(CheckpointError, match="another experiment: data_seed 42 -> 7"):
        train(cfg(checkpoint=f"{d}/d.pt", resume=True, epochs=3, data_seed=7, **digits), comm)


@pytest.mark.mpi(min_size=1)
def test_the_header_says_when_warmup_does_nothing_or_cannot_finish(capsys):
    comm = MPI.COMM_WORLD
    train(cfg(epochs=1, quiet=False), comm)  # no base batch: k = 1, the "gradual warmup" changes nothing
    train(cfg(epochs=1, quiet=False, base_batch=4, warmup_epochs=2, decay="step", milestones=(1,)), comm)
    out = capsys.readouterr().out
    if comm.rank == 0:
        assert "(k = 1: no warmup (--base-batch sets the batch the rate is for))" in out, out
        assert "warning: in a run of 1 epochs a warmup of 2 epochs never reaches the peak rate" in out, out
        assert "warning: in a run of 1 epochs milestone 1 is not before the last epoch" in out, out
        assert "warning: in a run of 1 epochs milestone 1 falls inside the warmup (the climbing rate is cut" in out
        assert ("leaves out" in out) == (480 % (8 * comm.size) > 0.05 * 480)  # whole global batches of 8 x ranks
    # a global batch of 70 x ranks (at 6 ranks at most: one step) leaves a partial batch out of every epoch
    batch = 70 if comm.size <= 6 else 400 // comm.size
    train(cfg(epochs=1, quiet=False, batch_per_rank=batch), comm)
    out = capsys.readouterr().out
    left = 480 - 480 // (batch * comm.size) * batch * comm.size
    if comm.rank == 0:
        assert (f"# train: warning: each epoch leaves out {left} of the 480 training samples ({100 * left / 480:.0f}%: "
                "the last partial global batch, other samples each epoch)\n") in out, out


@pytest.mark.mpi(min_size=1)
def test_an_epoch_takes_a_steps_samples_at_a_time(monkeypatch):
    """The loop turned the rank's whole epoch into float32 or int64 before
    its first step (the text dataset's: 16 bytes for each byte of the
    corpus across the ranks); it takes each step's rows as it comes to it,
    in the order the epoch's shard lists them (the tests against a single
    process's training say the parameters are those it had)."""
    from hpcjobs.training.data import Dataset, rank_batches

    comm = MPI.COMM_WORLD
    asked, batch = [], Dataset.batch
    monkeypatch.setattr(Dataset, "batch", lambda self, split, index: (asked.append(np.array(index)),
                                                                       batch(self, split, index))[1])
    train(cfg(epochs=1, backward_passes_per_step=2), comm)
    trained = [a for a in asked if len(a) == 16]  # the test set's are read in slices of up to 256
    assert np.array_equal(np.stack(trained), rank_batches(480, 16, comm.rank, comm.size, 0, 3))


@pytest.mark.mpi(min_size=1)
def test_a_run_that_diverges_keeps_its_last_good_checkpoint(tmp_path_factory):
    """Resumed at a rate that diverges, the run stops; its NaN parameters
    used to overwrite the checkpoint it started from, the only good state."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "diverge")
    train(cfg(checkpoint=f"{d}/d.pt", epochs=1), comm)
    history = train(cfg(checkpoint=f"{d}/d.pt", resume=True, epochs=3, lr=1e12), comm)
    assert not math.isfinite(history[-1]["loss"]) and len(history) == 2  # epoch 2 diverged, and it stopped
    comm.Barrier()
    state = load_checkpoint(f"{d}/d.pt")
    assert state["epoch"] == 1 and all(torch.isfinite(v).all() for v in state["model"].values())


@pytest.mark.mpi(min_size=1)
def test_a_run_killed_after_its_metrics_line_does_not_write_that_epoch_twice(tmp_path_factory, capsys):
    """The epoch's line is written before its checkpoint: killed in between,
    the resumed run wrote the epoch again, and the file held it twice."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "twice")
    if comm.rank == 0:  # an earlier run's lines in the same file stay
        open(f"{d}/m.jsonl", "w").write('{"epoch": 1, "loss": 9.0}\n{"epoch": 7, "loss": 8.0}\n')
    comm.Barrier()
    train(cfg(checkpoint=f"{d}/c.pt", metrics=f"{d}/m.jsonl", epochs=2), comm)
    if comm.rank == 0:
        kept = open(f"{d}/c.pt", "rb").read()
    train(cfg(checkpoint=f"{d}/c.pt", metrics=f"{d}/m.jsonl", epochs=3, resume=True), comm)
    if comm.rank == 0:  # the kill: epoch 3's line is in, its checkpoint is not
        open(f"{d}/c.pt", "wb").write(kept)
    comm.Barrier()
    capsys.readouterr()
    history = train(cfg(checkpoint=f"{d}/c.pt", metrics=f"{d}/m.jsonl", epochs=4, resume=True), comm)
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    if comm.rank == 0:
        lines = [json.loads(x) for x in open(f"{d}/m.jsonl")]
        assert [x["epoch"] for x in lines] == [1, 7, 1, 2, 3, 4]
        assert [x["loss"] for x in lines[2:]] == [round(h["loss"], 6) for h in history]
        assert "dropped 1 line(s) after epoch 2" in capsys.readouterr().err


@pytest.mark.mpi(min_size=1)
def test_a_run_killed_before_its_first_epochs_checkpoint_does_not_write_that_epoch_twice(tmp_path_factory,
                                                                                         monkeypatch):
    """A checkpoint in the first epoch, before the metrics file existed,
    recorded no size, and the resumed run kept epoch 1's line and wrote it
    again."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "first")
    saved = []
    original = checkpoint.save_checkpoint

    def keep_the_first(path, state):
        original(path, state)
        if not saved:
            saved.append(open(path, "rb").read())

    monkeypatch.setattr(checkpoint, "save_checkpoint", keep_the_first)
    run = dict(checkpoint=f"{d}/c.pt", metrics=f"{d}/m.jsonl", checkpoint_every=5)
    train(cfg(epochs=1, **run), comm)
    if comm.rank == 0:  # the kill: epoch 1's line is in, its checkpoint is not (the one at step 5 is)
        assert load_checkpoint(f"{d}/c.pt")["epoch"] == 1
        open(f"{d}/c.pt", "wb").write(saved[0])
        assert load_checkpoint(f"{d}/c.pt")["step"] == 5
    comm.Barrier()
    history = train(cfg(epochs=2, resume=True, **run), comm)
    if comm.rank == 0:
        assert [json.loads(x)["epoch"] for x in open(f"{d}/m.jsonl")] == [h["epoch"] for h in history] == [1, 2]


def test_only_the_lines_written_after_the_checkpoint_are_dropped_and_only_if_they_are_later_epochs(tmp_path, capsys):
    """The file is cut back to where it ended when the checkpoint was
    written, never by epoch numbers alone: a checkpoint in a run's first
    epoch (0 whole epochs) used to take every earlier run's line with it."""
    earlier = '{"epoch": 1, "loss": 9.0}\n{"epoch": 7, "loss": 8.0}\n'
    path = tmp_path / "m.jsonl"
    path.write_text(earlier + '{"epoch": 1, "loss": 2.0}\n')  # killed after epoch 1's line, checkpoint mid-epoch 1
    checkpoint.trim_metrics(str(path), len(earlier), 0)
    assert path.read_text() == earlier
    assert "dropped 1 line(s) after epoch 0" in capsys.readouterr().err
    for tail in ('{"epoch": 1, "loss": 2.0}\n', "not json\n", '{"epoch": 3}\n{"note": "another writer"}\n'):
        path.write_text(earlier + tail)
        checkpoint.trim_metrics(str(path), len(earlier), 1)  # not only later epochs after the checkpoint's end
        assert path.read_text() == earlier + tail
        assert "left as it is" in capsys.readouterr().err
    path.write_text(earlier)
    checkpoint.trim_metrics(str(path), len(earlier), 1)  # nothing after it: nothing said
    assert path.read_text() == earlier and capsys.readouterr().err == ""


@pytest.mark.mpi(min_size=1)
def test_resuming_with_another_schedule_says_so(tmp_path_factory, capsys):
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "schedule")
    train(cfg(checkpoint=f"{d}/s.pt", epochs=1), comm)
    capsys.readouterr()
    train(cfg(checkpoint=f"{d}/s.pt", epochs=2, resume=True), comm)  # a longer run: not a change to say
    assert "another schedule" not in capsys.readouterr().err
    train(cfg(checkpoint=f"{d}/s.pt", epochs=3, resume=True, lr=0.01, milestones=(2.5,), decay="step"), comm)
    err = capsys.readouterr().err
    if comm.rank == 0:
        assert ("warning: resuming " in err and "with another schedule (lr 0.05 -> 0.01, decay 'none' -> 'step', "
                "milestones [] -> [2.5])" in err), err


@pytest.mark.mpi(min_size=1)
def test_a_default_given_as_its_value_on_resume_is_the_same_run(tmp_path_factory, capsys):
    """width and num_samples left out, then given as the values they stand
    for (the MLP's 256, synthetic's 8192), and base_batch as the global batch:
    the same run (they were refused as another experiment, and a schedule
    change was warned about). A rate given as a numpy scalar is saved as a
    number (the checkpoint could not be read back)."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "defaults")
    run = dict(checkpoint=f"{d}/c.pt", width=None, num_samples=None, batch_per_rank=64)
    train(cfg(epochs=1, lr=np.linspace(0.01, 0.05, 5)[4], **run), comm)
    capsys.readouterr()
    history = train(cfg(epochs=2, resume=True, **{**run, "width": 256, "num_samples": 8192},
                        base_batch=64 * comm.size), comm)
    assert [h["epoch"] for h in history] == [1, 2]
    assert "another schedule" not in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="another experiment: width 256 -> 128"):
        train(cfg(epochs=3, resume=True, **{**run, "width": 128}), comm)


@pytest.mark.parametrize("mode,extra,size,same", [
    ("sync", {}, 4, 32), ("local", {"local_steps": 2}, 4, 32),  # every rank's batch of 8
    ("async", {}, 5, 8), ("hogwild", {}, 4, 8),  # one worker's
    ("easgd", {"easgd_form": "async", "local_steps": 2, "servers": 1}, 5, 32),  # the 4 workers'
])
def test_a_base_batch_left_out_is_the_batch_the_mode_scales_to(mode, extra, size, same, capsys):
    """Given on resume as that batch, nothing is said; as another, it is.
    The asynchronous modes scale to one worker's batch: the global batch
    stood in for theirs, and a real change of rate went unsaid."""
    saved = checkpoint.config_dict(cfg(mode=mode, batch_per_rank=8, **extra))
    defaults = checkpoint.config_dict(TrainConfig())
    for base, warned in ((same, False), (same * 2, True)):
        checkpoint._warn_schedule_changes(cfg(mode=mode, batch_per_rank=8, base_batch=base, **extra), saved,
                                          defaults, size)
        assert (f"another schedule (base_batch {same} -> {base})" in capsys.readouterr().err) == warned, base


@pytest.mark.mpi(min_size=2)
def test_resuming_on_other_ranks_says_so_before_the_batch_it_changes(tmp_path_factory):
    """A global batch kept on fewer ranks is another per-rank batch: the
    ranks are what changed, and what is said."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "ranks")
    train(cfg(checkpoint=f"{d}/c.pt", epochs=1), comm)
    if comm.rank == 0:
        with pytest.raises(CheckpointError, match=f"holds the state of {comm.size} ranks; this run has 1"):
            train(cfg(checkpoint=f"{d}/c.pt", epochs=2, resume=True, batch_per_rank=8 * comm.size), MPI.COMM_SELF)
    comm.Barrier()


@pytest.mark.mpi(min_size=1)
def test_resume_without_a_checkpoint_file_starts_fresh(tmp_path_factory):
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "fresh")
    history = train(cfg(checkpoint=f"{d}/new.pt", resume=True, epochs=1), comm)
    assert [h["epoch"] for h in history] == [1]


@pytest.mark.mpi(min_size=2)
def test_resume_where_rank_0_does_not_see_the_checkpoint_is_refused_on_every_rank(tmp_path_factory, monkeypatch):
    """A checkpoint on a node's own disk, the job requeued with rank 0 on another node: rank 0 found nothing,
    and the run started over without a word (the rank-divergence review). Each rank here works in a folder of
    its own, the last rank's holding c.pt: refused on every rank, naming it; with it nowhere, a fresh start."""
    comm = MPI.COMM_WORLD
    mine = tmp_path_factory.mktemp("own")
    monkeypatch.chdir(mine)
    if comm.rank == comm.size - 1:
        (mine / "c.pt").write_bytes(b"a checkpoint rank 0 never sees")
    with pytest.raises(CheckpointError, match=re.escape(f"c.pt: rank 0 does not see it, which rank {comm.size - 1} "
                                                        f"of {comm.size} sees (a relative path is read from each "
                                                        "rank's own directory): put the checkpoint on a file system "
                                                        "every rank shares, at one path")):
        train(cfg(checkpoint="c.pt", resume=True, epochs=1), comm)
    comm.Barrier()
    if comm.rank == comm.size - 1:
        (mine / "c.pt").unlink()
    assert [h["epoch"] for h in train(cfg(checkpoint="c.pt", resume=True, epochs=1), comm)] == [1]


def test_checkpoint_writes_are_atomic_and_loads_are_checked(tmp_path):
    path = tmp_path / "x.pt"
    save_checkpoint(path, {"version": CHECKPOINT_VERSION, "model": {"w": torch.ones(2)}})
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]   # no temp file left behind
    assert load_checkpoint(path)["model"]["w"].sum() == 2
    torch.save({"something": "else"}, path)
    with pytest.raises(CheckpointError, match="not an hpcjobs training checkpoint"):
        load_checkpoint(path)
    # another kind of file: torch.load's answer was advice to load it with weights_only=False
    for raw, words in ((b"", "it is empty"), (b'{"a":\n', "it begins b'{\"a\"'"), (b"\x80\x02}q", "it begins")):
        path.write_bytes(raw)
        want = f"{path} is not an hpcjobs training checkpoint (not the zip file torch.save writes: {words}"
        with pytest.raises(CheckpointError, match=re.escape(want)):
            load_checkpoint(path)
    save_checkpoint(path, {"version": 1, "model": {"w": torch.ones(2)}})
    with pytest.raises(CheckpointError, match="a version 1 checkpoint; this hpcjobs reads version 2"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


def test_a_write_killed_part_way_leaves_no_temp_file_after_the_next(tmp_path):
    """atomic_write's temp file, left by a SIGKILL as torch.save wrote it
    (a requeued job losing the race to its launcher): the next write of the
    checkpoint removes it. Another process's, alive, and other files stay."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    alive = os.getppid()
    others = [f".x.pt.{alive}.0a1b2c3d.tmp", f".y.pt.{dead}.0a1b2c3d.tmp",
              f".x.pt.10.{dead}.0a1b2c3d.tmp"]  # (x.pt.10's, whose name begins as x.pt's do)
    for name in [f".x.pt.{dead}.0a1b2c3d.tmp", *others]:
        (tmp_path / name).write_bytes(b"partial")
    save_checkpoint(tmp_path / "x.pt", {"version": CHECKPOINT_VERSION, "model": {"w": torch.ones(2)}})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "x.pt"])


def test_a_global_batch_larger_than_the_data_is_a_clear_error():
    with pytest.raises(ValueError, match="larger than the training set"):
        train(cfg(batch_per_rank=10_000), MPI.COMM_SELF)


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "adadelta", "rmsprop", "lars", "nesterov"])
def test_every_optimizer_trains(optimizer):
    lr = {"adadelta": 1.0, "lars": 1.0}.get(optimizer, 0.01)
    h = train(cfg(optimizer=optimizer, lr=lr, epochs=3, weight_decay=1e-4, no_decay_bn_bias=True,
                  batch_norm=True), MPI.COMM_SELF)
    assert np.isfinite(h[-1]["loss"]) and h[-1]["loss"] < h[0]["loss"] * 1.05


def test_fp16_compression_trains_close_to_uncompressed():
    plain = train(cfg(epochs=2), MPI.COMM_SELF)
    half = train(cfg(epochs=2, compression="fp16"), MPI.COMM_SELF)
    assert half[-1]["loss"] == pytest.approx(plain[-1]["loss"], rel=1e-2)


def test_amend_report_rewrites_only_this_runs_last_line_and_warns_where_it_cannot(tmp_path, capsys):
    """The parameter server's audit goes into the epoch line written before
    the stop; an earlier run's lines stay, and a file whose last line is not
    that epoch's is left alone with a warning (the run itself went well)."""
    from hpcjobs.training.stepping import amend_report, report

    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"epoch": 3, "loss": 0.5}\n')  # an earlier run's
    c = TrainConfig(metrics=str(metrics), quiet=True)
    report(c, {"epoch": 1, "loss": 1.25})
    amend_report(c, {"epoch": 1, "loss": 1.25, "pushes_applied": 25, "lost_workers": "1"})
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == [
        {"epoch": 3, "loss": 0.5}, {"epoch": 1, "loss": 1.25, "pushes_applied": 25, "lost_workers": "1"}]
    assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]  # no temporary file left
    before = metrics.read_text()
    amend_report(c, {"epoch": 2, "loss": 1.0, "pushes_applied": 50})
    assert metrics.read_text() == before
    assert "warning: the audit is not in" in capsys.readouterr().err
    os.mkfifo(tmp_path / "pipe")  # --metrics to a pipe: reading it back waited for a writer that never came
    amend_report(TrainConfig(metrics=str(tmp_path / "pipe"), quiet=True), {"epoch": 1, "loss": 1.25})
    assert "the audit is not in" in capsys.readouterr().err


def test_a_stop_says_where_the_checkpoint_left_the_run_or_that_none_was_written():
    import signal

    from hpcjobs.training.preempt import Stopped

    assert str(Stopped(signal.SIGTERM, 1, 5, "c.pt")) == ("SIGTERM: checkpoint c.pt written at step 5 of epoch 2; "
                                                          "stopped (--resume continues from it)")
    assert str(Stopped(signal.SIGUSR1, 2, 0, "c.pt")).startswith("SIGUSR1: checkpoint c.pt written after epoch 2;")
    # parameters not finite: checkpoint.write kept the last checkpoint, and the message must not claim one
    assert str(Stopped(signal.SIGTERM, 1, 5, "c.pt", written=False)) == (
        "SIGTERM: stopped at step 5 of epoch 2, with parameters that are not finite: c.pt not written (--resume "
        "continues from the last one, if any)")
