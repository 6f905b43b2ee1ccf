"""An asynchronous sharded parameter server: Downpour SGD (Dean et al. 2012)
with stale-synchronous bounds (Ho et al. 2013) and the staleness-aware
rate (Zhang et al. 2016). ``hpcjobs train --mode async``.

The first S ranks of the communicator are servers, the other W are
workers. The flat parameter vector (:func:`~hpcjobs.training.stepping.flatten`)
is cut into S contiguous shards of equal bytes; server k owns shard k and
its optimizer state (SGD with momentum, or Adagrad per shard as in
Downpour). A worker loops, with no barrier:

1. **pull**: asks every server for its shard (``TAG_PULL``, saying its clock
   -- the pushes it has made -- and in fixed-delay mode the version it
   needs) and copies the replies into its model;
2. **compute** a gradient on its next batch (its share of the epoch's
   permutation, as a synchronous rank would have it);
3. **push**: sends each server its slice of the gradient, tagged with the
   version it pulled;

until a server answers a pull with "stop": it has applied the run's
``epochs x (samples / b)`` gradients, from whichever workers made them (a
fast worker goes on into its next epoch's batches while a slow one is
still in its first: an epoch counts samples, not each worker's shard).

A server answers pulls and applies each pushed gradient the moment it
arrives (point-to-point messages and a progress loop: the design doc says
why not one-sided RMA). Every applied gradient's **staleness** is counted:
the server's version at apply minus the version the worker pulled. The
knobs:

- ``staleness_bound`` s: a pull from a worker more than s pushes ahead of
  the slowest live worker waits for it (s = 0: every worker pulls only
  once all have pushed the same number of gradients);
- ``staleness_lr``: each gradient is applied with lr / max(1, staleness)
  (with momentum, it enters the buffer weighed so: ``ShardUpdate.apply``),
  lr being the schedule's rate for b samples (with the synchronous rate
  for W x b samples in its place, the fresh gradients' steps diverged),
  whose warmup starts at sync's first rate per sample
  (:meth:`~hpcjobs.training.config.TrainConfig.schedule`);
- ``fixed_delay`` k: gradient i (worker w's t-th, i = t * W + w) is
  computed on version max(0, i - k) and applied as update i, in order,
  whatever the timing: :func:`reference_fixed_delay` reproduces it in one
  process.

No update is lost: each server sums what it applied per worker, each
worker what it pushed, and the last epoch's line says both agree
(``audit_max_diff``), or the run fails.

Failures: a worker silent for ``peer_timeout`` seconds is declared lost
and the run finishes on the others, naming it (``lost_workers``); this
needs ``mpirun --enable-recovery`` (else Open MPI ends the job when any
process dies). Servers send a heartbeat every ``peer_timeout / 4``, and
so do workers while they wait (one server's held pull is not their silence
to the others); a rank that hears nothing from a server it waits on for
``peer_timeout`` seconds exits non-zero saying so. Server 0 also evaluates: at every
epoch's worth of pushes it snapshots the other shards and tests the model,
heartbeating all the while (a test longer than the timeout is not its death),
as it does while it writes a checkpoint.

Checkpoints (``checkpoint``, ``checkpoint_every``, ``resume``): the workers
pause at each epoch's end (and every ``checkpoint_every``) of their own steps,
and server 0 writes the cut the servers then agree on
(:mod:`hpcjobs.training.ps_checkpoint`); a SIGTERM or SIGUSR1 stops the run
at the next pause.

**Asynchronous EASGD** (``--mode easgd --easgd-form async``; Zhang,
Choromanska, LeCun 2015, Algorithm 1) runs on the same servers, which then
hold the *center* x~ instead of the parameters. A worker takes H
(``local_steps``) SGD steps of its own (its optimizer, the synchronous
schedule for W x b, as synchronous EASGD), then pulls the center, moves
e = a (x - x~) away from its own parameters (x <- x - e) and pushes e, which
the server adds to the center (x~ <- x~ + e) on arrival: the elastic force,
with no barrier. A run is ``epochs x steps / H`` such pushes; staleness,
the audit (the servers' sums of e against the workers'), lost workers and
the tests of the center work as for gradients.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from mpi4py import MPI

from . import schedule as sched
from .config import TrainConfig
from .data import load_dataset_of, rank_batches, steps_per_epoch
from .models import build_model
from .preempt import Noted
from .ps_checkpoint import read
from .ps_common import Ctx, PeerLost, ShardUpdate, shard_bounds
from .ps_server import Server
from .ps_worker import Worker
from .stepping import Straggler, compute_step, flatten, grad_vector

__all__ = ["train_async", "run_async", "reference_fixed_delay", "shard_bounds", "ShardUpdate", "PeerLost"]

def _setup(cfg: TrainConfig, comm: MPI.Intracomm) -> Ctx:
    size, servers, elastic = comm.Get_size(), cfg.servers, cfg.mode == "easgd"
    if size <= servers:
        raise ValueError(f"mode {_name(cfg)} needs workers: {size} ranks and {servers} server(s) (the first "
                         f"{servers} ranks serve); run more ranks or fewer --servers")
    workers = size - servers
    ds = load_dataset_of(cfg, comm)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, width=cfg.width)
    flat = flatten(model)
    spe = steps_per_epoch(len(ds.train), cfg.batch_per_rank * workers)
    problem = elastic_problem(cfg, workers, spe) if elastic else None
    if problem:
        raise ValueError(f"mode {_name(cfg)}: {problem[0]}; {problem[1]}")
    return Ctx(cfg, comm, servers, workers, ds, model, flat, shard_bounds(flat.numel(), servers), spe,
                cfg.mode_schedule(size))


def elastic_problem(cfg: TrainConfig, workers: int, spe: int) -> tuple[str, str] | None:
    """Why asynchronous EASGD on ``workers`` workers of ``spe`` steps an
    epoch cannot run ``cfg``, and the flag that mends it; None where it can
    (``experiment async`` checks its rows with it before the first runs)."""
    if cfg.epochs * spe * workers < cfg.local_steps:
        return (f"{cfg.epochs} epoch(s) of {spe} steps per worker make no elastic move every {cfg.local_steps} "
                "steps", "train longer or lower --local-steps")
    if cfg.local_steps > spe * workers:  # a move past more than an epoch: its epoch lines skipped one
        return (f"an elastic move every {cfg.local_steps} steps is more than an epoch of its {workers} worker(s) "
                f"({spe} steps each, {spe * workers} in all), whose epochs the servers count by moves",
                f"give --local-steps {spe * workers} or less")
    return None


def _name(cfg: TrainConfig) -> str:
    return "easgd (async)" if cfg.mode == "easgd" else cfg.mode


def train_async(cfg: TrainConfig, comm: MPI.Intracomm) -> list[dict]:
    """Run ``cfg`` (mode async, or easgd in its async form) on ``comm``; returns the per-epoch records
    on every rank that finished. Raises ValueError (every rank) for a bad
    layout; a lost server ends this rank with exit status 3."""
    return run_async(cfg, comm)[0]


def run_async(cfg: TrainConfig, comm: MPI.Intracomm) -> tuple[list[dict], np.ndarray]:
    """:func:`train_async`, and the flat parameter vector this rank ends
    with: on server 0 the whole model as last tested (every shard, final
    when no worker was lost); on server k its shard is current; on a
    worker, what it last pulled."""
    ctx = _setup(cfg, comm)
    Straggler(cfg.straggler, ctx.rank, comm.Get_size())  # a bad rank fails here, on every rank
    if ctx.rank == 0 and not cfg.quiet and ctx.elastic:
        print(f"# train: mode easgd (async), {ctx.servers} server(s) hold the center, {ctx.workers} worker(s) meet "
              f"it every {cfg.local_steps} steps, moving rate {ctx.alpha:g}; {cfg.model} ({ctx.flat.numel()} "
              f"parameters) on {cfg.dataset}, batch {cfg.batch_per_rank} per worker step, {ctx.spe} steps per "
              f"worker per epoch, {cfg.optimizer} lr {ctx.lr(ctx.total // cfg.epochs):g} after the first epoch",
              flush=True)
    elif ctx.rank == 0 and not cfg.quiet:
        print(f"# train: mode async, {ctx.servers} server(s) and {ctx.workers} worker(s), {cfg.model} "
              f"({ctx.flat.numel()} parameters) on {cfg.dataset}, batch {cfg.batch_per_rank} per push, "
              f"{ctx.spe} steps per worker per epoch, {cfg.optimizer} lr {ctx.lr(ctx.spe * ctx.workers):g}, "
              + (f"fixed delay {cfg.fixed_delay}" if cfg.fixed_delay is not None else
                 f"staleness bound {cfg.staleness_bound if cfg.staleness_bound is not None else 'none'}")
              + (", staleness-aware rate" if cfg.staleness_lr else ""), flush=True)
    role = Server if ctx.rank < ctx.servers else Worker
    noted = Noted(bool(cfg.checkpoint))  # SIGTERM, SIGUSR1: a checkpoint at the next pause, and stop
    try:
        mine = read(ctx)  # with resume (collective): this rank's state, or None
        try:  # set-up before the clock starts, with every rank ready
            me, error = role(ctx, mine), None
        except ValueError as e:  # a worker's optimizer (nesterov without momentum, say): the servers build none
            me, error = None, e
        errors = comm.allgather(None if error is None else str(error))
        if any(errors):  # on every rank: the others would have waited for this one for good
            if error is not None:
                raise error
            raise ValueError("; ".join(f"rank {r}: {text}" for r, text in enumerate(errors) if text))
        me.noted = noted
        try:
            history = me.run()
            return history, ctx.flat.numpy()
        except PeerLost as e:
            print(f"hpcjobs train: error: rank {ctx.rank}: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(3)  # MPI_Finalize would wait for the lost rank
    finally:
        noted.restore()


# --- the single-process reference ---------------------------------------------------

def reference_fixed_delay(cfg: TrainConfig, workers: int) -> np.ndarray:
    """The parameters ``train_async`` ends with in fixed-delay mode with
    ``workers`` workers, computed in this process: update i is the gradient
    of worker i % W's batch on the parameters of version max(0, i - k)."""
    ds = load_dataset_of(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, width=cfg.width)
    flat = flatten(model).numpy()
    params = flat.copy()  # the server's vector; ``flat`` is what the gradient is computed on
    update, kept = ShardUpdate(cfg, params), {0: params.copy()}
    spe = steps_per_epoch(len(ds.train), cfg.batch_per_rank * workers)
    schedule, grad, version = cfg.schedule(1, workers), np.empty_like(flat), 0
    for epoch in range(cfg.epochs):
        batches = [rank_batches(len(ds.train), cfg.batch_per_rank, w, workers, epoch, cfg.seed)
                   for w in range(workers)]
        for t in range(spe):
            for w in range(workers):
                index = (epoch * spe + t) * workers + w
                flat[:] = kept[max(0, index - cfg.fixed_delay)]
                compute_step(model, ds, batches[w][t])
                update.apply(grad_vector(model, grad), sched.lr_at(version, spe * workers, schedule))
                version += 1
                kept[version] = params.copy()
                kept.pop(version - cfg.fixed_delay - 1, None)
    return params
