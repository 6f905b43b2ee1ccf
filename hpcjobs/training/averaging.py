"""Averaging models instead of gradients, and Hogwild!: ``hpcjobs train
--mode local|easgd|hogwild``.

- **local** (local SGD; Lin et al. 2020, "Don't use large mini-batches, use
  local SGD"): every rank takes ``local_steps`` (H) SGD steps on its own
  batches with its own momentum, then the parameters are averaged with our
  allreduce. H = 1 is synchronous SGD (averaging the parameters after one
  step averages the step); ``post_local_epochs`` E averages after every
  step for the first E epochs, then every H (post-local SGD).
  ``average_momentum`` averages the momentum buffers in the same allreduce
  (the momentum local SGD of Yu, Jin, Yang 2019): twice the bytes; without it each rank
  keeps its own, as in Lin et al.
- **easgd** (elastic averaging SGD, synchronous form; Zhang, Choromanska,
  LeCun 2015): each rank keeps a copy of a center variable x~; every
  ``local_steps`` steps, with the sum of the ranks' parameters from one
  allreduce, x_i <- x_i - a (x_i - x~) and x~ <- x~ + a (sum_i x_i - W x~).
  The moving rate a defaults to 0.9 / W (their beta = W a = 0.9). The
  center is what is tested.
- **hogwild** (Niu et al. 2011): the parameters live once, in rank 0's
  segment of an MPI shared-memory window that every rank maps (so one
  node; the suite's symmetric buffers give each rank its own); each
  rank computes gradients on them as they are and subtracts its (momentum)
  step in place without a lock; ``hogwild_lock`` takes an exclusive MPI
  window lock around each update instead, the baseline Hogwild! drops.

The rate: local and easgd steps follow the synchronous schedule for the
global batch W x b (so H = 1 reproduces it); Hogwild! applies W updates of
b samples where synchronous SGD applies one of W x b, so its rate is the
schedule's for b samples, its warmup starting at sync's first rate per
sample (as for the parameter server).

Checkpoints (``checkpoint``, ``checkpoint_every``, ``resume``): written as
sync's are (:mod:`hpcjobs.training.checkpoint`, the same format), after
every epoch, every ``checkpoint_every`` steps, and at the next step after a
SIGTERM or SIGUSR1 (:mod:`hpcjobs.training.preempt`; then the run stops).
Between averages each rank's parameters differ, so each rank's own
parameters, momentum buffers and steps since the last average (EASGD's
center too) are saved and come back on resume. Hogwild!'s one vector is
the checkpoint's model, written once every rank's update of that step is in
and before any rank makes the next; each rank's momentum (and, with the
lock, rank 0's count of updates) are its own state.
"""

from __future__ import annotations

import contextlib
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from . import checkpoint, schedule as sched
from ..collectives.counting import counted_allreduce
from ..collectives.watchdog import guard
from .config import TrainConfig
from .data import load_dataset_of, rank_batches, steps_per_epoch
from .models import build_model
from .optimizers import make_optimizer
from .preempt import Stopped, StopSignals
from .stepping import Progress, Straggler, compute_step, evaluate, finish_record, flatten, grad_vector, report

__all__ = ["PeriodError", "check_periods", "train_averaging"]


