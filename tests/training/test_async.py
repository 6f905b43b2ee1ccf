"""SGD without lockstep (hpcjobs.training.paramserver, .averaging): the
server's update rules against torch's, fixed-delay async against a
single-process reference, the staleness bound as an invariant, local SGD
with H = 1 against synchronous SGD, local SGD and EASGD against a
one-process simulation of their workers, Hogwild! alone against SGD."""

import json

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcjobs.comm import private
from hpcjobs.training import schedule as sched
from hpcjobs.training.config import TrainConfig
from hpcjobs.training.data import load_dataset, rank_batches, steps_per_epoch
from hpcjobs.training.loop import train
from hpcjobs.training.models import build_model
from hpcjobs.training.paramserver import ShardUpdate, reference_fixed_delay, run_async, shard_bounds
from hpcjobs.training.stepping import compute_step, evaluate_local, flatten

torch.set_num_threads(1)

TINY = dict(model="mlp", width=16, dataset="mnist1d", num_samples=500, batch_per_rank=8, lr=0.05, warmup="none",
            progress=False, quiet=True)


def test_shards_cover_the_vector_in_equal_parts():
    assert shard_bounds(10, 3) == [0, 3, 6, 10]
    assert shard_bounds(7, 1) == [0, 7]
    with pytest.raises(ValueError, match="at most one server per parameter"):
        shard_bounds(2, 3)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_the_servers_update_is_torchs(optimizer):
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(50).astype(np.float32)
    grads = [rng.standard_normal(50).astype(np.float32) for _ in range(4)]
    cfg = TrainConfig(optimizer=optimizer, momentum=0.9, weight_decay=0.01)
    shard = p0.copy()
    ours = ShardUpdate(cfg, shard)
    t = torch.tensor(p0.copy(), requires_grad=True)
    theirs = (torch.optim.SGD([t], lr=0.1, momentum=0.9, weight_decay=0.01) if optimizer == "sgd"
              else torch.optim.Adagrad([t], lr=0.1, weight_decay=0.01))
    for g, lr in zip(grads, (0.1, 0.1, 0.05, 0.05)):
        ours.apply(g, lr)
        theirs.param_groups[0]["lr"] = lr
        t.grad = torch.from_numpy(g)
        theirs.step()
    np.testing.assert_allclose(shard, t.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_stale_gradient_is_damped_and_the_momentum_before_it_is_not():
    """Staleness-aware SGD applies each gradient at lr/τ (Zhang et al. 2016).
    With momentum that is the gradient's weight in the buffer: u = μu + g/τ,
    p -= lr u. Dividing the step's rate instead would damp every gradient
    still in the buffer by the newest one's staleness."""
    cfg = TrainConfig(optimizer="sgd", momentum=0.9)
    p = np.zeros(2, dtype=np.float32)
    ours = ShardUpdate(cfg, p)
    ours.apply(np.array([1, 0], np.float32), 0.1, share=1 / 4)  # τ = 4
    ours.apply(np.array([0, 1], np.float32), 0.1)               # fresh
    np.testing.assert_allclose(p, [-0.1 * (0.25 + 0.9 * 0.25), -0.1], rtol=1e-6)


def test_flatten_makes_the_parameters_views_of_one_vector():
    torch.manual_seed(0)
    model = build_model("mlp", (40,), 10, width=8)
    before = [p.detach().clone() for p in model.parameters()]
    flat = flatten(model)
    assert torch.equal(flat, torch.cat([b.reshape(-1) for b in before]))
    flat.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())


