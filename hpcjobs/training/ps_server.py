"""A parameter server's loop (:mod:`hpcjobs.training.paramserver` says
what it serves and why): answer pulls, apply pushes as they arrive, count
staleness, hold pulls back for a bound or a fixed delay, find lost workers,
and on server 0 test the model every epoch and end the run."""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import torch
from mpi4py import MPI

from .ps_common import (HDR, HOLD_ENV, IDLE_S, SLOW_TEST_ENV, TAG_ALIVE, TAG_CKPT, TAG_DONE, TAG_FINAL, TAG_GO,
                        TAG_PARAMS, TAG_PAUSE, TAG_PULL, TAG_PUSH, TAG_SHARD, TAG_SNAP, TAG_STOP, Beats, PeerLost,
                        ShardUpdate, await_peers, Ctx, die_if_told, recv_object)
from . import ps_checkpoint
from .preempt import Noted
from .stepping import amend_report, evaluate_local, finish_record, report

__all__ = ["Server"]


class _Epoch:
    def __init__(self):
        self.sums, self.stale_sum, self.stale_max, self.pushes = np.zeros(3), 0, 0, 0
        self.bytes_in, self.bytes_out = 0, 0


class Server:
    def __init__(self, ctx: Ctx, mine: dict | None = None):
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
        self.last_lr = np.full(self.W, np.nan)  # the rate of each elastic worker's last step (its TAG_DONE)
        self.ep, self.history, self.stopped, self.heard0 = _Epoch(), [], False, time.monotonic()
        self.stop_mask = None  # server k: the workers server 0 counted done when it said stop
        self.alive_buf = np.zeros(8)
        self.orphans = []  # (request, buffer) of receives given up on: freed, a late message would land in freed memory
        self._heartbeat = Beats(self.comm, self.cfg.peer_timeout / 4, lambda: [  # the live workers, the servers
            *(self.S + w for w in range(self.W) if w not in self.lost), *(k for k in range(self.S) if k != self.k)])
        self.hold, self.held_until = _hold_of(self.comm.Get_rank()), 0.0
        self.slow_test = float(os.environ.get(SLOW_TEST_ENV) or 0) if self.k == 0 else 0.0
        self.t0 = self.t_epoch = time.monotonic()
        self.stale_all = [0, 0, 0]  # sum, count, max over the run
        # checkpoints (ps_checkpoint.py): the workers paused (count, signal), the other servers' states (server 0)
        self.paused, self.states, self.state_sent, self.go, self.wall0, self.epoch0 = {}, {}, None, None, 0.0, 0.0
        self.noted = Noted(False)  # run_async gives the rank's own
        if mine is not None:
            ps_checkpoint.load_server(self, mine)
            self.history = list(mine.get("history", []))
        self.base = self.applied_by.copy()  # the audit's counts from the resume on (its sums start there)

    def run(self) -> list[dict]:
        status = MPI.Status()
        self.heard0 = now = time.monotonic()
        self.t0, self.t_epoch = now - self.wall0, now - self.epoch0  # a resumed run's wall and epoch times go on
        self.heard[:] = now
        self.heard_servers = dict.fromkeys(range(self.S), now)
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
            if self.stop_mask is not None and self._stop_ready():
                self.comm.send(self._audit(), dest=0, tag=TAG_STOP)
                self.stopped = True
                break
            if self.paused and self._all_paused():
                self._at_pause()
                if self.stopped:
                    break
            if self.orphans:
                self.orphans = [(r, b) for r, b in self.orphans if not r.Test()]
            if self.held_until and now >= self.held_until:
                self.held_until = 0.0
                self._answer_deferred()
            if self.k and now - self.heard0 > self.cfg.peer_timeout:
                raise PeerLost(f"server rank 0 sent nothing for {self.cfg.peer_timeout:g} s: presumed lost")
            time.sleep(IDLE_S)
        if self.go is not None:  # a signal's stop, after the checkpoint
            raise ps_checkpoint.stopped(self.ctx, self.go)
        return self._final_history()

    def _all_paused(self) -> bool:
        """Every live worker has paused, and every push it made is applied here."""
        live = [w for w in range(self.W) if w not in self.lost and w not in self.done]
        return bool(live) and all(w in self.paused for w in live) and not self.pending

    def _at_pause(self) -> None:
        ps_checkpoint.at_pause(self)

    def _go_on(self, go: dict) -> None:
        ps_checkpoint.go_on(self, go)

    def _all_in(self) -> bool:
        return len(self.done) + len(self.lost - set(self.done)) == self.W

    def _stop_ready(self) -> bool:
        """Server k, told to stop: every worker server 0 counted done has told
        this server so too (MPI orders no two senders' messages: a worker's
        DONE here can come after server 0's STOP), or is lost here."""
        return not self.pending and all(w in self.done or w in self.lost for w in np.flatnonzero(self.stop_mask))

    def _handle(self, src: int, tag: int, count: int) -> None:
        if count > self.inbuf.nbytes:  # server 0's stop names every worker: more than a shard's bytes at most
            self.inbuf = np.empty(count, np.uint8)
        req = self.comm.Irecv([self.inbuf, count, MPI.BYTE], source=src, tag=tag)
        deadline = time.monotonic() + self.cfg.peer_timeout
        while not req.Test():  # a large message flows only while its sender lives
            now = time.monotonic()
            if now > deadline:  # the stuck receive keeps the old buffer, both held while it may still land
                self.orphans.append((req, self.inbuf))
                self.inbuf = np.empty_like(self.inbuf)
                if src >= self.S:  # lost now, it alone (the others' messages waited unread meanwhile): a later
                    self._lose(src - self.S)  # message of its own would make it heard, its push or state missing
                return
            self._heartbeat(now)  # the others must not take this wait for a dead server
            time.sleep(IDLE_S)
        hdr = self.inbuf[:HDR].view(np.float64)
        if src < self.S:  # server 0 waits on the others' states at a pause: it must notice one that died
            self.heard_servers[src] = time.monotonic()
        if src == 0 and self.k:
            self.heard0 = time.monotonic()
        if tag == TAG_ALIVE:  # a server's, or a waiting worker's
            self._heard_worker(src, time.monotonic())
            return
        if tag == TAG_SNAP:
            out = np.empty(HDR + 4 * self.shard.size, np.uint8)
            # the version, and this shard's bytes since the last snapshot: server 0's epoch line counts every shard's
            out[:HDR].view(np.float64)[:3] = self.version, self.ep.bytes_in, self.ep.bytes_out
            self.ep.bytes_in = self.ep.bytes_out = 0
            out[HDR:].view(np.float32)[:] = self.shard
            self.comm.Send(out, dest=0, tag=TAG_SHARD)
            return
        if tag == TAG_STOP:  # the audit waits for the DONEs of the workers server 0 counted (_stop_ready)
            self.stop_mask = self.inbuf[:count].copy()
            return
        if tag == TAG_CKPT:  # server 0: a server's state at a pause, or an EASGD worker's (by rank)
            self.states[src] = pickle.loads(self.inbuf[:count].tobytes())
            return
        if tag == TAG_GO:  # server k: the checkpoint is written
            self._go_on(pickle.loads(self.inbuf[:count].tobytes()))
            return
        w = src - self.S
        if w in self.lost:
            return  # a worker declared lost that speaks again: its messages are dropped
        self.heard[w] = time.monotonic()
        if tag == TAG_PAUSE:  # after its last push, which is applied here by now: (pushes, a signal it noted)
            self.paused[w] = (int(hdr[0]), int(hdr[1]))
            return
        if tag != TAG_DONE:  # the audit's sums are not training traffic
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
            self.done[w] = (int(hdr[0]), self.inbuf[HDR:HDR + 8 * self.shard.size].view(np.float64).copy(),
                            int(hdr[2]))  # its pushes, their sum, and its count at the resume
            self.last_lr[w] = hdr[1]
        self._answer_deferred()

    def _apply(self, w: int, hdr: np.ndarray, grad: np.ndarray) -> None:
        staleness = self.version - int(hdr[0])
        if self.ctx.elastic:
            self.shard += grad  # the center moves by the worker's elastic step e
        else:
            # staleness-aware: this gradient at lr/τ (its weight in the momentum buffer, not the buffer's)
            share = 1.0 / max(1, staleness) if self.cfg.staleness_lr else 1.0
            self.update.apply(grad, self.ctx.lr(self.version), share)
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
        die_if_told(self.comm.Get_rank(), self.version)
        if self.hold and self.version == self.hold[0]:
            self.held_until = time.monotonic() + self.hold[1]
        epochs = self.ctx.epochs_done(self.version)
        if self.k == 0 and epochs > len(self.history) and self.version < self.ctx.total:
            self._record(epochs)

    def _ready(self, w: int, clock: int, wanted: int) -> bool:
        if self.held_until:
            return False
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
            # its silence starts now: a pull held past the peer timeout (behind a worker then found lost) is
            # not the worker's own, and counting it would find it lost too before its next push can arrive
            self.heard[w] = time.monotonic()
        self.deferred = still

    def _heard_worker(self, src: int, at: float) -> None:
        """Rank ``src`` was heard at ``at``: a worker not lost is not silent since."""
        if src >= self.S and src - self.S not in self.lost:
            self.heard[src - self.S] = max(self.heard[src - self.S], at)

    def _find_lost(self, now: float) -> None:
        waiting = {w for w, _, _ in self.deferred}  # silent because this server holds their pull
        for w in range(self.W):
            if w not in waiting and now - self.heard[w] > self.cfg.peer_timeout:
                self._lose(w)

    def _lose(self, w: int) -> None:
        """Worker ``w`` is lost (silent for the peer timeout): go on without it."""
        if w in self.done or w in self.lost:
            return
        if self.kept is not None:
            raise PeerLost(f"worker rank {self.S + w} sent nothing for {self.cfg.peer_timeout:g} s; "
                           "fixed-delay mode applies gradients in order and cannot go on without it")
        self.lost.add(w)
        if self.k == 0 and not self.cfg.quiet:
            print(f"# train: worker rank {self.S + w} lost (silent for {self.cfg.peer_timeout:g} s after "
                  f"{self.applied_by[w]} pushes); going on with the others", flush=True)
        self._answer_deferred()

    def _snapshot(self) -> None:
        """Server 0: the other servers' shards into the model, for testing,
        and their bytes moved since the last snapshot into this epoch's."""
        for k in range(1, self.S):
            sl = self.ctx.shard(k)
            buf = np.empty(HDR + 4 * (sl.stop - sl.start), np.uint8)
            req = self.comm.Irecv(buf, source=k, tag=TAG_SHARD)
            self.comm.Send(self.alive_buf, dest=k, tag=TAG_SNAP)
            heard = {k: time.monotonic()}
            await_peers(self.comm, [req], [k], self.cfg.peer_timeout, heard, beat=self._heartbeat)
            for src, at in heard.items():  # the workers' heartbeats it took meanwhile
                self._heard_worker(src, at)
            self.ctx.flat[sl] = torch.from_numpy(buf[HDR:].view(np.float32))
            self.ep.bytes_in += int(buf[:HDR].view(np.float64)[1])
            self.ep.bytes_out += int(buf[:HDR].view(np.float64)[2])

    def _record(self, epoch: float, show: bool = True) -> None:
        now, ep = time.monotonic(), self.ep  # the times leave out the test (the workers go on meanwhile)
        self._snapshot()
        test = evaluate_local(self.ctx.model, self.ctx.ds, between=self._between_test_batches)
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
        if show:
            report(self.cfg, record)
        self.t0 += time.monotonic() - now  # the test's seconds are not the run's
        self.ep, self.t_epoch = _Epoch(), time.monotonic()

    def _between_test_batches(self) -> None:
        """A test longer than the peer timeout must not be taken for a dead server 0:
        the other servers and the workers waiting on it hear from it between batches."""
        if self.slow_test:
            time.sleep(self.slow_test)
        self._heartbeat(time.monotonic())

    def _audit(self) -> dict:
        """What this server applied against what the finished workers say they pushed."""
        reported = sum((s for _, s, _ in self.done.values()), np.zeros_like(self.applied_sum))
        # since the resume (both sums start there; every worker resumes at one count, one lost before too)
        counts_ok = all(self.applied_by[w] - self.base[w] == pushes - start
                        for w, (pushes, _, start) in self.done.items())
        diff = float(np.max(np.abs(reported - self.applied_sum), initial=0.0)) if not self.lost else None
        scale = float(np.max(np.abs(self.applied_sum), initial=1.0))
        ok = counts_ok and (diff is None or diff <= 1e-9 * max(1.0, scale))
        return {"ok": ok, "applied": int(self.applied_by.sum()), "diff": diff,
                "pushed": int(self.base.sum()) + sum(p - start for p, _, start in self.done.values())}

    def _finish(self) -> None:
        """Server 0, once every worker is done or lost: the last (partial)
        epoch's line, the audit of every shard, then the history to all."""
        held = bool(self.ep.pushes)
        if held:  # the last epoch, with the pushes in flight at the stop; or where a loss ended it
            done = self.version >= self.ctx.total
            per_epoch = self.ctx.spe * self.W / self.ctx.steps_per_push
            self._record(self.cfg.epochs if done else round(self.version / per_epoch, 3), show=False)
        audits = [self._audit()]
        finished = np.zeros(self.W, np.uint8)
        finished[list(self.done)] = 1
        for k in range(1, self.S):
            self.comm.Send(finished, dest=k, tag=TAG_STOP)
            audits.append(recv_object(self.comm, k, TAG_STOP, self.cfg.peer_timeout, beat=self._heartbeat))
        if not self.history:  # no push was ever applied: no epoch line to end with. Exits 3, as a lost peer
            # does (MPI_Abort's code is lost under mpirun --enable-recovery: it exited 0)
            raise PeerLost(f"every worker was lost before a push was applied (workers lost: "
                               f"{', '.join(str(self.S + w) for w in sorted(self.lost)) or 'none'}): nothing trained")
        last = self.history[-1]
        diffs = [a["diff"] for a in audits if a["diff"] is not None]
        last.update({"pushes_applied": audits[0]["applied"], "pushes_reported": audits[0]["pushed"],
                     "audit_max_diff": max(diffs) if diffs else None,
                     "staleness_mean_run": self.stale_all[0] / max(1, self.stale_all[1]),
                     "staleness_max_run": self.stale_all[2],
                     "pushes_by_worker": [int(n) for n in self.applied_by]})
        rates = ""
        if self.ctx.elastic:  # the rate each worker last stepped with (None: lost)
            last["lr_by_worker"] = [None if np.isnan(r) else float(r) for r in self.last_lr]
            rates = "; last rate by worker " + ", ".join("-" if np.isnan(r) else f"{r:.3g}" for r in self.last_lr)
        if held:  # its line, the audit included
            report(self.cfg, last)
        else:  # every worker stopped at an epoch's end, whose line is written: the audit goes into it
            if self.lost:  # and the workers lost since
                last["lost_workers"] = ",".join(str(self.S + w) for w in sorted(self.lost))
            amend_report(self.cfg, last)
        if not self.cfg.quiet:
            print(f"# train: {last['pushes_applied']} pushes applied, {last['pushes_reported']} reported pushed by "
                  f"the workers that finished, largest difference {last['audit_max_diff']}; staleness over the run "
                  f"mean {last['staleness_mean_run']:.2f}, max {last['staleness_max_run']}; pushes by worker "
                  f"{', '.join(map(str, last['pushes_by_worker']))}{rates}", flush=True)
        if not all(a["ok"] for a in audits):
            raise RuntimeError(f"lost update: the servers applied other gradients than the workers pushed {audits}")
        for d in [*range(1, self.S), *(self.S + w for w in range(self.W) if w not in self.lost)]:
            self.comm.send(self.history, dest=d, tag=TAG_FINAL)
        self.stopped = True

    def _final_history(self) -> list[dict]:
        if self.k == 0:
            return self.history
        return recv_object(self.comm, 0, TAG_FINAL, self.cfg.peer_timeout)


def _hold_of(rank: int) -> tuple[int, float] | None:
    """(version, seconds) of :data:`~hpcjobs.training.ps_common.HOLD_ENV` for server ``rank``, or None."""
    spec = os.environ.get(HOLD_ENV, "").split(":")
    return (int(spec[1]), float(spec[2])) if len(spec) == 3 and spec[0] == str(rank) else None
