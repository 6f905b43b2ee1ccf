"""Checkpoints of local SGD and synchronous EASGD: every rank's own
parameters, momentum and steps since the last average come back, at an
epoch's end and mid-epoch after a signal, to the parameters of a run never
stopped."""

import os
import signal

import pytest
import torch
from mpi4py import MPI

from hpcjobs.training import averaging, checkpoint
from hpcjobs.training.checkpoint import CheckpointError, load_checkpoint
from hpcjobs.training.config import TrainConfig
from hpcjobs.training.loop import train
from hpcjobs.training.preempt import Stopped

torch.set_num_threads(1)

KEEP = ("epoch", "step", "lr", "loss", "train_acc", "test_loss", "test_acc", "sent_bytes")
MODES = [("local", dict(local_steps=5, post_local_epochs=1, average_momentum=True)),
         ("easgd", dict(local_steps=5))]


def shared_dir(tmp_path_factory, name):
    comm = MPI.COMM_WORLD
    return comm.bcast(str(tmp_path_factory.mktemp(name)) if comm.rank == 0 else None)


def cfg(mode, extra, **kw):
    return TrainConfig(**{**dict(model="mlp", width=16, dataset="synthetic", num_samples=600, batch_per_rank=8,
                                 lr=0.05, momentum=0.9, warmup="none", epochs=3, seed=3, quiet=True,
                                 progress=False, mode=mode), **extra, **kw})


def counting_steps(monkeypatch, signal_at=None):
    """The worker steps this rank computes from now on (a list of one
    count); with ``signal_at``, the last rank sends itself SIGUSR1 in its
    step of that number."""
    calls, compute = [0], averaging.compute_step
    comm = MPI.COMM_WORLD

    def counted(*args):
        calls[0] += 1
        if calls[0] == signal_at and comm.rank == comm.Get_size() - 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # noted after this step, agreed after the next
        return compute(*args)

    monkeypatch.setattr(averaging, "compute_step", counted)
    return calls


def same_run(a_path, b_path, a_history, b_history):
    """Two runs alike: each epoch's metrics, and every rank's own parameters,
    momentum and EASGD's center in their last checkpoints; the second's
    model is the one it tests."""
    assert [{k: r[k] for k in KEEP} for r in a_history] == [{k: r[k] for k in KEEP} for r in b_history]
    if MPI.COMM_WORLD.rank:
        return
    a, b = load_checkpoint(a_path), load_checkpoint(b_path)
    assert len(a["ranks"]) == len(b["ranks"]) == MPI.COMM_WORLD.Get_size()
    for x, y in zip(a["ranks"], b["ranks"]):
        assert torch.equal(x["flat"], y["flat"])
        assert ("center" in x) == ("center" in y) and ("center" not in x or torch.equal(x["center"], y["center"]))
        mx, my = x["optimizer"]["state"], y["optimizer"]["state"]
        assert mx.keys() == my.keys() and mx
        assert all(torch.equal(mx[k]["momentum_buffer"], my[k]["momentum_buffer"]) for k in mx)
    # the file's model is the one tested: the ranks' average, or the center
    tested = torch.cat([v.reshape(-1) for v in b["model"].values()])
    flats = torch.stack([r["flat"] for r in b["ranks"]])
    want = b["ranks"][0]["center"] if "center" in b["ranks"][0] else flats.mean(0)
    assert torch.allclose(tested, want, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode,extra", MODES)
def test_resumed_at_an_epochs_end_it_ends_where_the_unbroken_run_does(tmp_path_factory, monkeypatch, mode, extra):
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, f"avg-epoch-{mode}")
    straight = train(cfg(mode, extra, checkpoint=f"{d}/a.pt"), comm)
    first = train(cfg(mode, extra, checkpoint=f"{d}/b.pt", epochs=2), comm)
    steps = counting_steps(monkeypatch)
    resumed = train(cfg(mode, extra, checkpoint=f"{d}/b.pt", resume=True), comm)
    assert steps[0] == straight[0]["step"]  # the third epoch only, from the checkpoint
    assert resumed[:2] == first  # epochs 1 and 2 as the first run had them, times too
    same_run(f"{d}/a.pt", f"{d}/b.pt", straight, resumed)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode,extra", MODES)
