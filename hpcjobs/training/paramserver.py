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
- ``staleness_lr``: each gradient is applied with lr / max(1, staleness),
  lr being the schedule's rate for b samples (with the synchronous rate
  for W x b samples in its place, the fresh gradients' steps diverged);
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
process dies). Servers send a heartbeat every ``peer_timeout / 4``; a
rank that hears nothing from a server it waits on for ``peer_timeout``
seconds exits non-zero saying so. Server 0 also evaluates: at every
epoch's worth of pushes it snapshots the other shards and tests the model.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from . import schedule as sched
from .config import TrainConfig
from .data import Dataset, load_dataset, rank_batches, steps_per_epoch
from .models import build_model
from .stepping import (Straggler, compute_step, evaluate_local, finish_record, flatten, grad_vector, report)

__all__ = ["train_async", "run_async", "reference_fixed_delay", "shard_bounds", "ShardUpdate", "PeerLost"]

HDR = 64  # bytes of float64 header at the front of every message
TAG_PULL, TAG_PARAMS, TAG_PUSH, TAG_DONE, TAG_SNAP, TAG_SHARD, TAG_STOP, TAG_FINAL, TAG_ALIVE = range(7101, 7110)
IDLE_S = 2e-4  # a server's nap when no message waits: it leaves the cores to the workers
FAULT_ENV = "HPCJOBS_FAULT_KILL"  # "RANK:COUNT": that rank SIGKILLs itself after COUNT pushes (tests)


class PeerLost(RuntimeError):
    """A server (or, in fixed-delay mode, a worker) went silent."""


