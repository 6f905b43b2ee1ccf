"""A parameter server's worker (:mod:`hpcjobs.training.paramserver`): pull
every shard, compute a gradient on the next batch, push each server its
slice, without a barrier, until a server says stop."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .data import rank_batches
from .paramserver import (HDR, TAG_DONE, TAG_FINAL, TAG_PARAMS, TAG_PULL, TAG_PUSH, _await, _Ctx, _die_if_told,
                          _recv_object)
from .stepping import Straggler, compute_step, grad_vector

__all__ = ["Worker"]


class Worker:
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