def train_averaging(cfg: TrainConfig, comm: MPI.Intracomm) -> list[dict]:
    """Run ``cfg`` (mode local, easgd or hogwild) on every rank of ``comm``;
    returns the per-epoch records (the same list on every rank)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    straggler = Straggler(cfg.straggler, rank, size)
    ds = load_dataset_of(cfg, comm)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, width=cfg.width)
    spe = steps_per_epoch(len(ds.train), cfg.batch_per_rank * size)
    check_periods(cfg, size, spe)
    if cfg.mode == "local" and cfg.post_local_epochs >= cfg.epochs and rank == 0 and not cfg.quiet:
        # all of it post-local SGD's warm-up: said, not refused (a run may be resumed with more epochs)
        print(f"# train: warning: post_local_epochs {cfg.post_local_epochs} of a run of {cfg.epochs} epoch(s): it "
              f"averages after every step throughout, and local_steps {cfg.local_steps} applies only after epoch "
              f"{cfg.post_local_epochs}", file=sys.stderr, flush=True)
    if cfg.mode == "hogwild":
        return _hogwild(cfg, comm, ds, model, spe, straggler)
    flat = flatten(model)
    comm.Bcast(flat.numpy(), root=0)
    return _Averaging(cfg, comm, ds, model, flat, spe, straggler).run()


class PeriodError(ValueError):
    """A period or rate an averaging mode cannot train with: ``problem``,
    and ``remedy`` in ``hpcjobs train``'s flags; ``too_short``: the run
    ends before the period does (a longer run mends it)."""

    def __init__(self, problem: str, remedy: str, too_short: bool):
        super().__init__(f"{problem}; {remedy}")
        self.problem, self.remedy, self.too_short = problem, remedy, too_short


def check_periods(cfg: TrainConfig, W: int, spe: int) -> None:
    """:class:`PeriodError`, alike on every rank, for periods and rates the
    averaging modes cannot train with (``W`` ranks, ``spe`` steps per epoch)."""
    if cfg.mode in ("local", "easgd") and cfg.epochs * spe < cfg.local_steps and not cfg.post_local_epochs:
        what = "average" if cfg.mode == "local" else "elastic move"
        raise PeriodError(f"mode {cfg.mode}: {cfg.epochs} epoch(s) of {spe} steps make no {what} every "
                          f"{cfg.local_steps} steps", "train longer or lower --local-steps", True)
    if cfg.mode == "easgd":
        # Each move multiplies the gap between the ranks' mean and the center by 1 - (W + 1) a (module
        # docstring): past 2 / (W + 1) it grows at every move (the asynchronous form needs only a < 1).
        alpha, bound = cfg.moving_rate(W), 2 / (W + 1)
        if alpha >= bound:
            raise PeriodError(f"mode easgd with {W} ranks: moving rate {alpha:g} multiplies the gap between the "
                              f"center and the ranks' mean by {1 - (W + 1) * alpha:.3g} at each move, so it grows",
                              f"give --elastic-alpha below 2/(W+1) = {bound:.4g} (default 0.9/W = {0.9 / W:.4g})",
                              False)


class _NoOptimizer:
    """Hogwild!'s place for the optimizer a checkpoint holds (rank 0's): it
    applies its steps itself, and each rank's momentum is its own state."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"a Hogwild! checkpoint holds no optimizer state, this one has {sorted(state)}")


def _hogwild(cfg, comm, ds, model, spe, straggler) -> list[dict]:
    """One copy of the parameters, in rank 0's segment of a shared window that every rank maps."""
    from ..collectives._shared import allocate_shared, free_window, is_single_node

    if not is_single_node(comm):
        raise ValueError("mode hogwild shares the parameters in one node's memory: run every rank on one node")
    n = sum(p.numel() for p in model.parameters())
    win = allocate_shared(4 * n if comm.Get_rank() == 0 else 0, comm)  # locked for passive access
    with _free_if_all_ended(comm, lambda: free_window(win)):
        mem, _ = win.Shared_query(0)
        shared = torch.from_numpy(np.frombuffer(mem, dtype=np.float32, count=n))
        flatten(model, into=shared, fill=comm.Get_rank() == 0)
        win.Sync()
        comm.Barrier()
        return _Averaging(cfg, comm, ds, model, shared, spe, straggler, win).run()


@contextlib.contextmanager
def _free_if_all_ended(comm, free):
    """``free()`` -- collective: a window's -- after the block, where it
    ended without an error or this rank is alone. A rank that failed must
    not free: it would wait there for ranks going on without it, and the job
    would never reach its Abort (modes.py)."""
    ended = False
    try:
        yield
        ended = True
    finally:
        if ended or comm.Get_size() == 1:
            free()