@pytest.mark.parametrize("kw,words", [
    (dict(mode="pipeline"), "unknown mode 'pipeline'"),
    (dict(mode="local", staleness_lr=True), "staleness_lr is a knob of mode async, not local"),
    (dict(fixed_delay=1), "fixed_delay is a knob of mode async, not sync"),
    (dict(mode="async", optimizer="adam"), "applies sgd or adagrad updates itself, not adam"),
    (dict(mode="hogwild", optimizer="adagrad"), "applies sgd updates itself"),
    (dict(mode="async", compression="fp16"), "compression is for mode sync"),
    (dict(mode="local", model="resnet18"), "model resnet18 is for mode sync"),
    (dict(mode="async", fixed_delay=1, staleness_lr=True), "no staleness_bound or staleness_lr"),
    (dict(mode="easgd", elastic_alpha=1.5), "elastic_alpha must be in (0, 1)"),
    (dict(mode="easgd", average_momentum=True), "average_momentum is a knob of mode local, not easgd"),
    (dict(mode="local", easgd_form="async"), "easgd_form is a knob of mode easgd, not local"),
    (dict(mode="easgd", easgd_form="gossip"), "unknown easgd_form 'gossip'"),
    (dict(mode="local", average_momentum=True, momentum=0.0), "optimizer sgd or nesterov with momentum > 0"),
    (dict(mode="local", staleness_bound=0), "staleness_bound is a knob of mode async, not local"),
    (dict(mode="local", target_loss=0.3), "target_loss is for mode sync"),
    (dict(mode="hogwild", nonfinite="abort"), "nonfinite is for mode sync"),
    (dict(mode="async", straggler="0:3"), "rank 0 is a server in mode async"),
    (dict(mode="easgd", easgd_form="async", servers=2, straggler="1:2"), "rank 1 is a server in mode easgd"),
    (dict(straggler="1"), "RANK:FACTOR"),
    (dict(straggler="1:0.5"), "FACTOR >= 1"),
    # flags a mode would ignore (accepted until 2026-11-29, and ignored)
    (dict(mode="async", algorithm="ring"), "algorithm picks the allreduce of modes sync, local and easgd"),
    (dict(mode="hogwild", algorithm="tree"), "mode hogwild would ignore it"),
    (dict(mode="easgd", easgd_form="async", algorithm="ring"), "mode easgd (async form) would ignore it"),
    (dict(mode="local", algorithm="shm"), "mode local averages with a message-passing algorithm"),
    (dict(mode="easgd", algorithm="hierarchical"), "mode easgd averages with a message-passing algorithm"),
    (dict(mode="local", fusion_bytes=1 << 10), "fusion_bytes buckets the gradients of mode sync"),
    (dict(mode="async", overlap="none"), "overlap overlaps mode sync's reductions"),
    (dict(mode="local", peer_timeout=5.0), "peer_timeout is the parameter servers'"),
    (dict(mode="async", no_decay_bn_bias=True), "no_decay_bn_bias is torch's optimizer's"),
    (dict(mode="hogwild", momentum_correction=False), "momentum_correction is torch's optimizer's"),
    (dict(algorithm="rnig"), "unknown algorithm 'rnig'"),
    (dict(peer_timeout=5.0), "peer_timeout is the parameter servers'"),  # sync took it, silently
    (dict(algorithm="cuda_ipc"), "unknown algorithm 'cuda_ipc'"),  # DistributedOptimizer's: through auto only
    (dict(model="mlp", batch_norm=True, batch_per_rank=1), "one sample per rank gives BatchNorm one value"),
    (dict(model="resnet18", batch_per_rank=1), "one sample per rank gives BatchNorm one value"),
    (dict(final_lr=0.01), "final_lr is where cosine decay ends, and decay is 'none'"),
    (dict(optimizer="adam", momentum=0.5), "momentum is taken by the SGDs, RMSprop and LARS only"),
    (dict(trust_coefficient=0.01), "trust_coefficient is taken by LARS only"),
    (dict(gamma=0.5, decay="cosine"), "gamma is taken by decay step only"),
])
def test_bad_mode_settings_are_refused(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kw).validate()


@pytest.mark.parametrize("kw", [
    dict(mode="local", algorithm="ring"), dict(mode="easgd", algorithm="tree"), dict(mode="async", peer_timeout=5.0),
    dict(mode="easgd", easgd_form="async", peer_timeout=5.0, no_decay_bn_bias=True, momentum_correction=False),
    dict(mode="local", no_decay_bn_bias=True, momentum_correction=False),  # torch's optimizer runs them
    dict(mode="local", checkpoint="c.pt", checkpoint_every=5, resume=True), dict(mode="easgd", checkpoint="c.pt"),
    dict(mode="easgd", easgd_form="async", checkpoint="c.pt", checkpoint_every=5, resume=True),
])
def test_what_a_mode_uses_it_takes(kw):
    TrainConfig(**kw).validate()


