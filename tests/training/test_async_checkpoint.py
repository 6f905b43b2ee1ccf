"""Checkpoints of the asynchronous parameter server (hpcjobs.training.ps_checkpoint): a signal stops every
rank at the next pause after a checkpoint, and the resumed run is, in fixed-delay mode, the single-process
reference of the run never stopped; at an epoch's end, every push of the run applied and audited."""

import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcjobs.comm import private
from hpcjobs.training import ps_worker
from hpcjobs.training.checkpoint import CheckpointError, load_checkpoint
from hpcjobs.training.config import TrainConfig
from hpcjobs.training.data import opened_fingerprint, steps_per_epoch
from hpcjobs.training.loop import train
from hpcjobs.training.paramserver import reference_fixed_delay, run_async
from hpcjobs.training.preempt import Stopped

torch.set_num_threads(1)

TINY = dict(model="mlp", width=16, dataset="mnist1d", num_samples=500, batch_per_rank=8, lr=0.05, warmup="none",
            progress=False, quiet=True, mode="async")
COMPUTE = ps_worker.compute_step
KEEP = ("epoch", "step", "lr", "loss", "train_acc", "test_loss", "test_acc", "pushes")


def _layout(size):
    servers = 2 if size >= 4 else 1
    return servers, size - servers


def shared_dir(tmp_path_factory, name):
    comm = MPI.COMM_WORLD
    return comm.bcast(str(tmp_path_factory.mktemp(name)) if comm.rank == 0 else None)


def counting_pushes(monkeypatch, signal_at=None, signaller=None, slow_after=None):
    """The gradients this rank computes from now on (a list of one count); with ``signal_at``, rank
    ``signaller`` (the last by default) sends itself SIGUSR1 while computing that one; after ``slow_after``
    each takes 0.3 s more."""
    calls, compute = [0], COMPUTE  # not an earlier test's wrapper, nor this test's
    comm = MPI.COMM_WORLD
    signaller = comm.Get_size() - 1 if signaller is None else signaller

    def counted(*args):
        calls[0] += 1
        if calls[0] == signal_at and comm.rank == signaller:
            os.kill(os.getpid(), signal.SIGUSR1)  # noted: said with the pause after this push
        if slow_after is not None and calls[0] > slow_after:
            time.sleep(0.3)
        return compute(*args)

    monkeypatch.setattr(ps_worker, "compute_step", counted)
    return calls


