"""Checkpoints that a killed job resumes from, to the same parameters.

A checkpoint holds, besides rank 0's model and optimizer, every rank's own
state: its torch RNG (and, on a GPU, its device's), its buffers (BatchNorm statistics are per rank until
the epoch ends), its error-feedback residuals, and mid-epoch its share of the
epoch's loss and accuracy sums, counters and elapsed time -- so the resumed
run ends with the same parameters and the same epoch metrics as one never
stopped. With fp16 autocast it also holds the GradScaler's scale and growth
count (rank 0's: every rank's scaler sees the same averaged gradients, so
they are equal), so a resumed run skips the steps the unbroken one skips
instead of starting again from the initial scale. Files are written
atomically (temp file, fsync, rename, fsync the directory) and read with
``weights_only=True``. Parameters that are not finite (a run that diverged)
are not written: the last checkpoint, from before, stays. Local SGD and
synchronous EASGD (:mod:`hpcjobs.training.averaging`) keep their own
checkpoints in the same file format: there each rank's parameters, momentum
buffers and steps since the last average (and EASGD's center) are its own,
and the file's model is the one they test (the ranks' average, the center).
Hogwild!'s is its one vector; the parameter server's
(:mod:`hpcjobs.training.ps_checkpoint`) holds each server's shard and state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from .._files import atomic_write, remove_leftovers
from .config import TrainConfig
from .data import opened_fingerprint

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "save_checkpoint", "load_checkpoint", "write", "read",
           "finite_everywhere", "gather_and_save", "check_same_experiment", "config_dict", "trim_metrics",
           "metrics_size"]

CHECKPOINT_VERSION = 2  # 2: every rank's own state under "ranks"
# "SECONDS": each checkpoint's write takes that much longer (tests: a slow file system)
SLOW_CKPT_ENV = "HPCJOBS_FAULT_SLOW_CHECKPOINT"
# A resumed run must be the same experiment: these fields may not change. The optimizer's own settings
# among them: its saved state_dict brings back the saved ones, and a changed flag would be silently ignored.
_RESUME_KEYS = ("model", "width", "batch_norm", "dataset", "num_samples", "data_seed", "seed", "batch_per_rank",
                "backward_passes_per_step", "optimizer", "momentum", "weight_decay", "trust_coefficient",
                "compression", "error_feedback", "seq_len", "layers", "heads", "embed", "fusion_bytes",
                "no_decay_bn_bias",  # the optimizer's parameter groups: torch's own error was "different number"
                "mode", "local_steps", "post_local_epochs", "average_momentum", "elastic_alpha",  # local and easgd
                "easgd_form", "servers", "staleness_bound", "staleness_lr", "fixed_delay",  # the parameter server
                "hogwild_lock",  # its count of updates is the state of a locked run only
                "data_dir")  # the text dataset's corpus (the files' other datasets may move)
_MODE_KEYS = {"local_steps": ("local", "easgd"), "post_local_epochs": ("local",), "average_momentum": ("local",),
              "elastic_alpha": ("easgd",), "easgd_form": ("easgd",), "servers": ("async",),  # the modes that use each
              "staleness_bound": ("async",), "staleness_lr": ("async",), "fixed_delay": ("async",),
              "hogwild_lock": ("hogwild",)}
# The learning-rate schedule may change on resume (a longer run, a lower rate to finish), but the resumed run
# is then not the one that was saved: rank 0 says which changed. ``epochs`` only where cosine decay anneals to it.
_SCHEDULE_KEYS = ("lr", "base_batch", "warmup", "warmup_epochs", "decay", "milestones", "gamma", "final_lr",
                  "momentum_correction", "epochs")


def _used(key: str, cfg: TrainConfig) -> bool:
    """Whether the run uses the setting ``key`` (momentum: the SGDs, RMSprop
    and LARS; the trust coefficient: LARS; the data's size and seed: the
    datasets they make; the bucket size: the residuals of
    error feedback with a cast, kept per fused bucket, so other buckets
    would take them): one it ignores may change."""
    if key == "momentum":
        return cfg.optimizer in ("sgd", "nesterov", "rmsprop", "lars")
    if key in ("num_samples", "data_seed"):  # (saved before they were refused where the dataset ignores them)
        from .data import SEEDED, SIZED

        return cfg.dataset in (SIZED if key == "num_samples" else SEEDED)
    if key == "fusion_bytes":
        from ..compression.names import make_compressor

        compressor = make_compressor(cfg.compression)
        return cfg.error_feedback and compressor is not None and compressor.fusable
    if key in _MODE_KEYS:
        return cfg.mode in _MODE_KEYS[key]
    if key == "data_dir":
        return cfg.dataset == "text"
    return key != "trust_coefficient" or cfg.optimizer == "lars"


def _effective(key: str, value, size: int, cfg: TrainConfig):
    """A setting as a run of ``size`` workers of ``cfg``'s model and data
    uses it: one left to its default (None) is the value it stands for, so
    giving that value on resume changes nothing -- EASGD's rate
    (TrainConfig.moving_rate) and form (sync), the model's width, the
    dataset's size, a GPT preset's shape."""
    if key == "data_dir" and value is not None:  # the same folder however it is named
        return os.path.realpath(value)
    if value is not None:
        return value
    if key == "easgd_form":
        return "sync"
    if key == "elastic_alpha":
        return TrainConfig().moving_rate(size)
    if key == "width":
        from .models import DEFAULT_WIDTH

        return DEFAULT_WIDTH.get(cfg.model)
    if key == "num_samples":
        from .data import DEFAULT_SAMPLES

        return DEFAULT_SAMPLES.get(cfg.dataset)
    if key in ("layers", "heads", "embed"):
        from .gpt import PRESETS

        return getattr(PRESETS[cfg.model], key) if cfg.model in PRESETS else None
    return None


def moved(obj, device: torch.device):
    """``obj`` (dicts, lists, tensors) with its tensors on ``device``."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: moved(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(moved(v, device) for v in obj)
    return obj


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: truncated, corrupt, or from another experiment."""


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` so that ``path`` always holds a whole checkpoint, on the disk
    (:func:`~hpcjobs._files.atomic_write`, durable: the file and its directory are flushed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.environ.get(SLOW_CKPT_ENV):  # the tests' slow file system
        print(f"hpcjobs: fault: the checkpoint's write held {os.environ[SLOW_CKPT_ENV]} s ({SLOW_CKPT_ENV})",
              file=sys.stderr, flush=True)
        time.sleep(float(os.environ[SLOW_CKPT_ENV]))
    remove_leftovers(path)  # a write a kill cut short left its temp file
    with atomic_write(path, "wb", durable=True) as f:
        torch.save(state, f)


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
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    if head != b"PK\x03\x04":  # torch.save's zip; torch.load's answer to another file is advice on weights_only
        raise CheckpointError(f"{path} is not an hpcjobs training checkpoint (not the zip file torch.save writes"
                              + (": it is empty)" if not head else f": it begins {head!r})"))
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")  # a GPU run's, too
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "model" not in state or not isinstance(state.get("version"), int):
        raise CheckpointError(f"{path} is not an hpcjobs training checkpoint (version {CHECKPOINT_VERSION})")
    if state["version"] != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is a version {state['version']} checkpoint; this hpcjobs reads version "
                              f"{CHECKPOINT_VERSION} (resume with the hpcjobs that wrote it, or start afresh)")
    return state


def config_dict(cfg: TrainConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["milestones"] = list(cfg.milestones)
    return d


def write(cfg: TrainConfig, comm, model, inner, opt, history: list[dict], epoch: int, step: int,
          partial: dict | None, scaler=None) -> bool:
    """Write a checkpoint after ``epoch`` whole epochs and ``step`` steps of
    the next (collective: every rank's own state goes to rank 0). ``scaler``:
    fp16's ``GradScaler``, whose state rank 0 saves. Nothing is written
    where a parameter is not finite on some rank (module docstring): returns
    whether it was, the same on every rank."""
    if not finite_everywhere(cfg, comm, model, epoch, step):
        return False
    mine = {"torch_rng": torch.get_rng_state(),
            "buffers": {name: buf.detach().clone() for name, buf in model.named_buffers()}}
    on = next(model.parameters()).device
    if on.type == "cuda":  # the device's own generator: QSGD's rounding, dropout on the GPU
        mine["cuda_rng"] = torch.cuda.get_rng_state(on)
    if partial is not None:
        mine["partial"] = partial
    if opt.compression is not None:  # error-feedback residuals differ by rank
        mine["compression"] = opt.compression_state_dict()
    # on the CPU: a CUDA tensor pickled to rank 0 unpickles there on the sender's device index (rank 0's own
    # GPU where each rank sees one, its neighbours' where it sees them all): P ranks' residuals on one GPU
    mine = {k: v if k == "cuda_rng" else moved(v, torch.device("cpu")) for k, v in mine.items()}
    gather_and_save(cfg, comm, model.state_dict(), inner, history, epoch, step, mine, scaler)
    return True


def finite_everywhere(cfg: TrainConfig, comm, model, epoch: int, step: int) -> bool:
    """Whether every rank's parameters are finite, the same answer on every
    rank (collective); rank 0 warns that nothing is written where not."""
    from mpi4py import MPI

    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    if not comm.allreduce(finite, op=MPI.LAND):  # the same answer on every rank: all skip the gather
        if comm.Get_rank() == 0:
            print(f"hpcjobs: warning: parameters not finite after epoch {epoch} step {step}: {cfg.checkpoint} not "
                  "written (the last one, if any, stays)", file=sys.stderr, flush=True)
        return False
    return True


def gather_and_save(cfg: TrainConfig, comm, model_state: dict, inner, history: list[dict], epoch: int, step: int,
                    mine: dict, scaler=None) -> None:
    """Rank 0 writes the checkpoint: its ``model_state`` (a state dict) and
    optimizer ``inner``, and ``mine``, each rank's own state (on the CPU),
    gathered (collective). Every rank waits for the write, watched as
    ``checkpoint_write`` (HPCJOBS_TIMEOUT): mid-epoch the others went on into
    the next step's allreduce, where a long write ended the job as a rank
    missing from it, and at an epoch's end a stalled write was never said."""
    from ..collectives.watchdog import guard

    with guard("checkpoint_write", comm):
        ranks, error = comm.gather(mine, root=0), None
        if comm.Get_rank() == 0:
            try:
                _save(cfg, model_state, inner, history, epoch, step, ranks, scaler)
            except Exception as e:  # noqa: BLE001 -- a full disk: said on every rank, not rank 0 alone
                error = f"{type(e).__name__}: {e}"
        error = comm.bcast(error, root=0)
    if error:
        raise CheckpointError(f"writing the checkpoint {cfg.checkpoint} failed on rank 0: {error}")


def _save(cfg: TrainConfig, model_state: dict, inner, history: list[dict], epoch: int, step: int, ranks: list,
          scaler) -> None:
    save_checkpoint(cfg.checkpoint, {
        "version": CHECKPOINT_VERSION, "epoch": epoch, "step": step, "config": config_dict(cfg),
        "data": opened_fingerprint(cfg), "model": model_state, "optimizer": inner.state_dict(), "history": history,
        "ranks": ranks,
        "scaler": scaler.state_dict() if scaler is not None else None, "metrics_bytes": metrics_size(cfg),
    })


def metrics_size(cfg: TrainConfig) -> int | None:
    """Where the metrics file ends as a checkpoint is written (lines after
    it are written again on resume: :func:`trim_metrics`): 0 where it is not
    written yet (a checkpoint in the first epoch); None without one, or where
    it is not a file (a pipe)."""
    if not cfg.metrics:
        return None
    if not os.path.lexists(cfg.metrics):
        return 0
    return os.path.getsize(cfg.metrics) if os.path.isfile(cfg.metrics) else None


def refuse_unseen(path: str, comm) -> None:
    """Where rank 0 found no checkpoint to resume, CheckpointError on every rank if another rank sees one:
    a checkpoint on a node's own disk, the job requeued with rank 0 elsewhere, started over without a word
    (collective)."""
    seen = [r for r, there in enumerate(comm.allgather(os.path.exists(path))) if there and r]
    if seen:
        from ..comm import ranks_text

        raise CheckpointError(f"{path}: rank 0 does not see it, which {ranks_text(seen[:8])}{',...' * (len(seen) > 8)} "
                              f"of {comm.Get_size()} "
                              f"see{'s' * (len(seen) == 1)} (a relative path is read from each rank's own "
                              "directory): put the checkpoint on a file system every rank shares, at one path")


def read(cfg: TrainConfig, model, inner, comm, scaler=None) -> tuple[int, int, list[dict], list | None]:
    """Rank 0 reads the checkpoint and the broadcasts that follow give it to
    everyone; an error is told to every rank first. ``scaler`` (fp16's
    ``GradScaler``) gets the saved scale on every rank where the checkpoint
    has one (a run without fp16, or an older checkpoint, has none: the scaler
    keeps its initial scale). Returns the epoch, the step within it, the
    history, and the per-rank states (a list on rank 0, an empty list on the
    others, for the scatter that follows; None when there is no checkpoint)."""
    state, error = None, None
    if comm.Get_rank() == 0:
        try:
            state = load_checkpoint(cfg.checkpoint)
            check_same_experiment(cfg, state, comm.Get_size())
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optimizer"])
        except FileNotFoundError:
            state = None  # nothing to resume: start from scratch
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    error = comm.bcast(error, root=0)
    if error:
        raise CheckpointError(error)
    epoch, step, history, scaled, found = comm.bcast(
        (state["epoch"], state["step"], state["history"], state.get("scaler"), True) if state
        else (0, 0, [], None, False), root=0)
    if not found:
        refuse_unseen(cfg.checkpoint, comm)
        return 0, 0, [], None
    if scaler is not None and scaled:
        scaler.load_state_dict(scaled)
    if comm.Get_rank() == 0:
        if cfg.metrics and state["config"].get("metrics") == cfg.metrics and state.get("metrics_bytes") is not None:
            trim_metrics(cfg.metrics, state["metrics_bytes"], epoch)
        if not cfg.quiet:
            where = f", step {step} of epoch {epoch + 1}" if step else ""
            print(f"# train: resumed from {cfg.checkpoint} after epoch {epoch}{where}", flush=True)
            if epoch >= cfg.epochs:  # nothing left: the last line printed is the checkpoint's, not a new run's
                print(f"# train: warning: the checkpoint is at epoch {epoch} and --epochs is {cfg.epochs}: no epoch "
                      "is left to run (give a larger --epochs to go on)", file=sys.stderr, flush=True)
    return epoch, step, history, state["ranks"] if comm.Get_rank() == 0 else []


def check_same_experiment(cfg: TrainConfig, state: dict, size: int) -> None:
    """CheckpointError where the checkpoint ``state`` is of another
    experiment than ``cfg`` on ``size`` ranks (a setting of
    :data:`_RESUME_KEYS` the run uses changed, or the ranks); a warning on
    stderr where only the schedule changed."""
    old, new = state["config"], config_dict(cfg)
    defaults = config_dict(TrainConfig())  # for keys older checkpoints do not have
    workers = size - cfg.servers if cfg.mode == "easgd" and cfg.easgd_form == "async" else size  # EASGD's default rate
    if len(state["ranks"]) != size:  # first: a per-rank batch it changes is not what the user changed
        raise CheckpointError(f"{cfg.checkpoint} holds the state of {len(state['ranks'])} ranks; "
                              f"this run has {size}")
    changed = [k for k in _RESUME_KEYS if _effective(k, old.get(k, defaults[k]), workers, cfg)
               != _effective(k, new.get(k), workers, cfg) and _used(k, cfg)]
    # fp16 keeps error feedback's residuals in loss-scale units (2**16 and more): resumed without it they
    # would be added unscaled, and with it unscaled ones would be taken as scaled
    if cfg.error_feedback and (old.get("amp", "none") == "fp16") != (cfg.amp == "fp16"):
        changed.append("amp")
    if changed:
        raise CheckpointError(f"{cfg.checkpoint} is from another experiment: "
                              + ", ".join(f"{k} {old.get(k)!r} -> {getattr(cfg, k)!r}" for k in changed))
    data = opened_fingerprint(cfg)  # (checkpoints before 2026-12-01 have none)
    if state.get("data") and data and state["data"] != data:
        raise CheckpointError(f"{cfg.checkpoint} was trained on other {cfg.dataset} data than this run opened "
                              f"(fingerprint {state['data'][:12]}, now {data[:12]}): its files changed"
                              + (", or the default corpus is another hpcjobs version's source"
                                 if cfg.dataset == "text" and cfg.data_dir is None else "")
                              + "; resume on the data it was trained on, or start afresh")
    _warn_schedule_changes(cfg, old, defaults, size)


def _warn_schedule_changes(cfg: TrainConfig, old: dict, defaults: dict, size: int) -> None:
    """Say on stderr which of :data:`_SCHEDULE_KEYS` the resumed run changed
    (those either run's schedule uses: ``gamma`` and ``milestones`` with step
    decay, ``final_lr`` and ``epochs`` with cosine, ``warmup_epochs`` with a
    warmup; ``base_batch`` left out is the global batch, the same in both)."""
    new = config_dict(cfg)
    old = dict(old)
    for d in (old, new):
        if d.get("base_batch") is None:  # the batch the mode scales its rate to (async: one worker's)
            d["base_batch"] = cfg.global_batch(cfg.scheduled_ranks(size))
    decays = {old.get("decay", defaults["decay"]), cfg.decay}
    unused = {"gamma": "step" not in decays, "milestones": "step" not in decays, "final_lr": "cosine" not in decays,
              "epochs": "cosine" not in decays,
              "warmup_epochs": {old.get("warmup", defaults["warmup"]), cfg.warmup} == {"none"}}
    changed = [k for k in _SCHEDULE_KEYS if old.get(k, defaults[k]) != new[k] and not unused.get(k, False)]
    if changed:
        print(f"hpcjobs: warning: resuming {cfg.checkpoint} with another schedule ("
              + ", ".join(f"{k} {old.get(k, defaults[k])!r} -> {new[k]!r}" for k in changed)
              + "): the resumed run is not the run that was saved", file=sys.stderr, flush=True)


def trim_metrics(path: str, size: int, epoch: int) -> None:
    """Cut the metrics file ``path`` back to ``size`` bytes, where it ended
    when the checkpoint (after ``epoch`` epochs) was written: a run killed
    between an epoch's line and its checkpoint wrote a line that the resumed
    run writes again. Only where what follows is this run's lines of later
    epochs; anything else (the file replaced, another writer) is left, and
    said."""
    try:
        with open(path, "rb") as f:
            f.seek(size)
            tail = f.read()
    except OSError:
        return
    if not tail:
        return
    try:
        records = [json.loads(line) for line in tail.decode().splitlines()]
        ours = all(isinstance(r, dict) and isinstance(r.get("epoch"), int) and r["epoch"] > epoch for r in records)
    except ValueError:
        ours = False
    if not ours:
        print(f"hpcjobs: warning: {path} holds more than this run had written when its checkpoint was (after "
              f"epoch {epoch}), and not only its later epochs: left as it is", file=sys.stderr, flush=True)
        return
    os.truncate(path, size)
    print(f"# train: dropped {len(records)} line(s) after epoch {epoch} from {path}: written after the checkpoint, "
          "and written again now", file=sys.stderr, flush=True)
