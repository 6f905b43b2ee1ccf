"""What a training run is made of: :class:`TrainConfig`, and the names and
defaults its fields take.

Apart from the loop so that the command line can read the defaults and
offer the names without starting MPI or importing torch (``hpcjobs slurm
render train -- ...`` checks a job's flags on a login node): ``hpcjobs
train``'s flags are these fields, and their defaults are these defaults.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field

from ..collectives.names import ALGORITHMS, MESSAGE_ALGORITHMS
from ..compression.names import make_compressor
from ..convergence import LOSS_MODELS
from ..runtime import DEVICES
from . import schedule

__all__ = ["TrainConfig", "MODES", "EASGD_FORMS", "MODELS", "IMAGE_MODELS", "GPT_MODELS", "AMP", "OPTIMIZERS",
           "OVERLAPS", "NONFINITE", "DEFAULT_FUSION_BYTES", "DEFAULT_WIDTH"]

# sync: allreduce every step (the loop); the others are hpcjobs.training.paramserver (async) and
# hpcjobs.training.averaging (local, easgd, hogwild): docs/algorithms.md, "Asynchronous and local SGD"
MODES = ("sync", "async", "local", "easgd", "hogwild")
EASGD_FORMS = ("sync", "async")  # async: the first S ranks serve the center, as the parameter server's shards
ASYNC_OPTIMIZERS = ("sgd", "adagrad")  # what a parameter server applies per shard (Downpour: Adagrad)
# experiment async's rows (hpcjobs.training.async_experiment): (name, mode, overrides). "post-local" averages
# every step for the first quarter of the epochs; "+ momentum avg" averages the momentum buffers with the
# parameters (twice the bytes); the "2x epochs" rows train twice as long (their schedule
# stretched alike), to see whether and when they reach the target
ASYNC_ROWS = (
    ("sync", "sync", {}),
    ("async", "async", {}),
    ("async + staleness lr", "async", {"staleness_lr": True}),
    ("async 2x epochs", "async", {"epochs": "double"}),
    ("async + staleness lr 2x epochs", "async", {"staleness_lr": True, "epochs": "double"}),
    ("async bound s=2", "async", {"staleness_bound": 2}),
    ("async bound s=8", "async", {"staleness_bound": 8}),
    ("hogwild", "hogwild", {}),
    ("hogwild + lock", "hogwild", {"hogwild_lock": True}),
    ("local H=4", "local", {"local_steps": 4}),
    ("local H=8", "local", {"local_steps": 8}),
    ("local H=16", "local", {"local_steps": 16}),
    ("local H=8 + momentum avg", "local", {"local_steps": 8, "average_momentum": True}),
    ("post-local H=8", "local", {"local_steps": 8, "post_local_epochs": "quarter"}),
    ("easgd tau=4", "easgd", {"local_steps": 4}),
    ("easgd async tau=4", "easgd", {"local_steps": 4, "easgd_form": "async"}),
)


def async_row_names() -> list[str]:
    return [name for name, _, _ in ASYNC_ROWS]


MODELS = ("mlp", "cnn1d")  # hpcjobs.training.models builds them
DEFAULT_WIDTH = {"mlp": 256, "cnn1d": 32}  # hidden units, channels: --width left out (train, plan)
# torchvision's ResNets (hpcjobs.training.resnet), on 3-channel square images;
# bench train measures them on random images, as Horovod's synthetic benchmark does
IMAGE_MODELS = ("resnet18", "resnet50")
# GPT-style decoders (hpcjobs.training.gpt's presets), on random tokens in bench train
GPT_MODELS = ("gpt-mini", "gpt2-small")
# mixed precision: torch.autocast to bfloat16, or to float16 with a GradScaler
AMP = ("none", "bf16", "fp16")
MIN_IMAGE_SIZE = 32  # below it the last stage sees 1x1 maps; BatchNorm needs more than one value
OPTIMIZERS = ("sgd", "nesterov", "adam", "adagrad", "adadelta", "rmsprop", "lars")
# DistributedOptimizer's options (hpcjobs.training.distributed).
OVERLAPS = ("auto", "thread", "none")
NONFINITE = ("ignore", "skip", "abort")
# Horovod fuses up to 64 MiB and DDP starts at 25 MiB, both tuned for GPUs
# and large models. On CPU ranks the models are small; 1 MiB buckets still
# amortise the per-message latency and leave several buckets to overlap.
DEFAULT_FUSION_BYTES = 1 << 20


@dataclass
class TrainConfig:
    """One training run. ``lr`` is the rate for ``base_batch`` samples; the
    schedule scales it linearly to the global batch (``base_batch=None``
    means the global batch, i.e. no scaling)."""

    model: str = "mlp"
    width: int | None = None
    batch_norm: bool = False
    # the GPTs: their shape (None: the preset's) and the text dataset's sequences
    layers: int | None = None
    heads: int | None = None
    embed: int | None = None
    seq_len: int = 128
    amp: str = "none"
    device: str = "auto"  # auto (this rank's GPU if every rank has one, else the CPU), cpu or cuda
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
    target_loss: float | None = None  # predict the epoch the training loss reaches it (hpcjobs.convergence)
    loss_model: str = "optimus"  # the model that predicts it: hpcjobs.convergence.LOSS_MODELS
    noise_scale: bool = False  # estimate the gradient noise scale every epoch (hpcjobs.convergence.noise_scale)
    progress: bool = True
    quiet: bool = False
    # SGD without lockstep (mode != "sync")
    mode: str = "sync"
    servers: int = 1  # async: the first S ranks serve a shard of the parameters each
    staleness_bound: int | None = None  # async: a worker more than s pushes ahead of the slowest waits
    staleness_lr: bool = False  # async: each gradient weighed by 1/its staleness (Zhang et al. 2016)
    fixed_delay: int | None = None  # async: gradient i is computed on version i - k, applied in order i
    local_steps: int = 8  # local: steps between averages; easgd: between elastic moves
    post_local_epochs: int = 0  # local: average every step for this many epochs first (Lin et al. 2020)
    average_momentum: bool = False  # local: average the momentum buffers too (Yu, Jin, Yang 2019); 2x the bytes
    elastic_alpha: float | None = None  # easgd: the moving rate (default 0.9 / workers)
    easgd_form: str | None = None  # easgd: "sync" (the default: one allreduce every tau steps) or "async"
    hogwild_lock: bool = False  # hogwild: a lock around each update (the baseline Hogwild! drops)
    straggler: str | None = None  # "RANK:FACTOR": that rank's steps take FACTOR times as long
    peer_timeout: float = 60.0  # async: seconds of silence before a worker is lost / a server presumed dead

    def moving_rate(self, workers: int) -> float:
        """EASGD's alpha: ``elastic_alpha``, or 0.9 / workers (Zhang et al.'s beta = W alpha = 0.9)."""
        return self.elastic_alpha or 0.9 / workers

    def scheduled_ranks(self, size: int) -> int:
        """The ranks whose batch the learning rate is scaled to, in a run of
        ``size``: every rank (sync, local, easgd), one worker's (async and
        hogwild update with one worker's gradient), or the workers' (async
        EASGD, beside its servers)."""
        if self.mode in ("async", "hogwild"):
            return 1
        return size - self.servers if self.mode == "easgd" and self.easgd_form == "async" else size

    def mode_schedule(self, size: int) -> schedule.ScheduleConfig:
        """The schedule this mode's updates follow in a run of ``size`` ranks:
        for ``scheduled_ranks(size)``'s batch, async and Hogwild! warming up
        as the synchronous step of their W workers does (:meth:`schedule`)."""
        sync = {"async": size - self.servers, "hogwild": size}.get(self.mode)
        return self.schedule(self.scheduled_ranks(size), sync)

    def global_batch(self, size: int) -> int:
        return self.batch_per_rank * self.backward_passes_per_step * size

    def schedule(self, size: int, sync_size: int | None = None) -> schedule.ScheduleConfig:
        """The rate's schedule for updates of ``size`` ranks' batches.

        ``sync_size``: the ranks of the synchronous step whose samples
        ``sync_size / size`` of these updates carry (async and Hogwild!: one
        worker's update, W workers). The warmup then starts where that step's
        does, scaled by the ratio of the two peaks, so that with a shared
        ``base_batch`` the rate per sample is sync's through the warmup as
        after it (without one, each is its own per-update rate and neither
        warms up)."""
        gb = self.global_batch(size)
        own = schedule.ScheduleConfig(base_lr=self.lr, base_batch=self.base_batch or gb, global_batch=gb,
                                      warmup=self.warmup, warmup_epochs=self.warmup_epochs, decay=self.decay,
                                      epochs=self.epochs, milestones=self.milestones or (), gamma=self.gamma,
                                      final_lr=self.final_lr)
        if sync_size is None or sync_size == size:
            return own
        sync = self.schedule(sync_size)
        peak = schedule.scaled_lr(own.base_lr, own.base_batch, own.global_batch)
        sync_peak = schedule.scaled_lr(sync.base_lr, sync.base_batch, sync.global_batch)
        return dataclasses.replace(own, warmup_from=min(sync.base_lr, sync_peak) * peak / sync_peak)

    def __post_init__(self) -> None:
        # numpy scalars (a rate from np.linspace) as Python numbers: the history, the optimizer's groups and the
        # checkpoint take them from here, and a checkpoint read with weights_only refused them
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "item") and type(value).__module__ == "numpy":
                setattr(self, f.name, value.item())
        if isinstance(self.milestones, (list, tuple)):
            self.milestones = type(self.milestones)(m.item() if type(m).__module__ == "numpy" else m
                                                    for m in self.milestones)

    def validate(self) -> None:
        if self.model not in MODELS + IMAGE_MODELS + GPT_MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from "
                             f"{', '.join(MODELS + IMAGE_MODELS + GPT_MODELS)}")
        shaped = [f for f in ("layers", "heads", "embed") if getattr(self, f) is not None]
        if shaped and self.model not in GPT_MODELS:
            raise ValueError(f"{shaped[0]} shapes the GPTs ({', '.join(GPT_MODELS)}), not {self.model}")
        if self.model not in MODELS and (self.width is not None or self.batch_norm):  # ignored there, silently
            raise ValueError(f"{'width' if self.width is not None else 'batch_norm'} shapes {' and '.join(MODELS)},"
                             f" not {self.model} (the ResNets always have BatchNorm, the GPTs LayerNorm)")
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; choose from {', '.join(DEVICES)}")
        if self.amp not in AMP:
            raise ValueError(f"unknown amp {self.amp!r}; choose from {', '.join(AMP)}")
        if self.amp == "fp16" and self.nonfinite != "ignore":
            raise ValueError("amp fp16's GradScaler skips the steps whose gradients overflow; nonfinite "
                             f"{self.nonfinite!r} would act on them first: leave nonfinite at 'ignore'")
        if self.algorithm not in ("auto", *ALGORITHMS):  # (DistributedOptimizer's: cuda_ipc only through auto)
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose from auto, {', '.join(ALGORITHMS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
        if make_compressor(self.compression) is None:
            if self.error_feedback:
                raise ValueError("error feedback needs a compression")
        elif self.noise_scale:
            raise ValueError("the noise scale needs uncompressed gradients (the exact average of the ranks')")
        elif self.algorithm != "auto" and self.algorithm not in MESSAGE_ALGORITHMS:
            raise ValueError(f"compressed gradients need a message-passing algorithm (auto or "
                             f"{', '.join(MESSAGE_ALGORITHMS)}), got {self.algorithm!r}")
        for name in ("batch_per_rank", "backward_passes_per_step", "epochs", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_per_rank == 1 and (self.model in IMAGE_MODELS or (self.model == "mlp" and self.batch_norm)):
            raise ValueError(f"model {self.model}{' with batch_norm' if self.batch_norm else ''} normalizes over "
                             "the batch, and one sample per rank gives BatchNorm one value per channel (its last "
                             "layer's): give batch_per_rank 2 or more")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, used, by in (("momentum", self.optimizer not in ("adam", "adagrad", "adadelta"),
                                "the SGDs, RMSprop and LARS"),
                               ("trust_coefficient", self.optimizer == "lars", "LARS"),
                               ("gamma", self.decay == "step", "decay step")):
            if not used and getattr(self, name) != defaults[name]:  # set, and ignored
                raise ValueError(f"{name} is taken by {by} only: {self.optimizer} with decay {self.decay} would "
                                 "ignore it")
        if self.warmup == "none" and self.warmup_epochs != defaults["warmup_epochs"]:  # set, and ignored
            raise ValueError("warmup_epochs is the length of a gradual or constant warmup; warmup none has "
                             "none: leave warmup_epochs out")
        if not self.momentum_correction and (self.optimizer in ("adam", "adagrad", "adadelta") or not self.momentum):
            keeps = self.optimizer if self.momentum else f"{self.optimizer} with momentum 0"
            raise ValueError(f"momentum_correction rescales a momentum buffer when the rate changes; {keeps} keeps "
                             "none: leave momentum_correction on")
        from .data import SEEDED, SIZED, check_mnist1d_samples

        check_mnist1d_samples(self.dataset, self.num_samples)

        if self.num_samples is not None and self.dataset not in SIZED:  # ignored there, silently
            raise ValueError(f"num_samples sizes {', '.join(SIZED)}; {self.dataset} is used as it comes: leave "
                             "num_samples out")
        # in every mode (the modes without lockstep had fed an MLP the text's tokens: a traceback mid-run)
        if self.model in GPT_MODELS and self.dataset != "text":
            raise ValueError(f"{self.model} is a language model: it trains on the text dataset")
        if self.dataset == "text" and self.model not in GPT_MODELS:
            raise ValueError(f"the text dataset is for the GPTs ({', '.join(GPT_MODELS)}), not {self.model}")
        if self.seq_len != defaults["seq_len"] and self.dataset != "text":  # ignored, and then refused on resume
            raise ValueError(f"seq_len cuts the text dataset's sequences; {self.dataset} has none: leave seq_len out")
        if self.data_dir is not None and self.dataset in ("digits", "synthetic"):  # ignored
            raise ValueError(f"data_dir is where a dataset's files are; {self.dataset} is made in memory: leave "
                             "data_dir out")
        if self.data_seed != defaults["data_seed"] and self.dataset not in SEEDED:
            raise ValueError(f"data_seed generates or splits {', '.join(SEEDED)}; {self.dataset} comes split: leave "
                             "data_seed out")
        if self.final_lr != 0.0 and self.decay != "cosine":
            raise ValueError(f"final_lr is where cosine decay ends, and decay is {self.decay!r}: give decay cosine "
                             "or leave final_lr out")
        if self.resume and not self.checkpoint:
            raise ValueError("resume needs a checkpoint path")
        if self.loss_model not in LOSS_MODELS:
            raise ValueError(f"unknown loss model {self.loss_model!r}; choose from {', '.join(LOSS_MODELS)}")
        if self.loss_model != "optimus" and not self.target_loss:
            raise ValueError("loss_model picks the model that predicts target_loss: give a target_loss")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 steps, got {self.checkpoint_every}")
        if self.checkpoint_every and not self.checkpoint:
            raise ValueError("checkpoint_every needs a checkpoint path")
        self.schedule(1)  # validates the schedule fields
        self._validate_mode()

    def _validate_mode(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.straggler is not None:
            parse_straggler(self.straggler)
        if (self.decay == "step") != bool(self.milestones):  # either alone did nothing, silently
            raise ValueError("decay step multiplies the rate by gamma at each of milestones (e.g. 30,60,80): "
                             "give both or neither")
        knobs = {"async": ("staleness_bound", "staleness_lr", "fixed_delay"),
                 "local": ("post_local_epochs", "average_momentum"), "easgd": ("elastic_alpha", "easgd_form"),
                 "hogwild": ("hogwild_lock",)}
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for mode, names in knobs.items():
            for name in names:  # set to anything but its default (staleness_bound 0 too: it was ignored)
                if self.mode != mode and getattr(self, name) != defaults[name]:
                    raise ValueError(f"{name} is a knob of mode {mode}, not {self.mode}")
        if self.mode == "sync":
            if self.peer_timeout != TrainConfig.peer_timeout:
                raise ValueError("peer_timeout is the parameter servers' (mode async, easgd --easgd-form async): "
                                 "mode sync would ignore it")
            return
        refused = [(self.compression != "none", "compression"), (self.backward_passes_per_step != 1,
                   "backward_passes_per_step"), (self.noise_scale, "noise_scale"), (self.amp != "none", "amp"),
                   (self.device == "cuda", "device cuda"), (self.batch_norm, "batch_norm"),
                   (self.model not in MODELS, f"model {self.model}"), (self.target_loss is not None, "target_loss"),
                   (self.nonfinite != "ignore", "nonfinite")]
        for bad, name in refused:
            if bad:
                raise ValueError(f"mode {self.mode} trains {' or '.join(MODELS)} without BatchNorm, uncompressed, "
                                 f"one pass per step, on CPUs, without target-loss predictions or nonfinite checks: "
                                 f"{name} is for mode sync")
        served = self.mode == "async" or self.easgd_form == "async"
        self._refuse_ignored(served)
        if self.straggler is not None and served and parse_straggler(self.straggler)[0] < self.servers:
            raise ValueError(f"straggler {self.straggler}: rank {parse_straggler(self.straggler)[0]} is a server in "
                             f"mode {self.mode} (the first {self.servers} rank(s) serve; they compute no steps): "
                             "name a worker's rank")
        if self.mode in ("async", "hogwild") and self.optimizer not in ASYNC_OPTIMIZERS[:1 + (self.mode == "async")]:
            raise ValueError(f"mode {self.mode} applies {' or '.join(ASYNC_OPTIMIZERS[:1 + (self.mode == 'async')])}"
                             f" updates itself, not {self.optimizer}")
        for name, low in (("servers", 1), ("local_steps", 1), ("post_local_epochs", 0), ("staleness_bound", 0),
                          ("fixed_delay", 0)):
            v = getattr(self, name)
            if v is not None and v < low:
                raise ValueError(f"{name} must be >= {low}, got {v}")
        if self.fixed_delay is not None and (self.staleness_bound is not None or self.staleness_lr):
            raise ValueError("fixed_delay fixes every gradient's staleness: no staleness_bound or staleness_lr")
        if self.average_momentum and (self.optimizer not in ("sgd", "nesterov") or not self.momentum > 0):
            raise ValueError("average_momentum averages SGD's momentum buffers: optimizer sgd or nesterov with "
                             f"momentum > 0, not {self.optimizer} with momentum {self.momentum}")
        if self.easgd_form not in (None, *EASGD_FORMS):
            raise ValueError(f"unknown easgd_form {self.easgd_form!r}; choose from {', '.join(EASGD_FORMS)}")
        if self.elastic_alpha is not None and not 0 < self.elastic_alpha < 1:
            raise ValueError(f"elastic_alpha must be in (0, 1), got {self.elastic_alpha}")
        if not self.peer_timeout > 0:
            raise ValueError(f"peer_timeout must be > 0 seconds, got {self.peer_timeout}")


    def _refuse_ignored(self, served: bool) -> None:
        """A mode without lockstep refuses the flags it would ignore (set to
        anything but their defaults): the optimizer's buckets, the
        parameter servers' timeout elsewhere, and where the servers or
        Hogwild! apply the updates themselves, the collective and the
        optimizer's refinements they do not apply."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        applied_here = self.mode == "hogwild" or (served and self.mode == "async")  # not torch's optimizer
        ignored = [("fusion_bytes", True, "buckets the gradients of mode sync"),
                   ("overlap", True, "overlaps mode sync's reductions with backward"),
                   ("peer_timeout", not served, "is the parameter servers' (mode async, easgd --easgd-form async)"),
                   ("algorithm", served or self.mode == "hogwild",
                    "picks the allreduce of modes sync, local and easgd (sync form)"),
                   ("no_decay_bn_bias", applied_here, "is torch's optimizer's, which the servers and Hogwild! "
                                                      "do not run (they decay every parameter)"),
                   ("momentum_correction", applied_here, "is torch's optimizer's, which the servers and Hogwild! "
                                                         "do not run")]
        for name, bad, what in ignored:
            if bad and getattr(self, name) != defaults[name]:
                raise ValueError(f"{name} {what}: mode {self.mode}"
                                 f"{' (async form)' if self.mode == 'easgd' and served else ''} would ignore it")
        if self.mode in ("local", "easgd") and not served and self.algorithm not in ("auto", *MESSAGE_ALGORITHMS):
            raise ValueError(f"mode {self.mode} averages with a message-passing algorithm (auto or "
                             f"{', '.join(MESSAGE_ALGORITHMS)}): its bytes are counted; got {self.algorithm!r}")


def parse_straggler(spec: str) -> tuple[int, float]:
    """``"RANK:FACTOR"`` as (rank, factor): that rank's steps take FACTOR (>= 1) times as long."""
    try:
        rank, factor = spec.split(":")
        rank, factor = int(rank), float(factor)
    except ValueError:
        raise ValueError(f"straggler is RANK:FACTOR, e.g. 1:3, got {spec!r}") from None
    if rank < 0 or not factor >= 1:
        raise ValueError(f"straggler {spec!r}: RANK must be >= 0 and FACTOR >= 1")
    return rank, factor
