"""The data-parallel training loop behind ``hpcjobs train`` and the
large-batch experiment.

Launch::

    mpirun -n 4 hpcjobs train --dataset mnist1d --model cnn1d --batch-per-rank 64 \\
        --lr 0.1 --base-batch 256 --warmup gradual --epochs 20 --metrics results/train.jsonl
    srun --mpi=pmix hpcjobs train ... --checkpoint $SCRATCH/run1.pt --resume

Per epoch:

1. every rank draws the epoch's permutation from (seed, epoch) and takes its
   ``b * backward_passes_per_step`` samples of each global batch
   (:func:`hpcjobs.training.data.rank_batches`);
2. each step sets the scheduled rate (:func:`schedule.lr_at`), runs forward
   and backward on the rank's micro-batches, and ``DistributedOptimizer``
   averages the gradients with our allreduce;
3. at the end of the epoch the loss and accuracy sums are reduced, BatchNorm
   running statistics are averaged across ranks (training used per-worker
   statistics; evaluation uses their mean), and the test set -- split into
   one contiguous shard per rank -- is evaluated;
4. rank 0 writes one JSON line of metrics and, with ``checkpoint``, an
   atomic checkpoint (temp file, fsync, rename) that ``resume`` continues
   from, with the same data order and schedule position.

With ``checkpoint_every=N`` a checkpoint is also written after every N-th
step inside an epoch, so a job killed mid-epoch loses at most N steps. Each
checkpoint holds, besides rank 0's model and optimizer, every rank's own
state: its torch RNG, its buffers (BatchNorm statistics are per rank until
the epoch ends), its error-feedback residuals, and mid-epoch its share of the
epoch's loss and accuracy sums, counters and elapsed time -- so the resumed
run ends with the same parameters and the same epoch metrics.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from ..collectives.counting import MESSAGE_ALGORITHMS
from ..comm import private
from ..compression import COMPRESSIONS, make_compressor
from . import schedule as sched
from .data import eval_shard, load_dataset, rank_batches, steps_per_epoch
from .distributed import DEFAULT_FUSION_BYTES, DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from .lars import LARS
from .models import build_model

__all__ = ["OPTIMIZERS", "COMPRESSIONS", "TrainConfig", "train", "save_checkpoint", "load_checkpoint",
           "CheckpointError", "make_compressor"]

OPTIMIZERS = ("sgd", "nesterov", "adam", "adagrad", "adadelta", "rmsprop", "lars")
CHECKPOINT_VERSION = 2  # 2: every rank's own state under "ranks"
# A resumed run must be the same experiment: these fields may not change.
_RESUME_KEYS = ("model", "width", "batch_norm", "dataset", "num_samples", "data_seed", "seed", "batch_per_rank",
                "backward_passes_per_step", "optimizer", "compression", "error_feedback")


@dataclass
class TrainConfig:
    """One training run. ``lr`` is the rate for ``base_batch`` samples; the
    schedule scales it linearly to the global batch (``base_batch=None``
    means the global batch, i.e. no scaling)."""

    model: str = "mlp"
    width: int | None = None
    batch_norm: bool = False
    dataset: str = "mnist1d"
    data_dir: str | None = None
    num_samples: int | None = None
    data_seed: int = 42
    batch_per_rank: int = 32
    backward_passes_per_step: int = 1
    optimizer: str = "sgd"
    lr: float = 0.1
    base_batch: int | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    no_decay_bn_bias: bool = False
    trust_coefficient: float = 0.001
    warmup: str = "gradual"
    warmup_epochs: float = 5.0
    decay: str = "none"
    milestones: tuple[float, ...] = field(default=())
    gamma: float = 0.1
    final_lr: float = 0.0
    momentum_correction: bool = True
    algorithm: str = "auto"
    compression: str = "none"
    error_feedback: bool = False
    fusion_bytes: int = DEFAULT_FUSION_BYTES
    overlap: str = "auto"
    nonfinite: str = "ignore"
    epochs: int = 10
    seed: int = 0
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    metrics: str | None = None
    progress: bool = True
    quiet: bool = False

    def global_batch(self, size: int) -> int:
        return self.batch_per_rank * self.backward_passes_per_step * size

    def schedule(self, size: int) -> sched.ScheduleConfig:
        gb = self.global_batch(size)
        return sched.ScheduleConfig(base_lr=self.lr, base_batch=self.base_batch or gb, global_batch=gb,
                                    warmup=self.warmup, warmup_epochs=self.warmup_epochs, decay=self.decay,
                                    epochs=self.epochs, milestones=self.milestones or (), gamma=self.gamma,
                                    final_lr=self.final_lr)

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if make_compressor(self.compression) is None:
            if self.error_feedback:
                raise ValueError("error feedback needs a compression")
        elif self.algorithm != "auto" and self.algorithm not in MESSAGE_ALGORITHMS:
            raise ValueError(f"compressed gradients need a message-passing algorithm (auto or "
                             f"{', '.join(MESSAGE_ALGORITHMS)}), got {self.algorithm!r}")
        for name in ("batch_per_rank", "backward_passes_per_step", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.resume and not self.checkpoint:
            raise ValueError("resume needs a checkpoint path")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 steps, got {self.checkpoint_every}")
        if self.checkpoint_every and not self.checkpoint:
            raise ValueError("checkpoint_every needs a checkpoint path")
        self.schedule(1)  # validates the schedule fields


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: truncated, corrupt, or from another experiment."""


