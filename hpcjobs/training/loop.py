"""The data-parallel training loop behind ``hpcjobs train`` and the
large-batch experiment.

Launch::

    mpirun -n 4 hpcjobs train --dataset mnist1d --model cnn1d --batch-per-rank 64 \\
        --lr 0.1 --base-batch 256 --warmup gradual --epochs 20 --metrics results/train.jsonl
    srun --mpi=pmix hpcjobs train ... --checkpoint $SCRATCH/run1.pt --resume

:func:`train` first makes every rank start from the same place (rank 0's
fresh model, or the checkpoint's), then, per epoch:

1. every rank draws the epoch's permutation from (seed, epoch) and takes its
   ``b * backward_passes_per_step`` samples of each global batch
   (:func:`hpcjobs.training.data.rank_batches`);
2. each step sets the scheduled rate (:func:`schedule.lr_at`), runs forward
   and backward on the rank's micro-batches, and ``DistributedOptimizer``
   averages the gradients with our allreduce;
3. at the end of the epoch the loss and accuracy sums are reduced, BatchNorm
   running statistics are averaged across ranks (training used per-worker
   statistics; evaluation uses their mean), and the test set -- split into
   one contiguous shard per rank -- is evaluated (with ``noise_scale``, the
   gradient noise scale is estimated from the optimizer's squared norms);
4. rank 0 writes one JSON line of metrics and, with ``checkpoint``, an atomic checkpoint (temp file,
   fsync, rename) that ``resume`` continues from, with the same data order and schedule position.

Mixed precision (``amp``): the forward pass runs under ``torch.autocast`` (bfloat16, or float16 with a
``GradScaler``); the gradients stay float32. For fp16 the scaler unscales the *averaged* gradients, bitwise
the same on every rank, so all skip the same overflowing steps; its scale is checkpointed with the rest.
The other modes (``--mode async|local|easgd|hogwild``) are :mod:`hpcjobs.training.modes`.

With ``checkpoint_every=N`` a checkpoint is also written after every N-th
step inside an epoch, so a job killed mid-epoch loses at most N steps
(:mod:`hpcjobs.training.checkpoint` says what a checkpoint holds).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from ..collectives.watchdog import guard
from ..comm import private
from ..convergence import min_points, noise_scale, prediction_fields
from ..compression import make_compressor
from ..runtime import autocast, out_of_memory, pick_device
from . import checkpoint
from . import schedule as sched
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .checkpoint import CHECKPOINT_VERSION, CheckpointError, load_checkpoint, moved as _moved, save_checkpoint
from .config import TrainConfig
from .data import Dataset, load_dataset_of, rank_batches, steps_per_epoch
from .distributed import DistributedOptimizer
from .models import build_model
from .optimizers import make_optimizer
from .preempt import Stopped, StopSignals
from .stepping import Progress, Straggler, evaluate, losses_of, report

__all__ = ["TrainConfig", "train", "CHECKPOINT_VERSION", "CheckpointError", "Stopped", "save_checkpoint",
           "load_checkpoint"]


# --- the loop -----------------------------------------------------------------

def _average_bn_stats(model: torch.nn.Module, comm: MPI.Comm) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            for t in (m.running_mean, m.running_var):
                host = t.cpu()  # the same tensor on the CPU; a copy of a GPU's
                with guard("train: BatchNorm statistics", comm):
                    comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
                t.copy_(host).div_(comm.Get_size())


@dataclass
class _Run:
    """What one :func:`train` works with, from :func:`_setup` on."""

    cfg: TrainConfig
    comm: MPI.Intracomm  # the suite's private duplicate of the caller's communicator
    ds: Dataset
    model: torch.nn.Module
    inner: torch.optim.Optimizer  # the optimizer DistributedOptimizer wraps; its state is checkpointed
    schedule: sched.ScheduleConfig
    steps_per_epoch: int
    global_batch: int
    opt: DistributedOptimizer | None = None  # made by _start
    history: list = field(default_factory=list)
    start_epoch: int = 0
    start_step: int = 0
    partial: dict | None = None  # this rank's share of a half-done epoch, from a mid-epoch checkpoint
    scaler: torch.amp.GradScaler | None = None  # amp="fp16"
    device: torch.device = torch.device("cpu")
    straggler: Straggler | None = None
    stop: StopSignals | None = None  # made by train: SIGTERM or SIGUSR1 checkpoints and stops (with a checkpoint)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()


def train(cfg: TrainConfig, comm: MPI.Comm | None = None, on_epoch=None) -> list[dict]:
    """Train on every rank of ``comm``; returns the per-epoch metrics
    (the same list on every rank). ``on_epoch(record)`` sees each epoch's.

    Raises:
        ValueError: a bad configuration (global batch larger than the data,
            unknown names); CheckpointError: an unusable checkpoint on resume;
            Stopped: SIGTERM or SIGUSR1 stopped a run with a checkpoint, after
            writing it (:mod:`hpcjobs.training.preempt`). Raised on every rank.
    """
    cfg.validate()
    user_comm = comm if comm is not None else MPI.COMM_WORLD
    if cfg.mode != "sync":  # hpcjobs.training.paramserver, hpcjobs.training.averaging
        from .modes import train_mode
        return train_mode(cfg, private(user_comm), on_epoch)
    run = _setup(cfg, private(user_comm))
    _start(run, user_comm)
    progress = Progress(cfg.progress and run.rank == 0 and not cfg.quiet)
    run.stop = StopSignals(run.comm, bool(cfg.checkpoint))
    try:
        for epoch in range(run.start_epoch, cfg.epochs):
            try:
                sums, elapsed = _epoch(run, epoch, progress)
            except torch.cuda.OutOfMemoryError as e:  # the handler below ends the job
                raise _out_of_memory(run, e, end_job=False) from e
            record = _record(run, epoch, sums, elapsed)
            written = _end_epoch(run, epoch, record)
            if on_epoch is not None:
                on_epoch(record)
            if not math.isfinite(record["loss"]):
                if run.rank == 0 and not cfg.quiet:
                    print(f"# train: loss is {record['loss']} after epoch {epoch + 1}; stopping (diverged)",
                          flush=True)
                break
            signum = run.stop.agree()  # after the epoch's checkpoint
            if signum and epoch + 1 < cfg.epochs:
                raise Stopped(signum, epoch + 1, 0, cfg.checkpoint, written)
    except Stopped:
        raise  # on every rank alike
    except Exception:
        # One rank failing alone would leave the others blocked in the next
        # allreduce: end the job instead, saying which rank and why.
        if run.size > 1:
            import traceback

            traceback.print_exc()
            print(f"hpcjobs: rank {run.rank} failed in training; aborting the job", file=sys.stderr, flush=True)
            run.comm.Abort(1)
        raise
    finally:
        try:
            run.opt.close()
        finally:
            run.stop.close()
    return run.history


def _setup(cfg: TrainConfig, comm: MPI.Intracomm) -> _Run:
    """The data, a fresh model (seeded), the wrapped optimizer and the schedule."""
    device = pick_device(cfg.device, comm)  # a missing GPU fails before the data is read
    ds = load_dataset_of(cfg, comm)
    global_batch = cfg.global_batch(comm.Get_size())
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, width=cfg.width, batch_norm=cfg.batch_norm,
                        tokens=ds.tokens, layers=cfg.layers, heads=cfg.heads, embed=cfg.embed)
    # The same model on every rank; what draws from torch's generator after it (QSGD's rounding) draws a
    # stream of each rank's own, or every rank would round alike and the average's noise would not shrink.
    torch.manual_seed(int(np.random.SeedSequence([cfg.seed, comm.Get_rank()]).generate_state(1, np.uint64)[0]))
    return _Run(cfg, comm, ds, model, make_optimizer(cfg, model), cfg.schedule(comm.Get_size()),
                steps_per_epoch(len(ds.train), global_batch), global_batch,
                scaler=torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None, device=device,
                straggler=Straggler(cfg.straggler, comm.Get_rank(), comm.Get_size()))


def _out_of_memory(run: _Run, error: BaseException, end_job: bool) -> MemoryError:
    """A CUDA out-of-memory error, naming the model, the batch and the device."""
    cfg = run.cfg
    amp = f", autocast to {cfg.amp}" if cfg.amp != "none" else ""
    return out_of_memory(error, run.comm, run.device,
                         f"training {cfg.model} with {cfg.batch_per_rank} samples per rank per pass{amp}",
                         "lower --batch-per-rank (accumulate with --backward-passes-per-step) or use --amp bf16",
                         end_job)


def _to_device(run: _Run) -> None:
    """Move the model and the optimizer's state (a resumed run's) to the
    run's device; the broadcasts and the checkpoint worked on the CPU."""
    if run.device.type == "cpu":
        return
    run.model.to(run.device)
    for state in run.inner.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:  # Adam's step counts stay on the CPU, as torch keeps them
                state[k] = v.to(run.device)