def _layout(size):
    servers = 2 if size >= 4 else 1
    return servers, size - servers


@pytest.mark.mpi(min_size=2)
def test_fixed_delay_async_is_the_single_process_reference():
    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    cfg = TrainConfig(**TINY, mode="async", servers=servers, fixed_delay=2, epochs=1)
    history, flat = run_async(cfg, private(comm))
    assert history[-1]["staleness_max_run"] == 2  # gradient i on version i - 2, from the third on
    # each push sends the whole gradient, a shard to each server: every server's bytes count (with 2 servers,
    # server 0's alone were half); the headers, pulls and the audit add a little
    for h in history:
        gradients = 4 * flat.size * h["pushes"] / workers
        assert gradients <= h["sent_bytes"] < 1.25 * gradients, (h["sent_bytes"], gradients, servers)
    if comm.Get_rank() == 0:  # server 0 holds every shard, as last tested: the final parameters
        np.testing.assert_allclose(flat, reference_fixed_delay(cfg, workers), rtol=0, atol=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bound", [0, 1])
def test_a_staleness_bound_bounds_the_staleness_and_no_push_is_lost(bound, tmp_path):
    comm = MPI.COMM_WORLD
    workers = comm.Get_size() - 1
    metrics = tmp_path / "m.jsonl"  # rank 0's: server 0 reports
    cfg = TrainConfig(**TINY, mode="async", staleness_bound=bound, epochs=1, straggler="1:2", metrics=str(metrics))
    last = train(cfg)[-1]
    assert len(last["pushes_by_worker"]) == workers and sum(last["pushes_by_worker"]) == last["pushes_applied"]
    if comm.Get_rank() == 0:  # the metrics' last line carries the audit, as the returned history does
        lines = metrics.read_text().splitlines()
        line = json.loads(lines[-1])
        assert len(lines) == 1 and line["epoch"] == last["epoch"] == 1
        for key in ("pushes_applied", "pushes_reported", "pushes_by_worker", "staleness_max_run"):
            assert line[key] == last[key]
    # a worker pulls at most s ahead of the slowest; the others push at most 2s + 1 times before its push
    assert last["staleness_max_run"] <= (workers - 1) * (2 * bound + 1)
    spe = steps_per_epoch(400, cfg.batch_per_rank * workers)
    # the run's pushes, and those in flight when the server said stop (one per other worker at most)
    assert spe * workers <= last["pushes_applied"] == last["pushes_reported"] < (spe + 1) * workers
    assert last["audit_max_diff"] <= 1e-12


@pytest.mark.mpi(min_size=2)
def test_local_sgd_averaging_every_step_is_synchronous_sgd():
    common = dict(TINY, epochs=2, algorithm="ring", momentum=0.9)
    sync = train(TrainConfig(**common))
    local = train(TrainConfig(**common, mode="local", local_steps=1))
    for s, lo in zip(sync, local):
        assert lo["test_loss"] == pytest.approx(s["test_loss"], rel=1e-5)
        assert lo["loss"] == pytest.approx(s["loss"], rel=1e-5)
        assert lo["sent_bytes"] == s["sent_bytes"]  # one vector of the same size per step, on the same ring


def _simulate(cfg: TrainConfig, workers: int) -> float:
    """Every worker of local SGD or EASGD in this process; the test loss
    of what is tested (the average of the workers, or the center)."""
    from hpcjobs.training.optimizers import make_optimizer

    ds = load_dataset(cfg.dataset, num_samples=cfg.num_samples, seed=cfg.data_seed)
    models, flats, opts = [], [], []
    for _ in range(workers):
        torch.manual_seed(cfg.seed)
        models.append(build_model(cfg.model, ds.input_shape, ds.num_classes, width=cfg.width))
        flats.append(flatten(models[-1]))
        opts.append(make_optimizer(cfg, models[-1]))
    center, alpha = flats[0].clone(), cfg.elastic_alpha or 0.9 / workers
    spe, schedule, step = steps_per_epoch(len(ds.train), cfg.batch_per_rank * workers), cfg.schedule(workers), 0
    for epoch in range(cfg.epochs):
        batches = [rank_batches(len(ds.train), cfg.batch_per_rank, w, workers, epoch, cfg.seed)
                   for w in range(workers)]
        for t in range(spe):
            for w in range(workers):
                compute_step(models[w], ds, batches[w][t])
                sched.set_lr(opts[w], sched.lr_at(step, spe, schedule))
                opts[w].step()
            step += 1
            if step % cfg.local_steps == 0:
                total = sum(f.clone() for f in flats)
                if cfg.average_momentum:
                    for ps in zip(*(m.parameters() for m in models)):
                        bufs = [o.state[p]["momentum_buffer"] for o, p in zip(opts, ps)]
                        mean = sum(b.clone() for b in bufs) / workers
                        for b in bufs:
                            b.copy_(mean)
                for f in flats:
                    if cfg.mode == "local":
                        f.copy_(total / workers)
                    else:
                        f.sub_(f - center, alpha=alpha)
                if cfg.mode == "easgd":
                    center.add_(total - workers * center, alpha=alpha)
    flats[0].copy_(center if cfg.mode == "easgd" else sum(f.clone() for f in flats) / workers)
    sums = evaluate_local(models[0], ds)
    return sums[0] / sums[2]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode,extra", [("local", {}), ("local", {"average_momentum": True}), ("easgd", {})])
def test_local_sgd_and_easgd_are_their_one_process_simulation(mode, extra):
    comm = MPI.COMM_WORLD
    cfg = TrainConfig(**TINY, epochs=1, mode=mode, local_steps=3, **extra)
    last = train(cfg)[-1]
    if comm.Get_rank() == 0:
        want = _simulate(cfg, comm.Get_size())
        assert last["test_loss"] == pytest.approx(want, rel=1e-5)
        if extra:  # and averaging the buffers changes the run by more than the tolerance above
            assert want != pytest.approx(_simulate(TrainConfig(**TINY, epochs=1, mode=mode, local_steps=3),
                                                   comm.Get_size()), rel=2e-5)


@pytest.mark.mpi(min_size=2)
def test_async_easgd_with_one_worker_is_easgd():
    """With one worker nothing is stale: the server's center after each
    elastic step is synchronous EASGD's, simulated in one process."""
    comm = MPI.COMM_WORLD
    pair = comm.Split(0 if comm.Get_rank() < 2 else MPI.UNDEFINED, comm.Get_rank())
    if pair == MPI.COMM_NULL:
        return
    cfg = TrainConfig(**TINY, epochs=2, mode="easgd", easgd_form="async", local_steps=3)
    history, center = run_async(cfg, private(pair))
    assert history[-1]["staleness_max_run"] == 0 and history[-1]["audit_max_diff"] == 0
    if pair.Get_rank() == 0:
        assert history[-1]["test_loss"] == pytest.approx(_simulate(cfg, 1), rel=1e-5)
    pair.Free()


@pytest.mark.mpi(min_size=3)
def test_async_easgd_applies_every_elastic_step():
    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    cfg = TrainConfig(**TINY, epochs=3, mode="easgd", easgd_form="async", servers=servers, local_steps=2)
    last = train(cfg)[-1]
    spe = steps_per_epoch(400, cfg.batch_per_rank * workers)
    # the center is the start plus every e the workers pushed (the servers check it), no more, no less
    assert 3 * spe * workers // 2 <= last["pushes_applied"] == last["pushes_reported"]
    assert last["audit_max_diff"] <= 1e-12


@pytest.mark.mpi(min_size=3)
def test_async_easgd_workers_step_at_the_runs_rate_not_at_their_own_count(monkeypatch):
    """A worker 4x slower than the others takes fewer steps; under a cosine
    decay its own count would still give it a high rate at the end. Its rate
    follows the run's moves instead: its last step's rate is the one the
    center's moves at its last pull give, below what its count gives where
    the run has moved further. On their own counts (the code before) the two
    are equal."""
    from hpcjobs.training import ps_worker

    comm = MPI.COMM_WORLD
    servers, workers = _layout(comm.Get_size())
    cfg = TrainConfig(**TINY, epochs=3, mode="easgd", easgd_form="async", servers=servers, local_steps=2,
                      decay="cosine", straggler=f"{servers}:4")
    moves, pull = [], ps_worker.Worker._pull

    def recording(self, clock, wanted):  # the center's moves at each answered pull (server 0's version)
        heads = pull(self, clock, wanted)
        if heads is not None:
            moves.append(int(heads[0][0]))
        return heads

    monkeypatch.setattr(ps_worker.Worker, "_pull", recording)
    last = train(cfg)[-1]
    spe = steps_per_epoch(400, cfg.batch_per_rank * workers)
    rates, pushes = last["lr_by_worker"], last["pushes_by_worker"]
    assert len(rates) == workers and all(r is not None for r in rates)
    if comm.rank != servers:  # worker 0's rank knows its pulls
        return
    # its last steps: the H after its last answered pull, the run's clock then counting from the moves applied
    # and its own; on its own count (the code before) the last would be step (pushes + 1) x H - 1. At 3 ranks
    # the run's clock had reached the schedule's end (rate 0) where its own count gave step 43 of 75 (pushes
    # [21, 54]). Which is further is the scheduler's (5 ranks on 2 cores once starved a worker of normal speed:
    # pushes [21, 50, 2]), so the rate is held to the clock of its own last pull, not to "below its own".
    clock = (moves[-1] + 1) * cfg.local_steps // workers  # ps_common.elastic_step
    last = sched.lr_at(clock + cfg.local_steps - 1, spe, cfg.schedule(workers))
    assert len(moves) == pushes[0] and rates[0] == pytest.approx(last)


@pytest.mark.mpi(min_size=1)
def test_hogwild_alone_is_sgd_and_together_it_learns():
    comm = MPI.COMM_WORLD
    alone = comm.Split(comm.Get_rank())
    common = dict(TINY, epochs=1, momentum=0.9)
    hogwild = train(TrainConfig(**common, mode="hogwild"), comm=alone)
    sgd = train(TrainConfig(**common, mode="local", local_steps=1), comm=alone)
    alone.Free()
    assert hogwild[0]["test_loss"] == pytest.approx(sgd[0]["test_loss"], rel=1e-6)
    together = train(TrainConfig(**dict(common, epochs=2), mode="hogwild", hogwild_lock=True))
    # lower again, and below chance by the end (at 5 ranks on 2 cores epoch 1's mean loss, 10 steps a rank on
    # reads some versions old, lies within 0.03 of chance, log 10 = 2.303: the review simulated 2.275 to 2.307;
    # epoch 2 was 1.99 to 2.05 at 5 ranks here)
    assert together[-1]["loss"] < min(together[0]["loss"], np.log(10) - 0.05)
    # each update took the lock (a fetch-and-add on its counter, flushed), every rank's, each epoch
    spe = steps_per_epoch(400, TINY["batch_per_rank"] * comm.Get_size())
    assert [r["locked_updates"] for r in together] == [spe * comm.Get_size(), 2 * spe * comm.Get_size()]


@pytest.mark.mpi(min_size=2)
def test_an_easgd_rate_that_makes_the_center_overshoot_is_refused_on_every_rank():
    """Each move multiplies the gap between the ranks' mean and the center
    by 1 - (W + 1) a; at 2 / (W + 1) and above it does not shrink."""
    W = MPI.COMM_WORLD.Get_size()
    with pytest.raises(ValueError, match=r"below 2/\(W\+1\)"):
        train(TrainConfig(**TINY, epochs=1, mode="easgd", elastic_alpha=min(0.99, 2 / (W + 1))))
    with pytest.raises(ValueError, match="make no elastic move every 1000 steps"):
        train(TrainConfig(**TINY, epochs=1, mode="easgd", local_steps=1000))