def _make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    # the "lars_exclude" flag of a group is read by LARS and kept, unread, by the others
    groups = sched.parameter_groups(model, cfg.weight_decay, cfg.no_decay_bn_bias)
    lr = cfg.lr
    if cfg.optimizer in ("sgd", "nesterov"):
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.optimizer == "nesterov")
    if cfg.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if cfg.optimizer == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    if cfg.optimizer == "adadelta":
        return torch.optim.Adadelta(groups, lr=lr)
    if cfg.optimizer == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, momentum=cfg.momentum)
    return LARS(groups, lr=lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient)


# --- checkpoints -------------------------------------------------------------

def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` so that ``path`` always holds a whole checkpoint:
    a temp file in the same directory, fsync, rename over, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a checkpoint with ``weights_only=True``.

    Raises:
        FileNotFoundError: no file; CheckpointError: truncated, corrupt, or
        not an hpcjobs checkpoint.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "model" not in state or not isinstance(state.get("version"), int):
        raise CheckpointError(f"{path} is not an hpcjobs training checkpoint (version {CHECKPOINT_VERSION})")
    if state["version"] != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is a version {state['version']} checkpoint; this hpcjobs reads version "
                              f"{CHECKPOINT_VERSION} (resume with the hpcjobs that wrote it, or start afresh)")
    return state


def _config_dict(cfg: TrainConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["milestones"] = list(cfg.milestones)
    return d


# --- progress ---------------------------------------------------------------

class _Progress:
    """A one-line bar on rank 0's terminal; nothing when stderr is not a tty
    (batch logs get the per-epoch lines instead)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, epoch: int, epochs: int, step: int, steps: int, loss: float) -> None:
        if not self.enabled or (step % max(1, steps // 50) and step != steps):
            return
        width = 30
        done = int(width * step / steps)
        sys.stderr.write(f"\repoch {epoch + 1}/{epochs} [{'#' * done}{'.' * (width - done)}] "
                         f"{step}/{steps} loss {loss:.4f}")
        if step == steps:
            sys.stderr.write("\r" + " " * 80 + "\r")
        sys.stderr.flush()


# --- the loop -----------------------------------------------------------------

def _average_bn_stats(model: torch.nn.Module, comm: MPI.Comm) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            for t in (m.running_mean, m.running_var):
                comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
                t.div_(comm.Get_size())


@torch.no_grad()
def _evaluate(model, ds, comm) -> tuple[float, float]:
    model.eval()
    idx = eval_shard(len(ds.test), comm.Get_rank(), comm.Get_size())
    sums = np.zeros(3)
    for lo in range(0, len(idx), 1024):
        x, y = ds.batch(ds.test, idx[lo:lo + 1024])
        out = model(torch.from_numpy(x))
        y = torch.from_numpy(y)
        sums += [float(torch.nn.functional.cross_entropy(out, y, reduction="sum")),
                 float((out.argmax(1) == y).sum()), len(y)]
    comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    model.train()
    return sums[0] / sums[2], sums[1] / sums[2]


def train(cfg: TrainConfig, comm: MPI.Comm | None = None, on_epoch=None) -> list[dict]:
    """Train on every rank of ``comm``; returns the per-epoch metrics
    (the same list on every rank).

    Raises:
        ValueError: a bad configuration (global batch larger than the data,
            unknown names); CheckpointError: an unusable checkpoint on resume.
            Raised on every rank.
    """
    cfg.validate()
    user_comm = comm if comm is not None else MPI.COMM_WORLD
    comm = private(user_comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    ds = load_dataset(cfg.dataset, comm=comm, data_dir=cfg.data_dir, num_samples=cfg.num_samples,
                      seed=cfg.data_seed)
    global_batch = cfg.global_batch(size)
    spe = steps_per_epoch(len(ds.train), global_batch)
    scfg = cfg.schedule(size)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, ds.input_shape, ds.num_classes, width=cfg.width, batch_norm=cfg.batch_norm)
    inner = _make_optimizer(cfg, model)
    history: list[dict] = []
    start_epoch, start_step, mine = 0, 0, {}
    if cfg.resume:  # validate() made sure there is a checkpoint path
        start_epoch, start_step, history, rank_states = _resume(cfg, model, inner, comm)
        if rank_states is not None:  # each rank gets back its own state
            mine = comm.scatter(rank_states or None, root=0)
    broadcast_parameters(model.state_dict(), root_rank=0, comm=comm)
    broadcast_optimizer_state(inner, root_rank=0, comm=comm)
    if mine:
        torch.set_rng_state(mine["torch_rng"])
        with torch.no_grad():
            for name, buf in model.named_buffers():
                buf.copy_(mine["buffers"][name])
    partial = mine.get("partial")  # this rank's share of a half-done epoch, from a mid-epoch checkpoint
    opt = DistributedOptimizer(inner, model.named_parameters(), comm=user_comm, algorithm=cfg.algorithm,
                               compression=make_compressor(cfg.compression, seed=cfg.seed),
                               error_feedback=cfg.error_feedback, fusion_bytes=cfg.fusion_bytes,
                               backward_passes_per_step=cfg.backward_passes_per_step, overlap=cfg.overlap,
                               nonfinite=cfg.nonfinite)
    if "compression" in mine:  # this rank's residuals, step count, PowerSGD's Q
        opt.load_compression_state_dict(mine["compression"])
    if rank == 0 and not cfg.quiet and start_epoch == 0:
        print(f"# train: {cfg.model} on {cfg.dataset} ({len(ds.train)} train / {len(ds.test)} test), "
              f"{size} ranks x {cfg.batch_per_rank} x {cfg.backward_passes_per_step} passes = global batch "
              f"{global_batch}, {spe} steps/epoch, peak lr {sched.scaled_lr(scfg.base_lr, scfg.base_batch, global_batch):g} "
              f"({cfg.warmup} warmup {cfg.warmup_epochs:g} epochs), {cfg.optimizer}, algorithm {cfg.algorithm}, "
              f"{opt.num_buckets} buckets, overlap {opt.overlap}", flush=True)
    progress = _Progress(cfg.progress and rank == 0 and not cfg.quiet)
    micro = cfg.batch_per_rank
    passes = cfg.backward_passes_per_step
    try:
        for epoch in range(start_epoch, cfg.epochs):
            idx = rank_batches(len(ds.train), micro * passes, rank, size, epoch, cfg.seed)
            xs, ys = ds.batch(ds.train, idx.ravel())
            xs = torch.from_numpy(xs).reshape(spe, passes, micro, *ds.input_shape)
            ys = torch.from_numpy(ys).reshape(spe, passes, micro)
            opt.reset_stats()
            sums, first, elapsed = np.zeros(3), 0, 0.0
            if partial is not None and epoch == start_epoch:
                first, elapsed = start_step, partial["elapsed"]
                sums[:] = partial["sums"]
                opt.stats.update(partial["stats"])
            comm.Barrier()
            t0 = time.perf_counter()
            for s in range(first, spe):
                step = epoch * spe + s
                lr = sched.lr_at(step, spe, scfg)
                sched.set_lr(inner, lr, momentum_correction=cfg.momentum_correction)
                opt.zero_grad()
                for k in range(passes):
                    out = model(xs[s, k])
                    loss = torch.nn.functional.cross_entropy(out, ys[s, k])
                    (loss / passes).backward()
                    sums += [float(loss.detach()) * micro, float((out.argmax(1) == ys[s, k]).sum()), micro]
                opt.step()
                progress.update(epoch, cfg.epochs, s + 1, spe, sums[0] / sums[2])
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and s + 1 < spe:
                    _checkpoint(cfg, comm, model, inner, opt, history, epoch, s + 1, {
                        "sums": sums.tolist(), "stats": dict(opt.stats),
                        "elapsed": elapsed + time.perf_counter() - t0})
            epoch_s = elapsed + time.perf_counter() - t0
            times = np.array([epoch_s, opt.stats["comm_s"], opt.stats["wait_s"], opt.stats["sent_bytes"]])
            comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
            comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
            _average_bn_stats(model, comm)
            test_loss, test_acc = _evaluate(model, ds, comm)
            record = {
                "epoch": epoch + 1, "step": (epoch + 1) * spe, "lr": lr, "loss": sums[0] / sums[2],
                "train_acc": sums[1] / sums[2], "test_loss": test_loss, "test_acc": test_acc,
                "samples_per_s": spe * global_batch / times[0], "epoch_s": times[0], "comm_s": times[1],
                "wait_s": times[2], "comm_share": times[1] / times[0], "ranks": size,
                "global_batch": global_batch,
            }
            if opt.stats["skipped_steps"]:
                record["skipped_steps"] = opt.stats["skipped_steps"]
            if opt.counts_bytes:  # the busiest rank's bytes sent this epoch
                record["sent_bytes"] = int(times[3])
            # plain Python numbers: the checkpoint is loaded with weights_only=True
            record = {k: (int(v) if isinstance(v, (int, np.integer)) else float(v)) for k, v in record.items()}
            history.append(record)
            if rank == 0:
                _report(cfg, record)
            if cfg.checkpoint:
                _checkpoint(cfg, comm, model, inner, opt, history, epoch + 1, 0, None)
            if on_epoch is not None:
                on_epoch(record)
            if not math.isfinite(record["loss"]):
                if rank == 0 and not cfg.quiet:
                    print(f"# train: loss is {record['loss']} after epoch {epoch + 1}; stopping (diverged)",
                          flush=True)
                break
    except Exception:
        # One rank failing alone would leave the others blocked in the next
        # allreduce: end the job instead, saying which rank and why.
        if size > 1:
            import traceback

            traceback.print_exc()
            print(f"hpcjobs: rank {rank} failed in training; aborting the job", file=sys.stderr, flush=True)
            comm.Abort(1)
        raise
    finally:
        opt.close()
    return history


def _checkpoint(cfg: TrainConfig, comm, model, inner, opt, history: list[dict], epoch: int, step: int,
                partial: dict | None) -> None:
    """Write a checkpoint after ``epoch`` whole epochs and ``step`` steps of
    the next (collective: every rank's own state goes to rank 0)."""
    mine = {"torch_rng": torch.get_rng_state(),
            "buffers": {name: buf.detach().clone() for name, buf in model.named_buffers()}}
    if partial is not None:
        mine["partial"] = partial
    if opt.compression is not None:  # error-feedback residuals differ by rank
        mine["compression"] = opt.compression_state_dict()
    ranks = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        save_checkpoint(cfg.checkpoint, {
            "version": CHECKPOINT_VERSION, "epoch": epoch, "step": step, "config": _config_dict(cfg),
            "model": model.state_dict(), "optimizer": inner.state_dict(), "history": history, "ranks": ranks})


def _report(cfg: TrainConfig, record: dict) -> None:
    line = json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items()})
    if cfg.metrics:
        Path(cfg.metrics).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.metrics, "a") as f:
            f.write(line + "\n")
    if not cfg.quiet:
        print(line, flush=True)


def _resume(cfg: TrainConfig, model, inner, comm) -> tuple[int, int, list[dict], list | None]:
    """Rank 0 reads the checkpoint and the broadcasts that follow give it to
    everyone; an error is told to every rank first. Returns the epoch, the
    step within it, the history, and the per-rank states (a list on rank 0,
    an empty list on the others, for the scatter that follows; None when
    there is no checkpoint)."""
    state, error = None, None
    if comm.Get_rank() == 0:
        try:
            state = load_checkpoint(cfg.checkpoint)
            old = state["config"]
            changed = [k for k in _RESUME_KEYS if old.get(k) != _config_dict(cfg).get(k)]
            if changed:
                raise CheckpointError(f"{cfg.checkpoint} is from another experiment: "
                                      + ", ".join(f"{k} {old.get(k)!r} -> {getattr(cfg, k)!r}" for k in changed))
            if len(state["ranks"]) != comm.Get_size():
                raise CheckpointError(f"{cfg.checkpoint} holds the state of {len(state['ranks'])} ranks; "
                                      f"this run has {comm.Get_size()}")
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optimizer"])
        except FileNotFoundError:
            state = None  # nothing to resume: start from scratch
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    error = comm.bcast(error, root=0)
    if error:
        raise CheckpointError(error)
    epoch, step, history, found = comm.bcast(
        (state["epoch"], state["step"], state["history"], True) if state else (0, 0, [], False), root=0)
    if not found:
        return 0, 0, [], None
    if comm.Get_rank() == 0 and not cfg.quiet:
        where = f", step {step} of epoch {epoch + 1}" if step else ""
        print(f"# train: resumed from {cfg.checkpoint} after epoch {epoch}{where}", flush=True)
    return epoch, step, history, state["ranks"] if comm.Get_rank() == 0 else []