def test_a_signal_to_one_rank_stops_every_rank_mid_epoch_and_resume_ends_as_the_unbroken_run(
        tmp_path_factory, monkeypatch, mode, extra):
    """The last rank sends itself SIGUSR1 in the middle of epoch 2, between
    two averages: every rank stops at the same step after a checkpoint, the
    signal's handler is given back, and the resumed run -- each rank with
    its own parameters, momentum and steps since the last average -- ends
    where the unbroken one does. Checkpoints every 4 steps meanwhile."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, f"avg-signal-{mode}")
    straight = train(cfg(mode, extra, checkpoint=f"{d}/a.pt"), comm)
    spe = straight[0]["step"]
    assert spe >= 6
    written, save = [], checkpoint.gather_and_save

    def noted(cfg, comm, model_state, inner, history, epoch, step, mine, scaler=None):
        written.append((epoch, step))
        save(cfg, comm, model_state, inner, history, epoch, step, mine, scaler)

    monkeypatch.setattr(checkpoint, "gather_and_save", noted)
    counting_steps(monkeypatch, signal_at=spe + spe // 2)
    with pytest.raises(Stopped) as stopped:
        train(cfg(mode, extra, checkpoint=f"{d}/b.pt", metrics=f"{d}/b.jsonl", checkpoint_every=4), comm)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    every = [(g // spe, g % spe) for g in range(4, spe + spe // 2 + 1, 4) if g % spe]  # not at an epoch's end
    assert written == sorted(every + [(1, 0), (1, spe // 2 + 1)]), written
    e = stopped.value
    assert (e.signum, e.epoch, e.step) == (signal.SIGUSR1, 1, spe // 2 + 1)
    state = load_checkpoint(f"{d}/b.pt")
    assert (state["epoch"], state["step"]) == (1, spe // 2 + 1)
    assert all(r["since"] for r in state["ranks"])  # between two averages, at every size here
    steps = counting_steps(monkeypatch)
    resumed = train(cfg(mode, extra, checkpoint=f"{d}/b.pt", metrics=f"{d}/b.jsonl", resume=True), comm)
    assert steps[0] == 3 * spe - (spe + spe // 2 + 1)  # from the signal's checkpoint on
    same_run(f"{d}/a.pt", f"{d}/b.pt", straight, resumed)


@pytest.mark.mpi(min_size=1)
def test_easgds_default_rate_given_on_resume_is_the_same_experiment(tmp_path_factory):
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "avg-rate")
    mode, extra = MODES[1]
    train(cfg(mode, extra, checkpoint=f"{d}/c.pt", epochs=1), comm)
    rate = 0.9 / comm.Get_size()  # the default: TrainConfig.moving_rate
    assert len(train(cfg(mode, {**extra, "elastic_alpha": rate}, checkpoint=f"{d}/c.pt", epochs=2, resume=True),
                     comm)) == 2
    with pytest.raises(CheckpointError, match="elastic_alpha"):
        train(cfg(mode, {**extra, "elastic_alpha": rate / 2}, checkpoint=f"{d}/c.pt", epochs=3, resume=True), comm)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("saved,change,words", [
    ({}, dict(local_steps=4), "local_steps 5 -> 4"),
    ({}, dict(mode="sync", local_steps=8, post_local_epochs=0, average_momentum=False), "mode 'local' -> 'sync'"),
    ({}, dict(mode="easgd", post_local_epochs=0, average_momentum=False), "mode 'local' -> 'easgd'"),
    (dict(mode="sync", local_steps=8, post_local_epochs=0, average_momentum=False), {}, "mode 'sync' -> 'local'"),
])
def test_another_experiments_checkpoint_is_refused_on_every_rank(tmp_path_factory, saved, change, words):
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "avg-refused")
    mode, extra = MODES[0]
    train(cfg(mode, {**extra, **saved}, checkpoint=f"{d}/c.pt", epochs=1), comm)
    with pytest.raises(CheckpointError, match=words):
        train(cfg(mode, {**extra, **change}, checkpoint=f"{d}/c.pt", resume=True), comm)


@pytest.mark.mpi(min_size=2)  # on one rank the ending frees the signals' communicator and gave them back already
def test_an_error_alike_on_every_rank_gives_the_signals_back(tmp_path_factory, monkeypatch):
    """A checkpoint that cannot be written, on every rank: the error reaches the caller, and SIGTERM and SIGUSR1
    have their handlers back (they stayed noted by the run's, and a SIGTERM after training was lost)."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "avg-error")

    def fails(*args, **kwargs):
        raise CheckpointError("the disk is full (a test)")

    monkeypatch.setattr(checkpoint, "gather_and_save", fails)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.raises(CheckpointError, match="the disk is full"):
        train(cfg("local", dict(local_steps=5), checkpoint=f"{d}/a.pt", checkpoint_every=3), comm)
    assert {s: signal.getsignal(s) for s in before} == before
    comm.Barrier()


@pytest.mark.mpi(min_size=1)
def test_hogwild_stopped_by_a_signal_resumes_at_that_step_with_every_update_counted(tmp_path_factory, monkeypatch):
    """Hogwild! took no checkpoint. The shared vector is written once every rank's update of the step is in
    and before any rank's next (the lock's count of updates says so: exactly W per step), each rank's momentum
    with it; resumed, the run makes the steps left and no more. On one rank Hogwild! is plain SGD, and the
    resumed run ends where the unbroken one does, bit for bit."""
    comm = MPI.COMM_WORLD
    W, d, extra = comm.Get_size(), shared_dir(tmp_path_factory, "hogwild-signal"), dict(hogwild_lock=True)
    straight = train(cfg("hogwild", extra, checkpoint=f"{d}/a.pt"), comm)
    spe = straight[0]["step"]
    assert spe >= 6 and straight[-1]["locked_updates"] == 3 * spe * W
    counts, save = [], checkpoint.gather_and_save

    def counted(cfg, comm, model_state, inner, history, epoch, step, mine, scaler=None):
        counts.append((epoch * spe + step, mine.get("locked_updates")))
        save(cfg, comm, model_state, inner, history, epoch, step, mine, scaler)

    monkeypatch.setattr(checkpoint, "gather_and_save", counted)
    counting_steps(monkeypatch, signal_at=spe + spe // 2)
    with pytest.raises(Stopped) as stopped:
        train(cfg("hogwild", extra, checkpoint=f"{d}/b.pt", checkpoint_every=4), comm)
    assert (stopped.value.signum, stopped.value.epoch, stopped.value.step) == (signal.SIGUSR1, 1, spe // 2 + 1)
    if comm.rank == 0:  # every checkpoint, every 4 steps too: W updates per step, none of the next step's
        assert len(counts) >= 3 and all(n == W * at for at, n in counts), counts
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    if comm.rank == 0:
        state = load_checkpoint(f"{d}/b.pt")
        assert (state["epoch"], state["step"]) == (1, spe // 2 + 1) and state["optimizer"] == {}
        assert state["ranks"][0]["locked_updates"] == W * (spe + spe // 2 + 1)
        assert all(float(r["momentum"].abs().sum()) > 0 for r in state["ranks"]) and len(state["ranks"]) == W
    steps = counting_steps(monkeypatch)
    resumed = train(cfg("hogwild", extra, checkpoint=f"{d}/b.pt", resume=True), comm)
    assert steps[0] == 3 * spe - (spe + spe // 2 + 1)  # from the signal's checkpoint on
    assert [r["epoch"] for r in resumed] == [1, 2, 3] and resumed[-1]["locked_updates"] == 3 * spe * W
    if W == 1:
        assert [{k: r[k] for k in KEEP} for r in resumed] == [{k: r[k] for k in KEEP} for r in straight]
        a, b = load_checkpoint(f"{d}/a.pt"), load_checkpoint(f"{d}/b.pt")
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert torch.equal(a["ranks"][0]["momentum"], b["ranks"][0]["momentum"])


@pytest.mark.mpi(min_size=1)
def test_hogwild_lock_is_part_of_the_experiment(tmp_path_factory):
    """A locked run's checkpoint holds its count of updates: resumed without the lock it crashed on rank 0
    (AttributeError on the lock it did not have), and the other way the count started again at 0."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "avg-hogwild-lock")
    train(cfg("hogwild", {"hogwild_lock": True}, checkpoint=f"{d}/c.pt", epochs=1), comm)
    with pytest.raises(CheckpointError, match="another experiment: hogwild_lock True -> False"):
        train(cfg("hogwild", {}, checkpoint=f"{d}/c.pt", epochs=2, resume=True), comm)