def _start(run: _Run, user_comm: MPI.Comm) -> None:
    """Every rank starts from the same place: the checkpoint's, when
    resuming from one (each rank gets back its own state), else rank 0's
    fresh model and optimizer; then the DistributedOptimizer around them."""
    cfg, comm = run.cfg, run.comm
    mine = {}
    if cfg.resume:  # validate() made sure there is a checkpoint path
        run.start_epoch, run.start_step, run.history, rank_states = checkpoint.read(
            cfg, run.model, run.inner, comm, run.scaler)
        if rank_states is not None:
            mine = comm.scatter(rank_states or None, root=0)
    broadcast_parameters(run.model.state_dict(), root_rank=0, comm=comm)
    broadcast_optimizer_state(run.inner, root_rank=0, comm=comm)
    if mine:
        torch.set_rng_state(mine["torch_rng"])
        with torch.no_grad():
            for name, buf in run.model.named_buffers():
                buf.copy_(mine["buffers"][name])
    run.partial = mine.get("partial")
    try:
        _to_device(run)
    except torch.cuda.OutOfMemoryError as e:  # on some ranks only: the others would wait in what follows
        raise _out_of_memory(run, e, end_job=True) from e
    if "cuda_rng" in mine and run.device.type == "cuda":  # (a GPU run's, resumed on a GPU)
        torch.cuda.set_rng_state(mine["cuda_rng"], run.device)
    run.opt = DistributedOptimizer(run.inner, run.model.named_parameters(), comm=user_comm, algorithm=cfg.algorithm,
                                   compression=make_compressor(cfg.compression, seed=cfg.seed),
                                   error_feedback=cfg.error_feedback, fusion_bytes=cfg.fusion_bytes,
                                   backward_passes_per_step=cfg.backward_passes_per_step, overlap=cfg.overlap,
                                   nonfinite=cfg.nonfinite, noise_scale=cfg.noise_scale)
    run.opt.skips_whole_steps |= run.scaler is not None  # fp16's scaler skips a step with an inf anywhere
    if "compression" in mine:  # this rank's residuals, step count, PowerSGD's Q (read on the CPU)
        run.opt.load_compression_state_dict(_moved(mine["compression"], run.device))
    if run.rank == 0 and not cfg.quiet and run.start_epoch == 0:
        peak = sched.scaled_lr(run.schedule.base_lr, run.schedule.base_batch, run.global_batch)
        k = run.global_batch / run.schedule.base_batch
        warm = ("no warmup" if cfg.warmup == "none" else f"{cfg.warmup} warmup {cfg.warmup_epochs:g} epochs" if k > 1
                else f"k = {k:g}: no warmup (--base-batch sets the batch the rate is for)")
        print(f"# train: {cfg.model} on {cfg.dataset} ({len(run.ds.train)} train / {len(run.ds.test)} test), "
              f"{run.size} ranks x {cfg.batch_per_rank} x {cfg.backward_passes_per_step} passes = global batch "
              f"{run.global_batch}, {run.steps_per_epoch} steps/epoch, peak lr {peak:g} "
              f"({warm}), {cfg.optimizer}, algorithm {cfg.algorithm}, "
              f"{run.opt.num_buckets} buckets, overlap {run.opt.overlap}"
              + (f", autocast to {cfg.amp}" if cfg.amp != "none" else "") + f", on {run.device}", flush=True)
        late = [f"milestone {m:g} is not before the last epoch" for m in (cfg.milestones or ()) if m >= cfg.epochs]
        if k > 1 and cfg.warmup != "none":
            if cfg.warmup_epochs >= cfg.epochs:  # (equal: the last step's rate is still a step below the peak)
                late.append(f"a warmup of {cfg.warmup_epochs:g} epochs never reaches the peak rate")
            elif cfg.warmup_epochs and not sched.warmup_steps(run.steps_per_epoch, run.schedule):
                late.append(f"a warmup of {cfg.warmup_epochs:g} epochs rounds to no step ({run.steps_per_epoch} "
                            "steps per epoch)")
            late += [f"milestone {m:g} falls inside the warmup (the climbing rate is cut there)"
                     for m in (cfg.milestones or ()) if m < cfg.warmup_epochs]
        for what in late:
            print(f"# train: warning: in a run of {cfg.epochs} epochs {what}", flush=True)
        left = len(run.ds.train) - run.steps_per_epoch * run.global_batch  # (the last partial global batch)
        if left > 0.05 * len(run.ds.train):
            print(f"# train: warning: each epoch leaves out {left} of the {len(run.ds.train)} training samples "
                  f"({100 * left / len(run.ds.train):.0f}%: the last partial global batch, other samples each epoch)",
                  flush=True)