class _Averaging:
    def __init__(self, cfg, comm, ds, model, flat, spe, straggler, win=None):
        self.cfg, self.comm, self.ds, self.model, self.flat, self.spe = cfg, comm, ds, model, flat, spe
        self.straggler, self.W = straggler, comm.Get_size()
        self.hogwild, self.win = cfg.mode == "hogwild", win
        self.schedule = cfg.mode_schedule(self.W)
        self.opt = _NoOptimizer() if self.hogwild else make_optimizer(cfg, model)
        self.alpha = cfg.moving_rate(self.W)
        self.center = flat.clone() if cfg.mode == "easgd" else None
        # hogwild_lock: an exclusive lock on rank 0's counter of updates, held from a fetch-and-add on it
        # (flushed: an implementation may take a lock only at the first access) until the update is in
        self.lock = MPI.Win.Allocate(8 if comm.Get_rank() == 0 else 0, 8, comm=comm) if cfg.hogwild_lock else None
        self.one, self.before = np.ones(1, np.int64), np.zeros(1, np.int64)
        if self.lock is not None:  # MPI leaves the memory as it found it: the counter starts at 0
            if comm.Get_rank() == 0:
                self.lock.Lock(0, MPI.LOCK_EXCLUSIVE)
                self.lock.Put(np.zeros(1, np.int64), 0)
                self.lock.Unlock(0)
            comm.Barrier()
        self.grad = np.empty(flat.numel(), np.float32)
        self.momentum = np.zeros(flat.numel(), np.float32)
        # local with average_momentum: the parameters and the momentum buffers, averaged in one allreduce
        self.both = np.empty(2 * flat.numel(), np.float32) if cfg.average_momentum else None

    def run(self) -> list[dict]:
        """The epochs; with a checkpoint, resumed from it, and stopped after
        one written at a SIGTERM or SIGUSR1 (preempt.py)."""
        comm = self.comm
        history, at, mine = self._resume()
        if self.win is not None:
            self.win.Sync()  # rank 0 loaded the shared vector: every rank sees it after the barrier
        comm.Barrier()
        stop = StopSignals(comm, bool(self.cfg.checkpoint))
        try:
            with _free_if_all_ended(comm, stop.close):  # handlers given back, also when stopped
                with _free_if_all_ended(comm, self.lock.Free if self.lock is not None else lambda: None):
                    ended = self._epochs(history, at, mine, stop)
        finally:
            stop.restore()  # after an error too, where close (collective) is not called
        if isinstance(ended, Stopped):
            raise ended  # on every rank alike, after the checkpoint
        return history

    def _epochs(self, history: list[dict], at: tuple[int, int], mine: dict, stop: StopSignals) -> Stopped | None:
        cfg, comm = self.cfg, self.comm
        since, wall, partial = mine.get("since", 0), mine.get("wall", 0.0), mine.get("partial")
        step = at[0] * self.spe + at[1]
        progress = Progress(cfg.progress and comm.Get_rank() == 0 and not cfg.quiet)  # rank 0's own loss
        for epoch in range(at[0], cfg.epochs):
            idx = rank_batches(len(self.ds.train), cfg.batch_per_rank, comm.Get_rank(), self.W, epoch, cfg.seed)
            sums, sent, t_epoch = np.zeros(3), 0, time.monotonic()
            if partial:  # a mid-epoch checkpoint's share of this epoch
                sums, sent, t_epoch = np.array(partial["sums"]), partial["sent"], t_epoch - partial["epoch_s"]
            for t in range(at[1] if partial else 0, self.spe):
                loss, correct, n, secs = compute_step(self.model, self.ds, idx[t])
                self.straggler(secs)
                sums += loss, correct, n
                self._step(step)
                step, since = step + 1, since + 1
                period = 1 if epoch < cfg.post_local_epochs else cfg.local_steps
                if not self.hogwild and since >= period:
                    sent += self._average()
                    since = 0
                progress.update(epoch, cfg.epochs, t + 1, self.spe, sums[0] / sums[2])
                signum = stop.poll()  # at the epoch's last step: stops after the epoch's checkpoint
                stopping = signum and t + 1 < self.spe
                if stopping or cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and t + 1 < self.spe:
                    part = {"sums": [float(v) for v in sums], "sent": int(sent), "epoch_s": time.monotonic() - t_epoch}
                    written = self._write(history, epoch, t + 1, since, wall, part)
                if stopping:
                    comm.Barrier()  # none leaves while rank 0 still writes
                    return Stopped(signum, epoch, t + 1, cfg.checkpoint, written)
            partial = None
            epoch_s = time.monotonic() - t_epoch  # training only, as sync's: the test is not timed
            history.append(self._record(epoch, step, sums, sent, epoch_s, epoch_s + wall))
            wall += epoch_s
            written = bool(cfg.checkpoint) and self._write(history, epoch + 1, 0, since, wall, None)
            signum = stop.agree()  # after the epoch's checkpoint
            if signum and epoch + 1 < cfg.epochs:
                return Stopped(signum, epoch + 1, 0, cfg.checkpoint, written)
        return None

    def _write(self, history, epoch: int, step: int, since: int, wall: float, partial: dict | None) -> bool:
        """A checkpoint after ``epoch`` epochs and ``step`` steps of the next:
        as its model the one tested (the ranks' average, EASGD's center),
        rank 0's optimizer, and every rank's own parameters, momentum, steps
        since the last average and time (collective)."""
        if not checkpoint.finite_everywhere(self.cfg, self.comm, self.model, epoch, step):
            return False
        mine = {"torch_rng": torch.get_rng_state(), "since": since, "wall": wall}
        with self._tested():
            tested = {k: v.clone() for k, v in self.model.state_dict().items()}
            if self.lock is not None and self.comm.Get_rank() == 0:  # counted before any rank updates again
                mine["locked_updates"] = self._locked_updates()
        if self.hogwild:  # the shared vector is the model; each rank's momentum is its own
            mine["momentum"] = torch.from_numpy(self.momentum.copy())
        else:
            mine |= {"flat": self.flat.clone(), "optimizer": self.opt.state_dict()}
        if self.center is not None:
            mine["center"] = self.center.clone()
        if partial is not None:
            mine["partial"] = partial
        checkpoint.gather_and_save(self.cfg, self.comm, tested, self.opt, history, epoch, step, mine)
        return True

    @contextlib.contextmanager
    def _tested(self):
        """The model holds what is tested for the block -- the center
        (easgd), the ranks' average (local; collective) -- then this rank's
        own parameters again. Hogwild!: the shared vector once every rank's
        last update is in, and no rank updates it again before every rank
        has left the block (collective)."""
        if self.hogwild:
            self.win.Sync()
            self.comm.Barrier()
            try:
                yield
            finally:
                self.win.Sync()
                self.comm.Barrier()
            return
        own = self.flat.clone()
        if self.center is not None:
            self.flat.copy_(self.center)
        else:
            with guard("train: the ranks' average", self.comm):
                self.comm.Allreduce(MPI.IN_PLACE, self.flat.numpy(), op=MPI.SUM)
            self.flat.div_(self.W)
        try:
            yield
        finally:
            self.flat.copy_(own)

    def _resume(self) -> tuple[list[dict], tuple[int, int], dict]:
        """The history, where to start (epoch, step within it) and this rank's
        own state: the checkpoint's with ``resume`` (where it exists), else a
        fresh start. CheckpointError on every rank for one it cannot take."""
        if not self.cfg.resume:
            return [], (0, 0), {}
        epoch, step, history, states = checkpoint.read(self.cfg, self.model, self.opt, self.comm)
        if states is None:
            return [], (0, 0), {}
        mine = self.comm.scatter(states or None, root=0)
        torch.set_rng_state(mine["torch_rng"])
        if self.hogwild:  # rank 0 loaded the model, the shared vector (checkpoint.read)
            self.momentum[:] = mine["momentum"].numpy()
            if "locked_updates" in mine:
                self.lock.Lock(0, MPI.LOCK_EXCLUSIVE)
                self.lock.Put(np.array([mine["locked_updates"]], np.int64), 0)
                self.lock.Unlock(0)
            return history, (epoch, step), mine
        self.flat.copy_(mine["flat"])
        self.opt.load_state_dict(mine["optimizer"])
        if self.center is not None:
            self.center.copy_(mine["center"])
        return history, (epoch, step), mine

    def _locked_updates(self) -> int:
        """Every rank's updates so far, from rank 0's counter (hogwild_lock)."""
        self.lock.Lock(0, MPI.LOCK_SHARED)
        self.lock.Get(self.before, 0)
        self.lock.Unlock(0)
        return int(self.before[0])

    def _step(self, step: int) -> None:
        if not self.hogwild:
            sched.set_lr(self.opt, sched.lr_at(step, self.spe, self.schedule),
                         momentum_correction=self.cfg.momentum_correction)
            self.opt.step()
            return
        lr = sched.lr_at(step * self.W, self.spe * self.W, self.schedule)
        g = grad_vector(self.model, self.grad)
        if self.cfg.weight_decay:
            g += np.float32(self.cfg.weight_decay) * self.flat.numpy()
        self.momentum *= np.float32(self.cfg.momentum)
        self.momentum += g
        if self.lock is not None:
            self.lock.Lock(0, MPI.LOCK_EXCLUSIVE)
            self.lock.Fetch_and_op(self.one, self.before, 0, op=MPI.SUM)
            self.lock.Flush(0)  # the lock is held from here
        self.flat.sub_(torch.from_numpy(self.momentum), alpha=lr)  # in place on the shared vector
        if self.lock is not None:
            self.lock.Unlock(0)

    def _average(self) -> int:
        """Local SGD's average, or EASGD's elastic move; the bytes this rank sent."""
        flat = self.flat
        if self.center is None and self.both is None:
            return counted_allreduce(flat.numpy(), "avg", self.cfg.algorithm, self.comm)
        if self.center is None:
            n, both = flat.numel(), torch.from_numpy(self.both)
            buffers = [self.opt.state[p]["momentum_buffer"] for p in self.model.parameters()]
            both[:n].copy_(flat)
            torch.cat([b.reshape(-1) for b in buffers], out=both[n:])
            sent = counted_allreduce(self.both, "avg", self.cfg.algorithm, self.comm)
            flat.copy_(both[:n])
            for b, part in zip(buffers, both[n:].split([b.numel() for b in buffers])):
                b.copy_(part.view_as(b))
            return sent
        total = flat.clone()
        sent = counted_allreduce(total.numpy(), "sum", self.cfg.algorithm, self.comm)
        flat.sub_(flat - self.center, alpha=self.alpha)
        self.center.add_(total - self.W * self.center, alpha=self.alpha)
        return sent

    def _record(self, epoch: int, step: int, sums: np.ndarray, sent: int, epoch_s: float, wall_s: float) -> dict:
        """The epoch's line. Tested: the center (easgd), the ranks' average
        (local: what one more average would give), the shared vector (hogwild)."""
        comm = self.comm
        maxes = np.array([epoch_s, wall_s, sent], np.float64)
        # watched where the ranks come from their last average together (Hogwild!'s come as their epochs end,
        # as far apart as their speeds make them, and are not)
        with contextlib.nullcontext() if self.hogwild else guard("train: epoch metrics", comm):
            comm.Allreduce(MPI.IN_PLACE, maxes, op=MPI.MAX)
            comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
        extra = {}
        if self.hogwild:
            self.win.Sync()
            comm.Barrier()  # every rank's last update is in
            if self.lock is not None:
                extra["locked_updates"] = self._locked_updates()
            test_loss, test_acc = evaluate(self.model, self.ds, comm)
        else:
            with self._tested():
                test_loss, test_acc = evaluate(self.model, self.ds, comm)
        lr_step = step * self.W - 1 if self.hogwild else step - 1
        lr = sched.lr_at(lr_step, self.spe * (self.W if self.hogwild else 1), self.schedule)
        record = finish_record(self.cfg, {
            "epoch": epoch + 1, "step": step, "lr": lr, "loss": sums[0] / sums[2], "train_acc": sums[1] / sums[2],
            "test_loss": test_loss, "test_acc": test_acc, "epoch_s": maxes[0], "wall_s": maxes[1],
            "samples": sums[2], "sent_bytes": maxes[2], **extra}, self.W)
        if comm.Get_rank() == 0:
            report(self.cfg, record)
        return record