@pytest.mark.mpi(min_size=2)
def test_fixed_delay_stopped_by_a_signal_and_resumed_is_the_run_never_stopped(tmp_path_factory, monkeypatch):
    """The last worker gets SIGUSR1 in its push spe + 1; every worker pauses after push spe + 3 (every 3
    pushes), server 0 writes the checkpoint, and every rank stops there. Resumed, each worker makes the pushes
    left, and the parameters are the single-process reference's, which has each server's last two versions
    (gradient i on version i - 2) to come back right after the stop. Its epoch lines count the bytes of the
    unbroken run (every server's, the second's too), and the stopped epoch's time before the stop."""
    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    d = shared_dir(tmp_path_factory, "ps-fixed-delay")
    cfg = TrainConfig(**TINY, servers=servers, fixed_delay=2, epochs=2, checkpoint=f"{d}/c.pt", checkpoint_every=3)
    spe = steps_per_epoch(400, cfg.batch_per_rank * workers)
    assert spe >= 6 and spe % 3
    pause = (spe + 1 + 2) // 3 * 3  # the first multiple of 3 from push spe + 1 on
    unbroken = run_async(TrainConfig(**{**cfg.__dict__, "checkpoint": f"{d}/u.pt"}), private(comm))[0]
    counting_pushes(monkeypatch, signal_at=spe + 1, slow_after=spe)  # epoch 2's pushes before the stop: slow
    with pytest.raises(Stopped) as stopped:
        run_async(cfg, private(comm))
    assert (stopped.value.signum, stopped.value.epoch, stopped.value.step) == (signal.SIGUSR1, *divmod(pause, spe))
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    if comm.rank == 0:
        state = load_checkpoint(cfg.checkpoint)
        assert (state["epoch"], state["step"]) == divmod(pause, spe)
        assert [r["version"] for r in state["ranks"][:servers]] == [pause * workers] * servers
        assert [r["pushes"] for r in state["ranks"][servers:]] == [pause] * workers
    pushes = counting_pushes(monkeypatch)
    history, flat = run_async(TrainConfig(**{**cfg.__dict__, "resume": True}), private(comm))
    assert pushes[0] == (0 if comm.rank < servers else 2 * spe - pause)
    assert [h["epoch"] for h in history] == [1, 2] and history[-1]["pushes_applied"] == 2 * spe * workers
    assert history[-1]["pushes_by_worker"] == [2 * spe] * workers and history[-1]["audit_max_diff"] <= 1e-12
    # Which epoch a message falls in is the machine's; the sum is not -- but sent_bytes, a count, is each epoch's
    # mean per worker written as a whole number (truncated), so with 3 workers the sums of two epochs' lines can
    # differ by a byte (CI at 5 ranks: 148,736 against 148,735); received_bytes is written unrounded.
    sent = [sum(h["sent_bytes"] for h in run) for run in (history, unbroken)]
    assert sent[0] == pytest.approx(sent[1], rel=0, abs=len(history) - 1) and sent[0] > 0
    assert sum(h["received_bytes"] for h in history) == pytest.approx(sum(h["received_bytes"] for h in unbroken),
                                                                      rel=1e-12)
    assert history[1]["epoch_s"] >= 0.3 * (pause - spe)
    if comm.rank == 0:
        reference = reference_fixed_delay(TrainConfig(**{**cfg.__dict__, "checkpoint": None,
                                                         "checkpoint_every": 0}), workers)
        np.testing.assert_allclose(flat, reference, rtol=0, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_downpour_resumed_after_an_epoch_applies_every_push_of_the_run(tmp_path_factory, monkeypatch):
    """Without a fixed delay the order of the pushes is the machine's; what a checkpoint must keep is that
    every push is applied once: the first epoch's line as it was, the second epoch's pushes made after the
    resume alone, every one applied and audited, and the counts of the whole run."""
    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    d = shared_dir(tmp_path_factory, "ps-downpour")
    cfg = dict(TINY, servers=servers, staleness_bound=1, checkpoint=f"{d}/c.pt", metrics=f"{d}/m.jsonl")
    first = train(TrainConfig(**cfg, epochs=1), comm)
    spe = first[0]["step"] // workers
    pushes = counting_pushes(monkeypatch)
    resumed = train(TrainConfig(**cfg, epochs=2, resume=True), comm)
    assert pushes[0] == (0 if comm.rank < servers else spe)
    assert [{k: r[k] for k in KEEP} for r in resumed[:1]] == [{k: r[k] for k in KEEP} for r in first]
    last = resumed[-1]
    assert last["epoch"] == 2 and last["pushes_applied"] == last["pushes_reported"] == 2 * spe * workers
    assert last["pushes_by_worker"] == [2 * spe] * workers and last["audit_max_diff"] <= 1e-12
    if comm.rank == 0:
        state = load_checkpoint(cfg["checkpoint"])
        assert (state["epoch"], state["step"]) == (2, 0) and len(state["history"]) == 2
        assert state["data"] == opened_fingerprint(TrainConfig(**cfg)) and len(state["data"]) == 32
        with open(cfg["metrics"]) as f:
            assert [int(line.split('"epoch": ')[1].split(",")[0]) for line in f] == [1, 2]


@pytest.mark.mpi(min_size=2)
def test_a_checkpoint_of_another_layout_is_refused_on_every_rank(tmp_path_factory):
    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    d = shared_dir(tmp_path_factory, "ps-refused")
    cfg = dict(TINY, servers=servers, epochs=1, checkpoint=f"{d}/c.pt")
    train(TrainConfig(**cfg), comm)
    with pytest.raises(CheckpointError, match="another experiment: staleness_bound None -> 3"):
        train(TrainConfig(**cfg, staleness_bound=3, resume=True), comm)
    if comm.Get_size() >= 3:
        with pytest.raises(CheckpointError, match="servers"):
            train(TrainConfig(**{**cfg, "servers": servers + 1}, resume=True), comm)


EASGD = dict(TINY, mode="easgd", easgd_form="async", local_steps=3, epochs=2, decay="cosine")  # the clock matters


@pytest.mark.mpi(min_size=2)
def test_easgd_with_one_worker_stopped_by_a_signal_and_resumed_ends_where_the_run_never_stopped(
        tmp_path_factory, monkeypatch):
    """One worker (1 or 2 servers): nothing is stale and the run is deterministic. SIGUSR1 in its step 20; it
    pauses after its elastic move of steps 22-24 (a multiple of 6 comes before the next) and every rank stops.
    Resumed, it makes the steps left, from its own parameters, momentum and clock, and the center and its
    parameters are the unbroken run's. From the center, or without its momentum or its clock (the cosine's
    step), they are not. The last pause is the run's end (steps 97-99 of 100): resumed once more, the finished
    run adds no line (the last epoch's line was once written twice)."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "ps-easgd-one")
    size = min(comm.Get_size(), 3)
    group = comm.Split(0 if comm.Get_rank() < size else MPI.UNDEFINED, comm.Get_rank())
    if group == MPI.COMM_NULL:
        return
    servers = size - 1
    cfg = TrainConfig(**EASGD, servers=servers)
    _, unbroken = run_async(cfg, private(group))
    spe = steps_per_epoch(400, cfg.batch_per_rank)
    stopping = TrainConfig(**{**cfg.__dict__, "checkpoint": f"{d}/c.pt", "checkpoint_every": 6,
                              "metrics": f"{d}/m.jsonl"})
    counting_pushes(monkeypatch, signal_at=20, signaller=servers)
    with pytest.raises(Stopped) as stopped:
        run_async(stopping, private(group))
    assert (stopped.value.signum, stopped.value.epoch, stopped.value.step) == (signal.SIGUSR1, 0, 24)
    if group.Get_rank() == 0:
        state = load_checkpoint(stopping.checkpoint)
        assert (state["epoch"], state["step"]) == (0, 24) and state["ranks"][0]["version"] == 8
        mine = state["ranks"][servers]
        assert mine["pushes"] == 8 and mine["optimizer"]["state"] and not torch.equal(
            mine["params"], torch.cat([v.reshape(-1) for v in state["model"].values()]))
    steps = counting_pushes(monkeypatch)
    history, resumed = run_async(TrainConfig(**{**stopping.__dict__, "resume": True}), private(group))
    total = 2 * spe // 3  # the run's elastic moves; the worker steps 3 more before the pull told to stop
    assert steps[0] == (0 if group.Get_rank() < servers else (total + 1) * 3 - 24)
    assert [h["epoch"] for h in history] == [1, 2] and history[-1]["pushes_applied"] == total
    assert history[-1]["audit_max_diff"] <= 1e-12
    if group.Get_rank() in (0, servers):
        np.testing.assert_allclose(resumed, unbroken, rtol=0, atol=1e-6)
    again = run_async(TrainConfig(**{**stopping.__dict__, "resume": True}), private(group))[0]
    assert [h["epoch"] for h in again] == [1, 2] and again[-1]["pushes_applied"] == total
    if group.Get_rank() == 0:
        assert load_checkpoint(stopping.checkpoint)["ranks"][servers]["pushes"] == total
        with open(stopping.metrics) as f:
            assert [json.loads(line)["epoch"] for line in f] == [1, 2]
    group.Free()


@pytest.mark.mpi(min_size=3)
def test_easgd_workers_resume_from_their_own_parameters(tmp_path_factory, monkeypatch):
    """Several workers: the checkpoint keeps each one's parameters (not the center, not another's), each
    resumed worker's first step starts from its own, and the resumed run applies and audits every move; resumed
    once more, the finished run's metrics hold each epoch's line once."""
    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    d = shared_dir(tmp_path_factory, "ps-easgd")
    cfg = TrainConfig(**EASGD, servers=servers, checkpoint=f"{d}/c.pt", checkpoint_every=6, metrics=f"{d}/m.jsonl")
    spe = steps_per_epoch(400, cfg.batch_per_rank * workers)
    # the signal in step 13, of move 5 (steps 13-15); the pause after the first move from there on whose next 3
    # steps hold an epoch's end or a multiple of 6
    ends = {k for m in (6, spe) for k in range(m, 200, m)}
    pause = next(c for c in range(5, 60) if any(3 * c <= k < 3 * c + 3 for k in ends))
    counting_pushes(monkeypatch, signal_at=13)
    with pytest.raises(Stopped) as stopped:
        run_async(cfg, private(comm))
    assert (stopped.value.signum, stopped.value.epoch, stopped.value.step) == (signal.SIGUSR1, *divmod(3 * pause, spe))
    state = load_checkpoint(cfg.checkpoint)
    center = torch.cat([v.reshape(-1) for v in state["model"].values()])
    own = [state["ranks"][servers + w]["params"] for w in range(workers)]
    assert [state["ranks"][servers + w]["pushes"] for w in range(workers)] == [pause] * workers
    assert state["ranks"][0]["version"] == pause * workers
    assert all(not torch.equal(p, center) for p in own)
    assert all(not torch.equal(own[0], p) for p in own[1:])
    first, compute = [], ps_worker.compute_step

    def recorded(model, *args):
        if not first:
            first.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        return compute(model, *args)

    monkeypatch.setattr(ps_worker, "compute_step", recorded)
    last = run_async(TrainConfig(**{**cfg.__dict__, "resume": True}), private(comm))[0][-1]
    if comm.Get_rank() >= servers:
        assert torch.equal(first[0], own[comm.Get_rank() - servers])
    assert last["epoch"] == 2 and last["pushes_applied"] == last["pushes_reported"] >= 2 * spe * workers // 3
    assert last["audit_max_diff"] <= 1e-12
    again = run_async(TrainConfig(**{**cfg.__dict__, "resume": True}), private(comm))[0]
    assert [h["epoch"] for h in again] == [1, 2] and again[-1]["audit_max_diff"] <= 1e-12
    if comm.Get_rank() == 0:
        with open(cfg.metrics) as f:
            assert [json.loads(line)["epoch"] for line in f] == [1, 2]


@pytest.mark.mpi(min_size=2)
def test_easgds_other_form_is_refused_on_every_rank(tmp_path_factory):
    """Both forms are mode easgd: the sync form resumed from the async form's checkpoint failed with a KeyError
    in the optimizer's load."""
    comm = MPI.COMM_WORLD
    d = shared_dir(tmp_path_factory, "ps-easgd-form")
    cfg = dict(EASGD, epochs=1, checkpoint=f"{d}/c.pt")
    train(TrainConfig(**cfg), comm)
    with pytest.raises(CheckpointError, match="another experiment: easgd_form 'async' -> None"):
        train(TrainConfig(**{**cfg, "easgd_form": None}, resume=True), comm)