def _epoch(run: _Run, epoch: int, progress: Progress) -> tuple[np.ndarray, float]:
    """Steps 1-2 of the module docstring: this rank's shard of the epoch, a
    step per global batch. Returns this rank's (loss, correct, samples)
    sums and the epoch's seconds, a resumed epoch's share included."""
    cfg, opt, ds = run.cfg, run.opt, run.ds
    spe, micro, passes = run.steps_per_epoch, cfg.batch_per_rank, cfg.backward_passes_per_step
    idx = rank_batches(len(ds.train), micro * passes, run.rank, run.size, epoch, cfg.seed)  # (steps, passes x b)
    opt.reset_stats()
    sums, first, elapsed = np.zeros(3), 0, 0.0
    if run.partial is not None and epoch == run.start_epoch:
        first, elapsed = run.start_step, run.partial["elapsed"]
        sums[:] = run.partial["sums"]
        opt.stats.update(run.partial["stats"])
        if "noise_steps" not in run.partial["stats"]:  # a checkpoint from before it was counted: every step
            opt.stats["noise_steps"] = opt.stats["steps"]
    with guard("train: epoch start", run.comm):  # (a rank stalled before it had left the others here for good)
        run.comm.Barrier()
    t0, writing = time.perf_counter(), 0.0  # (the mid-epoch checkpoints' writes: not the epoch's training time)
    for s in range(first, spe):
        step = epoch * spe + s
        sched.set_lr(run.inner, sched.lr_at(step, spe, run.schedule), momentum_correction=cfg.momentum_correction)
        opt.zero_grad()
        # a step's samples at a time: the epoch's at once held the rank's shard as float32 or int64 (the text
        # dataset's: 16 bytes for each byte of the corpus, across the ranks)
        xs, ys = ds.batch(ds.train, idx[s])
        xs = torch.from_numpy(xs).reshape(passes, micro, *ds.input_shape)
        ys = torch.from_numpy(ys).reshape(passes, micro, *ys.shape[1:])
        for k in range(passes):
            t_pass = time.perf_counter()
            with autocast(cfg.amp, run.device):
                out = run.model(xs[k].to(run.device, non_blocking=True))
            losses, correct = losses_of(out, ys[k].to(run.device, non_blocking=True))
            loss = losses.mean()
            (run.scaler.scale(loss / passes) if run.scaler else loss / passes).backward()
            sums += [float(loss.detach()) * micro, correct, micro]
            run.straggler(time.perf_counter() - t_pass)
        if run.scaler is None:
            opt.step()
        else:  # the scaler unscales the averages, identical on every rank: all skip alike
            opt.grad_scale = run.scaler.get_scale()  # the noise scale's norms: in the gradient's own units
            opt.synchronize()
            run.scaler.unscale_(run.inner)
            run.scaler.step(run.inner)
            run.scaler.update()
            if run.scaler.get_scale() < opt.grad_scale:  # only an overflow lowers it: the step was skipped
                opt.stats["skipped_steps"] += 1
            if opt.memory is not None and run.scaler.get_scale() != opt.grad_scale:  # residuals: in the new units
                opt.memory.rescale(run.scaler.get_scale() / opt.grad_scale)
        progress.update(epoch, cfg.epochs, s + 1, spe, sums[0] / sums[2])
        signum = run.stop.poll()  # at the epoch's last step: train stops after the epoch's checkpoint
        stop = signum and s + 1 < spe
        if stop or cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and s + 1 < spe:
            t_write = time.perf_counter()
            written = checkpoint.write(cfg, run.comm, run.model, run.inner, opt, run.history, epoch, s + 1, {
                "sums": sums.tolist(), "stats": dict(opt.stats), "elapsed": elapsed + t_write - t0 - writing},
                run.scaler)
            writing += time.perf_counter() - t_write
        if stop:
            with guard("train: stop", run.comm):  # rank 0 has written it: none leaves before (srun --kill-on-bad-exit)
                run.comm.Barrier()
            raise Stopped(signum, epoch, s + 1, cfg.checkpoint, written)
    return sums, elapsed + time.perf_counter() - t0 - writing


