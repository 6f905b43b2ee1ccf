"""A parameter server's worker (:mod:`hpcjobs.training.paramserver`): pull
every shard, compute a gradient on the next batch, push each server its
slice, without a barrier, until a server says stop. In asynchronous EASGD
the servers hold the center and the pushes are elastic steps."""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from . import schedule as sched
from .data import rank_batches
from . import ps_checkpoint
from .optimizers import make_optimizer
from .preempt import Noted
from .ps_common import (HDR, TAG_CKPT, TAG_DONE, TAG_FINAL, TAG_GO, TAG_PARAMS, TAG_PAUSE, TAG_PULL, TAG_PUSH,
                        Beats, await_peers, Ctx, die_if_told, recv_object)
from .stepping import Straggler, compute_step, grad_vector

__all__ = ["Worker"]


class Worker:
    def __init__(self, ctx: Ctx, mine: dict | None = None):
        self.ctx, self.cfg, self.comm = ctx, ctx.cfg, ctx.comm
        self.w, self.S, self.W = ctx.rank - ctx.servers, ctx.servers, ctx.workers
        sizes = [ctx.bounds[k + 1] - ctx.bounds[k] for k in range(self.S)]
        self.inbuf = [np.empty(HDR + 4 * m, np.uint8) for m in sizes]
        self.outbuf = [np.empty(HDR + 4 * m, np.uint8) for m in sizes]
        self.outreq = [MPI.REQUEST_NULL] * self.S
        self.ask = np.zeros(8)
        self.grad = np.empty(ctx.flat.numel(), np.float32)
        self.pushed_sum = np.zeros(ctx.flat.numel(), np.float64)
        self.pushed_count = mine["pushes"] if mine is not None else 0  # resumed: after that push
        self.start = self.pushed_count  # the audit's sums start here
        self.noted = Noted(False)  # run_async gives the rank's own
        self.heard = {}
        # While it waits (on one server's held pull, say) it tells every server it lives: the others, which
        # answered, would otherwise count the wait as its silence and find it lost
        self.beat = Beats(ctx.comm, ctx.cfg.peer_timeout / 4, lambda: range(self.S))
        self.straggler = Straggler(ctx.cfg.straggler, ctx.rank, ctx.comm.Get_size())
        self.clock = 0  # EASGD: the schedule's step this worker's next local step takes (_run_elastic)
        if ctx.elastic:  # this worker's own SGD between elastic moves
            self.opt = make_optimizer(ctx.cfg, ctx.model)
            if mine is not None:  # its own parameters (the center's where it was lost before), momentum, clock
                ctx.flat.copy_(mine["params"])
                if mine["optimizer"] is not None:
                    self.opt.load_state_dict(mine["optimizer"])
                self.clock = int(mine["clock"])

    def run(self) -> list[dict]:
        die_if_told(self.comm.Get_rank(), 0)  # the fault tests: a worker lost before its first push
        if self.ctx.elastic:
            self._run_elastic()
        else:
            self._run_gradients()
        return self._finish(self.pushed_count)

    def _run_gradients(self) -> None:
        """Downpour: pull, a gradient on the next batch, push."""
        ctx, cfg = self.ctx, self.cfg
        flat = ctx.flat.numpy()
        epoch, start = divmod(self.pushed_count, ctx.spe)  # where a resumed run goes on
        # Until a server says stop (it has applied the run's pushes, from whichever workers: a fast worker
        # goes on into its next epoch's batches); in fixed-delay mode, exactly this worker's share.
        while cfg.fixed_delay is None or epoch < cfg.epochs:
            batches = rank_batches(len(ctx.ds.train), cfg.batch_per_rank, self.w, self.W, epoch, cfg.seed)
            for t in range(start, ctx.spe):
                clock = self.pushed_count
                index = clock * self.W + self.w
                wanted = max(0, index - cfg.fixed_delay) if cfg.fixed_delay is not None else -1
                heads = self._pull(clock, wanted)
                if heads is None:
                    return
                for k in range(self.S):
                    flat[ctx.shard(k)] = self.inbuf[k][HDR:].view(np.float32)
                loss, correct, samples, secs = compute_step(ctx.model, ctx.ds, batches[t])
                self.straggler(secs)
                self._push(heads, epoch, index, (loss, correct, samples), grad_vector(ctx.model, self.grad))
                if ps_checkpoint.due(ctx, self.pushed_count):
                    self._pause()
            epoch, start = epoch + 1, 0

    def _run_elastic(self) -> None:
        """Asynchronous EASGD: H steps of this worker's own SGD, then pull the
        center x~, step e = a (x - x~) toward it and push e.

        The learning rate follows the run's progress, not this worker's own
        steps: at each pull the schedule's step becomes the moves applied so far,
        and the one it is about to push, times H / W (a worker's steps, were all
        equally fast); it then counts this worker's steps until the next pull.
        On its own count a slow worker would still step at a high rate while the
        others had decayed to the final one, and its moves would pull the center
        off (docs/results/async.md, "EASGD's asynchronous form")."""
        ctx, cfg, opt = self.ctx, self.cfg, self.opt
        flat = ctx.flat.numpy()
        step, sums = self.pushed_count * cfg.local_steps, np.zeros(3)  # resumed: after its step c x H
        epoch, start = divmod(step, ctx.spe)
        while True:
            batches = rank_batches(len(ctx.ds.train), cfg.batch_per_rank, self.w, self.W, epoch, cfg.seed)
            for t in range(start, ctx.spe):
                loss, correct, samples, secs = compute_step(ctx.model, ctx.ds, batches[t])
                self.straggler(secs)
                sched.set_lr(opt, sched.lr_at(self.clock, ctx.spe, ctx.schedule),
                             momentum_correction=cfg.momentum_correction)
                opt.step()
                step, self.clock, sums = step + 1, self.clock + 1, sums + (loss, correct, samples)
                if step % cfg.local_steps:
                    self._between_steps()
                    continue
                heads = self._pull(self.pushed_count, -1)
                if heads is None:
                    return
                self.clock = ctx.elastic_step(int(heads[0][0]) + 1)  # the moves applied, and this one
                for k in range(self.S):
                    sl = ctx.shard(k)
                    np.subtract(flat[sl], self.inbuf[k][HDR:].view(np.float32), out=self.grad[sl])
                self.grad *= np.float32(ctx.alpha)
                flat -= self.grad
                self._push(heads, epoch, self.pushed_count * self.W + self.w, sums, self.grad)
                sums = np.zeros(3)
                if ps_checkpoint.due(ctx, self.pushed_count):
                    self._pause()
            epoch, start = epoch + 1, 0

    def _pause(self) -> None:
        """A checkpoint's pause (ps_checkpoint.py): tell every server, after
        this worker's last push, and wait until server 0 says go on; raise
        Stopped where it says stop."""
        comm, cfg = self.comm, self.cfg
        await_peers(comm, self.outreq, list(range(self.S)), cfg.peer_timeout, self.heard, self.beat)
        if self.ctx.elastic:  # its own state to server 0, before the marker (one sender's messages stay in order)
            sent = ps_checkpoint.isend_bytes(comm, ps_checkpoint.worker_state(self), 0, TAG_CKPT)
            die_if_told(comm.Get_rank(), f"state{self.pushed_count}")  # the fault tests: dead mid-send
        marker = np.zeros(8)
        marker[:2] = self.pushed_count, self.noted.signum
        for k in range(self.S):
            comm.Send(marker, dest=k, tag=TAG_PAUSE)
        if self.ctx.elastic:
            await_peers(comm, [sent[0]], [0], cfg.peer_timeout, self.heard, self.beat)
        go = recv_object(comm, 0, TAG_GO, cfg.peer_timeout, beat=self.beat)
        if go["stop"]:
            raise ps_checkpoint.stopped(self.ctx, go)

    def _between_steps(self) -> None:
        """Between local steps: the last push moves on (a large one over TCP
        flows only while this rank calls MPI) and the servers hear from this
        worker, however long its H steps take."""
        MPI.Request.Testall(self.outreq)
        self.beat(time.monotonic())

    def _pull(self, clock: int, wanted: int):
        """Every server's shard into ``inbuf``; their headers, or None when a server says stop."""
        comm, S = self.comm, self.S
        reqs = [comm.Irecv(self.inbuf[k], source=k, tag=TAG_PARAMS) for k in range(S)]
        self.ask[:2] = clock, wanted
        for k in range(S):
            comm.Send(self.ask, dest=k, tag=TAG_PULL)
        await_peers(comm, reqs, list(range(S)), self.cfg.peer_timeout, self.heard, self.beat)
        heads = [self.inbuf[k][:HDR].view(np.float64) for k in range(S)]
        return None if any(h[1] for h in heads) else heads

    def _push(self, heads, epoch: int, index: int, stats, vec: np.ndarray) -> None:
        """Each server its slice of ``vec``, tagged with the version pulled."""
        comm, ctx = self.comm, self.ctx
        self.pushed_sum += vec
        await_peers(comm, self.outreq, list(range(self.S)), self.cfg.peer_timeout, self.heard, self.beat)
        for k in range(self.S):
            buf = self.outbuf[k]
            buf[:HDR].view(np.float64)[:6] = heads[k][0], epoch, index, *stats
            buf[HDR:].view(np.float32)[:] = vec[ctx.shard(k)]
            self.outreq[k] = comm.Isend(buf, dest=k, tag=TAG_PUSH)
        self.pushed_count += 1
        die_if_told(comm.Get_rank(), self.pushed_count)

    def _finish(self, pushes: int) -> list[dict]:
        """The audit's sums to every server, then the run's history from server 0."""
        ctx, cfg, comm, S = self.ctx, self.cfg, self.comm, self.S
        await_peers(comm, self.outreq, list(range(S)), cfg.peer_timeout, self.heard, self.beat)
        done = []
        for k in range(S):
            sl = ctx.shard(k)
            buf = np.empty(HDR + 8 * (sl.stop - sl.start), np.uint8)
            buf[:HDR].view(np.float64)[:3] = (pushes, self.opt.param_groups[0]["lr"] if ctx.elastic else np.nan,
                                              self.start)
            buf[HDR:].view(np.float64)[:] = self.pushed_sum[sl]
            done.append(buf)
            self.outreq[k] = comm.Isend(buf, dest=k, tag=TAG_DONE)
        await_peers(comm, self.outreq, list(range(S)), cfg.peer_timeout, self.heard, self.beat)
        history = recv_object(comm, 0, TAG_FINAL, cfg.peer_timeout)
        if isinstance(history, dict):  # a signal's stop at a pause of the others (this one was done)
            raise ps_checkpoint.stopped(ctx, history)
        return history