@pytest.mark.mpi(min_size=2)
def test_async_easgds_default_rate_given_on_resume_is_the_same_experiment(tmp_path_factory):
    """The default rate is 0.9 / workers, the servers not among them: given on resume it was refused (taken as
    0.9 / every rank), and a checkpoint of 0.9 / every rank resumed with the default was not."""
    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    d = shared_dir(tmp_path_factory, "ps-easgd-rate")
    cfg = dict(EASGD, servers=servers, checkpoint=f"{d}/c.pt")
    train(TrainConfig(**{**cfg, "epochs": 1}), comm)
    rate = 0.9 / workers
    assert len(train(TrainConfig(**cfg, elastic_alpha=rate, resume=True), comm)) == 2
    with pytest.raises(CheckpointError, match="elastic_alpha"):
        train(TrainConfig(**{**cfg, "epochs": 3}, elastic_alpha=0.9 / comm.Get_size(), resume=True), comm)


@pytest.mark.mpi(min_size=2)
def test_a_parameter_server_that_diverged_keeps_its_last_checkpoint(tmp_path_factory, monkeypatch):
    """From its push spe + 1 the last worker pushes NaN, and SIGUSR1 comes with it: at the next pause the
    parameters are not finite, so no checkpoint is written (it overwrote the last good one, and said written:
    a requeued job resumed from NaN). Every rank stops saying so; the file holds epoch 1's end."""
    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    d = shared_dir(tmp_path_factory, "ps-nan")
    cfg = TrainConfig(**TINY, servers=servers, fixed_delay=2, epochs=2, checkpoint=f"{d}/c.pt", checkpoint_every=3)
    spe = steps_per_epoch(400, cfg.batch_per_rank * workers)
    assert spe % 3
    counting_pushes(monkeypatch, signal_at=spe + 1)
    calls, grads = [0], ps_worker.grad_vector

    def poisoned(model, out):
        calls[0] += 1
        vec = grads(model, out)
        if calls[0] > spe and comm.rank == comm.Get_size() - 1:
            vec[:] = np.nan
        return vec

    monkeypatch.setattr(ps_worker, "grad_vector", poisoned)
    with pytest.raises(Stopped) as stopped:
        run_async(cfg, private(comm))
    assert stopped.value.signum == signal.SIGUSR1 and not stopped.value.written
    if comm.rank == 0:
        state = load_checkpoint(cfg.checkpoint)
        assert (state["epoch"], state["step"]) == (1, 0)
        assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())


