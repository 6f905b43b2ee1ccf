"""What the parameter server's ranks share (``train --mode async``, and
asynchronous EASGD): the message tags and header, the run's context, a
shard's update rule, the tests' fault switches, and waiting on a peer with
heartbeats. :mod:`~hpcjobs.training.paramserver` starts the run;
:mod:`~hpcjobs.training.ps_server`, :mod:`~hpcjobs.training.ps_worker` and
:mod:`~hpcjobs.training.ps_checkpoint` are its ranks' parts."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import numpy as np
import torch
from mpi4py import MPI

from . import schedule as sched
from .config import TrainConfig
from .data import Dataset

T = TypeVar("T")

__all__ = ["PeerLost", "ShardUpdate", "shard_bounds", "Ctx", "Beats", "await_peers", "recv_object", "die_if_told"]

HDR = 64  # bytes of float64 header at the front of every message
TAG_PULL, TAG_PARAMS, TAG_PUSH, TAG_DONE, TAG_SNAP, TAG_SHARD, TAG_STOP, TAG_FINAL, TAG_ALIVE = range(7101, 7110)
TAG_PAUSE, TAG_CKPT, TAG_GO = range(7110, 7113)  # checkpoints (ps_checkpoint.py): paused, a server's state, go on
IDLE_S = 2e-4  # a server's nap when no message waits: it leaves the cores to the workers
FAULT_ENV = "HPCJOBS_FAULT_KILL"  # "RANK:COUNT": that rank SIGKILLs itself after COUNT pushes, 0 too (tests)
# "RANK:VERSION:SECONDS": server RANK, at that version, answers no pull for SECONDS (it still hears and
# heartbeats) -- the tests' stand-in for a pull held behind a slow or lost worker, on one server only
HOLD_ENV = "HPCJOBS_FAULT_HOLD"
SLOW_TEST_ENV = "HPCJOBS_FAULT_SLOW_TEST"  # "SECONDS": server 0 takes that much longer over each test batch (tests)


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

    def apply(self, g: np.ndarray, lr: float, share: float = 1.0) -> None:
        """One push of ``g`` at rate ``lr``; ``share``: the weight of this
        gradient alone (staleness-aware: 1/τ, Zhang et al. 2016). With
        momentum the gradient enters the buffer at that weight, so a stale
        one is damped and the fresh ones already in the buffer are not."""
        if self.wd:
            g = g + self.wd * self.p
        if self.adagrad:
            self.state += g * g
            self.p -= np.float32(lr * share) * g / (np.sqrt(self.state) + np.float32(1e-10))
        elif self.mu:
            self.state *= self.mu
            self.state += g if share == 1.0 else np.float32(share) * g
            self.p -= np.float32(lr) * self.state
        else:
            self.p -= np.float32(lr * share) * g


@dataclass
class Ctx:
    """One run as each of its ranks sees it: the config, communicator and
    layout (S servers, then W workers), the data, the model and its flat
    parameter vector, the shards' bounds, a worker's steps per epoch and the
    schedule (paramserver._setup makes it)."""

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
    def elastic(self) -> bool:  # asynchronous EASGD: pushes are elastic moves e, applied as center += e
        return self.cfg.mode == "easgd"

    @property
    def alpha(self) -> float:
        return self.cfg.moving_rate(self.workers)

    @property
    def steps_per_push(self) -> int:  # a worker's SGD steps per push
        return self.cfg.local_steps if self.elastic else 1

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    def shard(self, k: int) -> slice:
        return slice(self.bounds[k], self.bounds[k + 1])

    def elastic_step(self, moves: int) -> int:
        """The schedule's step after ``moves`` elastic moves: the run's progress in a worker's steps,
        the clock every elastic worker steps by (ps_worker.Worker._run_elastic)."""
        return moves * self.steps_per_push // self.workers

    def lr(self, version: int) -> float:
        if self.elastic:
            return sched.lr_at(self.elastic_step(version), self.spe, self.schedule)
        return sched.lr_at(version, self.spe * self.workers, self.schedule)  # an epoch is spe * W pushes

    def epochs_done(self, version: int) -> int:
        return version * self.steps_per_push // (self.spe * self.workers)

    @property
    def total(self) -> int:  # the pushes of the run: the epochs' samples, from whichever workers
        return self.cfg.epochs * self.spe * self.workers // self.steps_per_push


def die_if_told(rank: int, count: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{count}":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


# --- waiting on a peer ------------------------------------------------------------------

class Beats:
    """Heartbeats (TAG_ALIVE) from a rank that waits or serves, at most one
    to each of ``dests()`` every ``period`` seconds (asked only when due:
    a server calls this on every turn of its loop)."""

    def __init__(self, comm: MPI.Intracomm, period: float, dests: Callable[[], Iterable[int]]):
        self.comm, self.period, self.dests = comm, period, dests
        self.buf, self.reqs, self.next = np.zeros(8), [], 0.0

    def __call__(self, now: float) -> None:
        if now < self.next:
            return
        self.next = now + self.period
        self.reqs = [r for r in self.reqs if not r.Test()]
        self.reqs += [self.comm.Isend(self.buf, dest=d, tag=TAG_ALIVE) for d in self.dests()]

    def during(self, fn: Callable[[], T]) -> T:
        """``fn()``, in a thread, while this thread sends these heartbeats:
        for a rank busy outside its loop (server 0 writing a checkpoint, which
        may take longer than ``--peer-timeout``), so the ranks waiting for it
        do not take it for dead. MPI stays on the calling thread (any thread
        level does); ``fn`` must make no MPI call. Its exception is raised here."""
        out: dict = {}

        def run() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # noqa: BLE001 -- raised on the calling thread below
                out["error"] = e

        thread = threading.Thread(target=run, name="hpcjobs-busy", daemon=True)
        thread.start()
        while thread.is_alive():
            self(time.monotonic())
            thread.join(min(self.period / 4, 0.25))
        if "error" in out:
            raise out["error"]
        return out["value"]


def await_peers(comm: MPI.Intracomm, reqs: list, peers: list[int], timeout: float, heard: dict,
                beat: Callable[[float], None] | None = None) -> None:
    """Wait for ``reqs`` (``reqs[i]`` from ``peers[i]``), taking heartbeats
    and, with ``beat``, sending them (a worker: a server that answered its
    pull must not take its wait on another for its death); raise PeerLost
    when a peer waited on has been silent for ``timeout``."""
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
        if beat is not None:
            beat(now)
        for i in open_:
            if now - max(start, heard.get(peers[i], start)) > timeout:
                raise PeerLost(f"server rank {peers[i]} sent nothing for {timeout:g} s: presumed lost")
        time.sleep(IDLE_S)


def recv_object(comm: MPI.Intracomm, source: int, tag: int, timeout: float,
                beat: Callable[[float], None] | None = None):
    """A pickled object from ``source``, taking its heartbeats and, with ``beat``, sending ours."""
    status, buf, heard = MPI.Status(), np.empty(8), {source: time.monotonic()}
    while not comm.Iprobe(source, tag, status):
        if beat is not None:
            beat(time.monotonic())
        if comm.Iprobe(source, TAG_ALIVE, status):
            comm.Recv(buf, source=source, tag=TAG_ALIVE)
            heard[source] = time.monotonic()
        elif time.monotonic() - heard[source] > timeout:
            raise PeerLost(f"server rank {source} sent nothing for {timeout:g} s: presumed lost")
        else:
            time.sleep(IDLE_S)
    return comm.recv(source=source, tag=tag)