def shard_bounds(n: int, servers: int) -> list[int]:
    """Offsets of the S contiguous shards of an n-value vector (equal bytes, within one value)."""
    if servers > n:
        raise ValueError(f"{servers} servers for {n} parameters: at most one server per parameter")
    return [n * k // servers for k in range(servers + 1)]


class ShardUpdate:
    """A server's optimizer on its shard, in place, in float32: SGD with
    momentum (torch.optim.SGD's rule) or Adagrad (torch.optim.Adagrad's)."""

    def __init__(self, cfg: TrainConfig, shard: np.ndarray):
        self.p, self.adagrad = shard, cfg.optimizer == "adagrad"
        self.mu, self.wd = np.float32(cfg.momentum), np.float32(cfg.weight_decay)
        self.state = np.zeros_like(shard)

    def apply(self, g: np.ndarray, lr: float) -> None:
        if self.wd:
            g = g + self.wd * self.p
        if self.adagrad:
            self.state += g * g
            self.p -= np.float32(lr) * g / (np.sqrt(self.state) + np.float32(1e-10))
        elif self.mu:
            self.state *= self.mu
            self.state += g
            self.p -= np.float32(lr) * self.state
        else:
            self.p -= np.float32(lr) * g


@dataclass
class _Ctx:
    cfg: TrainConfig
    comm: MPI.Intracomm
    servers: int
    workers: int
    ds: Dataset
    model: torch.nn.Module
    flat: torch.Tensor
    bounds: list
    spe: int  # each worker's steps per epoch
    schedule: sched.ScheduleConfig

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    def shard(self, k: int) -> slice:
        return slice(self.bounds[k], self.bounds[k + 1])

    def lr(self, version: int) -> float:  # the schedule counts pushes: an epoch is spe * W of them
        return sched.lr_at(version, self.spe * self.workers, self.schedule)

    @property
    def total(self) -> int:  # the pushes of the run: the epochs' samples, from whichever workers
        return self.cfg.epochs * self.spe * self.workers


def _die_if_told(rank: int, count: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{count}":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _setup(cfg: TrainConfig, comm: MPI.Intracomm) -> _Ctx:
    size, servers = comm.Get_size(), cfg.servers
    if size <= servers:
        raise ValueError(f"mode async needs workers: {size} ranks and {servers} server(s) (the first "
                         f"{servers} ranks serve); run more ranks or fewer --servers")
    workers = size - servers
    ds = load_dataset(cfg.dataset, comm=comm, data_dir=cfg.data_dir, num_samples=cfg.num_samples,
                      seed=cfg.data_seed, seq_len=cfg.seq_len)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, width=cfg.width)
    flat = flatten(model)
    return _Ctx(cfg, comm, servers, workers, ds, model, flat, shard_bounds(flat.numel(), servers),
                steps_per_epoch(len(ds.train), cfg.batch_per_rank * workers), cfg.schedule(1))


def train_async(cfg: TrainConfig, comm: MPI.Intracomm) -> list[dict]:
    """Run ``cfg`` (mode async) on ``comm``; returns the per-epoch records
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
    if ctx.rank == 0 and not cfg.quiet:
        print(f"# train: mode async, {ctx.servers} server(s) and {ctx.workers} worker(s), {cfg.model} "
              f"({ctx.flat.numel()} parameters) on {cfg.dataset}, batch {cfg.batch_per_rank} per push, "
              f"{ctx.spe} steps per worker per epoch, {cfg.optimizer} lr {ctx.lr(ctx.spe * ctx.workers):g}, "
              + (f"fixed delay {cfg.fixed_delay}" if cfg.fixed_delay is not None else
                 f"staleness bound {cfg.staleness_bound if cfg.staleness_bound is not None else 'none'}")
              + (", staleness-aware rate" if cfg.staleness_lr else ""), flush=True)
    comm.Barrier()
    try:
        history = _Server(ctx).run() if ctx.rank < ctx.servers else _Worker(ctx).run()
        return history, ctx.flat.numpy()
    except PeerLost as e:
        print(f"hpcjobs train: error: rank {ctx.rank}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)  # MPI_Finalize would wait for the lost rank


# --- the server ----------------------------------------------------------------

class _Epoch:
    def __init__(self):
        self.sums, self.stale_sum, self.stale_max, self.pushes = np.zeros(3), 0, 0, 0
        self.bytes_in, self.bytes_out = 0, 0


class _Server:
    def __init__(self, ctx: _Ctx):
        self.ctx, self.cfg, self.comm = ctx, ctx.cfg, ctx.comm
        self.k, self.S, self.W = ctx.rank, ctx.servers, ctx.workers
        self.shard = ctx.flat[ctx.shard(self.k)].numpy()
        self.update = ShardUpdate(ctx.cfg, self.shard)
        m = self.shard.size
        self.inbuf = np.empty(HDR + 8 * m, np.uint8)
        self.outbuf = [np.empty(HDR + 4 * m, np.uint8) for _ in range(self.W)]
        self.outreq = [MPI.REQUEST_NULL] * self.W
        self.version, self.clocks = 0, np.zeros(self.W, np.int64)
        self.done, self.lost, self.heard = {}, set(), np.full(self.W, time.monotonic())
        self.deferred, self.pending = [], {}
        self.kept = {0: self.shard.copy()} if ctx.cfg.fixed_delay is not None else None
        self.applied_by, self.applied_sum = np.zeros(self.W, np.int64), np.zeros(m, np.float64)
        self.ep, self.history, self.stopped, self.heard0 = _Epoch(), [], False, time.monotonic()
        self.alive_reqs, self.alive_buf, self.next_alive = [], np.zeros(8), 0.0
        self.t0 = self.t_epoch = time.monotonic()
        self.stale_all = [0, 0, 0]  # sum, count, max over the run

    def run(self) -> list[dict]:
        status = MPI.Status()
        while not self.stopped:
            if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                self._handle(status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE))
                self._heartbeat(time.monotonic())  # busy or not: a held pull's worker must hear from us
                continue
            now = time.monotonic()
            self._heartbeat(now)
            self._find_lost(now)
            if self.k == 0 and self._all_in() and not self.pending:
                self._finish()
                break
            if self.k and now - self.heard0 > self.cfg.peer_timeout:
                raise PeerLost(f"server rank 0 sent nothing for {self.cfg.peer_timeout:g} s: presumed lost")
            time.sleep(IDLE_S)
        return self._final_history()

    def _all_in(self) -> bool:
        return len(self.done) + len(self.lost - set(self.done)) == self.W

    def _handle(self, src: int, tag: int, count: int) -> None:
        req = self.comm.Irecv([self.inbuf, count, MPI.BYTE], source=src, tag=tag)
        deadline = time.monotonic() + self.cfg.peer_timeout
        while not req.Test():  # a large message flows only while its sender lives
            if time.monotonic() > deadline:
                self.inbuf = np.empty_like(self.inbuf)  # the stuck receive keeps the old one
                if src >= self.S:
                    self.heard[src - self.S] = 0.0  # lost at the next look
                return
            time.sleep(IDLE_S)
        hdr = self.inbuf[:HDR].view(np.float64)
        if src == 0 and self.k:
            self.heard0 = time.monotonic()
        if tag == TAG_ALIVE:
            return
        if tag == TAG_SNAP:
            out = np.empty(HDR + 4 * self.shard.size, np.uint8)
            out[:HDR].view(np.float64)[0] = self.version
            out[HDR:].view(np.float32)[:] = self.shard
            self.comm.Send(out, dest=0, tag=TAG_SHARD)
            return
        if tag == TAG_STOP:
            self.stopped = True
            self.comm.send(self._audit(), dest=0, tag=TAG_STOP)
            return
        w = src - self.S
        if w in self.lost:
            return  # a worker declared lost that speaks again: its messages are dropped
        self.heard[w] = time.monotonic()
        self.ep.bytes_in += count
        if tag == TAG_PULL:
            self.deferred.append((w, int(hdr[0]), int(hdr[1])))
        elif tag == TAG_PUSH:
            grad = self.inbuf[HDR:HDR + 4 * self.shard.size].view(np.float32)
            if self.kept is not None and int(hdr[2]) != self.version:
                self.pending[int(hdr[2])] = (w, hdr.copy(), grad.copy())
            else:
                self._apply(w, hdr, grad)
            while self.version in self.pending:
                self._apply(*self.pending.pop(self.version))
        elif tag == TAG_DONE:
            self.done[w] = (int(hdr[0]), self.inbuf[HDR:HDR + 8 * self.shard.size].view(np.float64).copy())
        self._answer_deferred()

    def _apply(self, w: int, hdr: np.ndarray, grad: np.ndarray) -> None:
        staleness = self.version - int(hdr[0])
        lr = self.ctx.lr(self.version)
        if self.cfg.staleness_lr:
            lr /= max(1, staleness)
        self.update.apply(grad, lr)
        self.applied_sum += grad
        self.applied_by[w] += 1
        self.clocks[w] += 1
        self.version += 1
        ep = self.ep
        ep.sums += hdr[3:6]
        ep.stale_sum += staleness
        ep.stale_max = max(ep.stale_max, staleness)
        ep.pushes += 1
        self.stale_all = [self.stale_all[0] + staleness, self.stale_all[1] + 1, max(self.stale_all[2], staleness)]
        if self.kept is not None:
            self.kept[self.version] = self.shard.copy()
            self.kept.pop(self.version - self.cfg.fixed_delay - 1, None)
        _die_if_told(self.comm.Get_rank(), self.version)
        if self.k == 0 and self.version % (self.ctx.spe * self.W) == 0 and self.version < self.ctx.total:
            self._record(self.version // (self.ctx.spe * self.W))

    def _ready(self, w: int, clock: int, wanted: int) -> bool:
        if self.version >= self.ctx.total:
            return True  # answered with "stop"
        if self.kept is not None:
            return self.version >= wanted
        if self.cfg.staleness_bound is None:
            return True
        live = [self.clocks[j] for j in range(self.W) if j not in self.done and j not in self.lost and j != w]
        return not live or clock - min(live) <= self.cfg.staleness_bound

    def _answer_deferred(self) -> None:
        still = []
        for w, clock, wanted in self.deferred:
            if w in self.lost:
                continue
            if not self._ready(w, clock, wanted):
                still.append((w, clock, wanted))
                continue
            self.outreq[w].Wait()  # the last reply to this worker (it asked again, so it has it)
            buf = self.outbuf[w]
            buf[:HDR].view(np.float64)[:2] = (wanted if self.kept is not None else self.version,
                                              self.version >= self.ctx.total)
            buf[HDR:].view(np.float32)[:] = self.kept[wanted] if self.kept is not None else self.shard
            self.outreq[w] = self.comm.Isend(buf, dest=self.S + w, tag=TAG_PARAMS)
            self.ep.bytes_out += buf.nbytes
        self.deferred = still

    def _heartbeat(self, now: float) -> None:
        if now < self.next_alive:
            return
        self.next_alive = now + self.cfg.peer_timeout / 4
        self.alive_reqs = [r for r in self.alive_reqs if not r.Test()]
        dests = [self.S + w for w in range(self.W) if w not in self.lost]
        dests += list(range(1, self.S)) if self.k == 0 else []
        self.alive_reqs += [self.comm.Isend(self.alive_buf, dest=d, tag=TAG_ALIVE) for d in dests]

    def _find_lost(self, now: float) -> None:
        waiting = {w for w, _, _ in self.deferred}  # silent because this server holds their pull
        for w in range(self.W):
            if w in self.done or w in self.lost or w in waiting or now - self.heard[w] <= self.cfg.peer_timeout:
                continue
            if self.kept is not None:
                raise PeerLost(f"worker rank {self.S + w} sent nothing for {self.cfg.peer_timeout:g} s; "
                               "fixed-delay mode applies gradients in order and cannot go on without it")
            self.lost.add(w)
            if self.k == 0 and not self.cfg.quiet:
                print(f"# train: worker rank {self.S + w} lost (silent for {self.cfg.peer_timeout:g} s after "
                      f"{self.applied_by[w]} pushes); going on with the others", flush=True)
            self._answer_deferred()

    def _snapshot(self) -> None:
        """Server 0: the other servers' shards into the model, for testing."""
        for k in range(1, self.S):
            sl = self.ctx.shard(k)
            buf = np.empty(HDR + 4 * (sl.stop - sl.start), np.uint8)
            req = self.comm.Irecv(buf, source=k, tag=TAG_SHARD)
            self.comm.Send(self.alive_buf, dest=k, tag=TAG_SNAP)
            _await(self.comm, [req], [k], self.cfg.peer_timeout, {k: time.monotonic()})
            self.ctx.flat[sl] = torch.from_numpy(buf[HDR:].view(np.float32))

    def _record(self, epoch: float) -> None:
        now, ep = time.monotonic(), self.ep  # the times leave out the test (the workers go on meanwhile)
        self._snapshot()
        test = evaluate_local(self.ctx.model, self.ctx.ds)
        live = self.W - len(self.lost)
        record = {"epoch": epoch, "step": self.version, "lr": self.ctx.lr(max(0, self.version - 1)),
                  "loss": ep.sums[0] / max(1, ep.sums[2]), "train_acc": ep.sums[1] / max(1, ep.sums[2]),
                  "test_loss": test[0] / test[2], "test_acc": test[1] / test[2], "epoch_s": now - self.t_epoch,
                  "wall_s": now - self.t0, "samples": ep.sums[2], "pushes": ep.pushes,
                  "staleness_mean": ep.stale_sum / max(1, ep.pushes), "staleness_max": ep.stale_max,
                  "sent_bytes": ep.bytes_in / max(1, live), "received_bytes": ep.bytes_out / max(1, live)}
        if self.lost:
            record["lost_workers"] = ",".join(str(self.S + w) for w in sorted(self.lost))
        record = finish_record(self.cfg, record, live)
        self.history.append(record)
        report(self.cfg, record)
        self.t0 += time.monotonic() - now  # the test's seconds are not the run's
        self.ep, self.t_epoch = _Epoch(), time.monotonic()

    def _audit(self) -> dict:
        """What this server applied against what the finished workers say they pushed."""
        reported = sum((s for _, s in self.done.values()), np.zeros_like(self.applied_sum))
        counts_ok = all(self.applied_by[w] == pushes for w, (pushes, _) in self.done.items())
        diff = float(np.max(np.abs(reported - self.applied_sum), initial=0.0)) if not self.lost else None
        scale = float(np.max(np.abs(self.applied_sum), initial=1.0))
        ok = counts_ok and (diff is None or diff <= 1e-9 * max(1.0, scale))
        return {"ok": ok, "applied": int(self.applied_by.sum()), "diff": diff,
                "pushed": sum(p for p, _ in self.done.values())}

    def _finish(self) -> None:
        """Server 0, once every worker is done or lost: the last (partial)
        epoch's line, the audit of every shard, then the history to all."""
        if self.ep.pushes:  # the last epoch, with the pushes in flight at the stop; or where a loss ended it
            done = self.version >= self.ctx.total
            self._record(self.cfg.epochs if done else round(self.version / (self.ctx.spe * self.W), 3))
        audits = [self._audit()]
        for k in range(1, self.S):
            self.comm.Send(self.alive_buf, dest=k, tag=TAG_STOP)
            audits.append(_recv_object(self.comm, k, TAG_STOP, self.cfg.peer_timeout))
        last = self.history[-1]
        diffs = [a["diff"] for a in audits if a["diff"] is not None]
        last.update({"pushes_applied": audits[0]["applied"], "pushes_reported": audits[0]["pushed"],
                     "audit_max_diff": max(diffs) if diffs else None,
                     "staleness_mean_run": self.stale_all[0] / max(1, self.stale_all[1]),
                     "staleness_max_run": self.stale_all[2]})
        if not self.cfg.quiet:
            print(f"# train: {last['pushes_applied']} pushes applied, {last['pushes_reported']} reported pushed by "
                  f"the workers that finished, largest difference {last['audit_max_diff']}; staleness over the run "
                  f"mean {last['staleness_mean_run']:.2f}, max {last['staleness_max_run']}", flush=True)
        if not all(a["ok"] for a in audits):
            raise RuntimeError(f"lost update: the servers applied other gradients than the workers pushed {audits}")
        for d in [*range(1, self.S), *(self.S + w for w in range(self.W) if w not in self.lost)]:
            self.comm.send(self.history, dest=d, tag=TAG_FINAL)
        self.stopped = True

    def _final_history(self) -> list[dict]:
        if self.k == 0:
            return self.history
        return _recv_object(self.comm, 0, TAG_FINAL, self.cfg.peer_timeout)


# --- the worker ------------------------------------------------------------------

def _await(comm: MPI.Intracomm, reqs: list, peers: list[int], timeout: float, heard: dict) -> None:
    """Wait for ``reqs`` (``reqs[i]`` from ``peers[i]``), taking heartbeats;
    raise PeerLost when a peer waited on has been silent for ``timeout``."""
    status, buf = MPI.Status(), np.empty(8)
    start = time.monotonic()
    open_ = list(range(len(reqs)))
    while open_:
        open_ = [i for i in open_ if not reqs[i].Test()]
        if not open_:
            return
        while comm.Iprobe(MPI.ANY_SOURCE, TAG_ALIVE, status):
            comm.Recv(buf, source=status.Get_source(), tag=TAG_ALIVE)
            heard[status.Get_source()] = time.monotonic()
        now = time.monotonic()
        for i in open_:
            if now - max(start, heard.get(peers[i], start)) > timeout:
                raise PeerLost(f"server rank {peers[i]} sent nothing for {timeout:g} s: presumed lost")
        time.sleep(IDLE_S)


def _recv_object(comm: MPI.Intracomm, source: int, tag: int, timeout: float):
    status, buf, heard = MPI.Status(), np.empty(8), {source: time.monotonic()}
    while not comm.Iprobe(source, tag, status):
        if comm.Iprobe(source, TAG_ALIVE, status):
            comm.Recv(buf, source=source, tag=TAG_ALIVE)
            heard[source] = time.monotonic()
        elif time.monotonic() - heard[source] > timeout:
            raise PeerLost(f"server rank {source} sent nothing for {timeout:g} s: presumed lost")
        else:
            time.sleep(IDLE_S)
    return comm.recv(source=source, tag=tag)


class _Worker:
    def __init__(self, ctx: _Ctx):
        self.ctx, self.cfg, self.comm = ctx, ctx.cfg, ctx.comm
        self.w, self.S, self.W = ctx.rank - ctx.servers, ctx.servers, ctx.workers
        sizes = [ctx.bounds[k + 1] - ctx.bounds[k] for k in range(self.S)]
        self.inbuf = [np.empty(HDR + 4 * m, np.uint8) for m in sizes]
        self.outbuf = [np.empty(HDR + 4 * m, np.uint8) for m in sizes]
        self.outreq = [MPI.REQUEST_NULL] * self.S
        self.ask = np.zeros(8)
        self.grad = np.empty(ctx.flat.numel(), np.float32)
        self.pushed_sum = np.zeros(ctx.flat.numel(), np.float64)
        self.heard = {}
        self.straggler = Straggler(ctx.cfg.straggler, ctx.rank, ctx.comm.Get_size())

    def run(self) -> list[dict]:
        ctx, cfg, comm, S = self.ctx, self.cfg, self.comm, self.S
        flat = ctx.flat.numpy()
        pushes, clock, epoch, stop = 0, 0, 0, False
        # Until a server says stop (it has applied the run's pushes, from whichever workers: a fast worker
        # goes on into its next epoch's batches); in fixed-delay mode, exactly this worker's share.
        while not stop and (cfg.fixed_delay is None or epoch < cfg.epochs):
            batches = rank_batches(len(ctx.ds.train), cfg.batch_per_rank, self.w, self.W, epoch, cfg.seed)
            for t in range(ctx.spe):
                index = clock * self.W + self.w
                wanted = max(0, index - cfg.fixed_delay) if cfg.fixed_delay is not None else -1
                reqs = [comm.Irecv(self.inbuf[k], source=k, tag=TAG_PARAMS) for k in range(S)]
                self.ask[:2] = clock, wanted
                for k in range(S):
                    comm.Send(self.ask, dest=k, tag=TAG_PULL)
                _await(comm, reqs, list(range(S)), cfg.peer_timeout, self.heard)
                heads = [self.inbuf[k][:HDR].view(np.float64) for k in range(S)]
                if any(h[1] for h in heads):
                    stop = True
                    break
                for k in range(S):
                    flat[ctx.shard(k)] = self.inbuf[k][HDR:].view(np.float32)
                loss, correct, samples, secs = compute_step(ctx.model, ctx.ds, batches[t])
                self.straggler(secs)
                grad_vector(ctx.model, self.grad)
                self.pushed_sum += self.grad
                _await(comm, self.outreq, list(range(S)), cfg.peer_timeout, self.heard)
                for k in range(S):
                    buf = self.outbuf[k]
                    buf[:HDR].view(np.float64)[:6] = heads[k][0], epoch, index, loss, correct, samples
                    buf[HDR:].view(np.float32)[:] = self.grad[ctx.shard(k)]
                    self.outreq[k] = comm.Isend(buf, dest=k, tag=TAG_PUSH)
                pushes, clock = pushes + 1, clock + 1
                _die_if_told(comm.Get_rank(), pushes)
            epoch += 1
        _await(comm, self.outreq, list(range(S)), cfg.peer_timeout, self.heard)
        done = []
        for k in range(S):
            sl = ctx.shard(k)
            buf = np.empty(HDR + 8 * (sl.stop - sl.start), np.uint8)
            buf[:HDR].view(np.float64)[0] = pushes
            buf[HDR:].view(np.float64)[:] = self.pushed_sum[sl]
            done.append(buf)
            self.outreq[k] = comm.Isend(buf, dest=k, tag=TAG_DONE)
        _await(comm, self.outreq, list(range(S)), cfg.peer_timeout, self.heard)
        return _recv_object(comm, 0, TAG_FINAL, cfg.peer_timeout)


# --- the single-process reference ---------------------------------------------------

def reference_fixed_delay(cfg: TrainConfig, workers: int) -> np.ndarray:
    """The parameters ``train_async`` ends with in fixed-delay mode with
    ``workers`` workers, computed in this process: update i is the gradient
    of worker i % W's batch on the parameters of version max(0, i - k)."""
    ds = load_dataset(cfg.dataset, comm=None, data_dir=cfg.data_dir, num_samples=cfg.num_samples,
                      seed=cfg.data_seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, width=cfg.width)
    flat = flatten(model).numpy()
    params = flat.copy()  # the server's vector; ``flat`` is what the gradient is computed on
    update, kept = ShardUpdate(cfg, params), {0: params.copy()}
    spe = steps_per_epoch(len(ds.train), cfg.batch_per_rank * workers)
    schedule, grad, version = cfg.schedule(1), np.empty_like(flat), 0
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