@pytest.mark.parametrize("layout,version,where", [
    # Downpour, 3 workers, 10 steps per epoch: version 33 is 11 steps of each; with a worker lost the others'
    # counts run ahead (16 pushes each at version 31), and the run's epoch lines count 31 pushes, 10 steps
    ((1, 3, 10, 3), 33, (1, 1)), ((1, 3, 10, 3), 31, (1, 0)), ((1, 3, 10, 3), 90, (3, 0)),
    # EASGD, 2 workers of 25 steps per epoch, 3 per move, 2 epochs: the run is 33 moves; at version 32 each made
    # 16 (48 steps), and a pause at 33 or 34 is the run's end, not "step 1 of epoch 3" (17 moves, 51 steps)
    ((3, 2, 25, 2), 32, (1, 23)), ((3, 2, 25, 2), 33, (2, 0)), ((3, 2, 25, 2), 34, (2, 0)),
])
def test_the_stop_point_is_the_runs_not_a_workers_count(layout, version, where):
    from types import SimpleNamespace

    from hpcjobs.training.ps_checkpoint import position

    h, workers, spe, epochs = layout
    ctx = SimpleNamespace(cfg=SimpleNamespace(epochs=epochs), steps_per_push=h, workers=workers, spe=spe,
                          total=epochs * spe * workers // h)
    assert position(ctx, version) == where