def _record(run: _Run, epoch: int, sums: np.ndarray, epoch_s: float) -> dict:
    """Step 3: the epoch's metrics over all ranks, after averaging the
    BatchNorm statistics and evaluating the test set."""
    opt, comm = run.opt, run.comm
    times = np.array([epoch_s, opt.stats["comm_s"], opt.stats["wait_s"], opt.stats["sent_bytes"]])
    with guard("train: epoch metrics", comm):
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    _average_bn_stats(run.model, comm)
    test_loss, test_acc = evaluate(run.model, run.ds, comm, run.cfg.amp, run.device)
    spe = run.steps_per_epoch
    record = {
        "epoch": epoch + 1, "step": (epoch + 1) * spe, "lr": sched.lr_at((epoch + 1) * spe - 1, spe, run.schedule),
        "loss": sums[0] / sums[2], "train_acc": sums[1] / sums[2], "test_loss": test_loss, "test_acc": test_acc,
        "samples_per_s": spe * run.global_batch / times[0], "epoch_s": times[0],
        "wall_s": times[0] + sum(h["epoch_s"] for h in run.history), "comm_s": times[1],
        "wait_s": times[2], "comm_share": times[1] / times[0], "ranks": run.size, "global_batch": run.global_batch,
    }
    if opt.stats["skipped_steps"]:
        record["skipped_steps"] = opt.stats["skipped_steps"]
    if opt.counts_bytes:  # the busiest rank's bytes sent this epoch
        record["sent_bytes"] = int(times[3])
    steps = opt.stats["noise_steps"]  # the epoch's steps with a finite average, the same on every rank
    if opt.noise_scale and steps:  # this epoch's mean squared norms (convergence.noise_scale)
        with guard("train: epoch metrics", comm):
            rank_sq = comm.allreduce(opt.stats["grad_sq_rank"]) / (run.size * steps)
        record.update(noise_scale(rank_sq, opt.stats["grad_sq_avg"] / steps,
                                  run.global_batch // run.size, run.global_batch))
    # plain Python numbers: the checkpoint is loaded with weights_only=True
    return {k: (v if v is None else int(v) if isinstance(v, (int, np.integer)) else float(v))
            for k, v in record.items()}


def _end_epoch(run: _Run, epoch: int, record: dict) -> bool:
    """Step 4: the metrics line (rank 0) and the end-of-epoch checkpoint;
    whether one was written (on every rank alike)."""
    run.history.append(record)
    if run.cfg.target_loss and len(run.history) >= min_points(run.cfg.loss_model):
        record.update(prediction_fields(run.history, run.cfg.target_loss, model=run.cfg.loss_model))
    if run.rank == 0:
        report(run.cfg, record)
    # not of a diverged epoch (finite parameters under --nonfinite skip or fp16's skips): --resume would go on from it
    return bool(run.cfg.checkpoint) and math.isfinite(record["loss"]) and checkpoint.write(
        run.cfg, run.comm, run.model, run.inner, run.opt, run.history, epoch + 1, 0, None, run.scaler)
