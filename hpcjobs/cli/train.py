"""``hpcjobs train``: data-parallel training on our collectives
(:func:`hpcjobs.training.loop.train`).

    mpirun -n 4 hpcjobs train --dataset mnist1d --num-samples 40000 --model cnn1d \\
        --batch-per-rank 64 --lr 0.05 --base-batch 32 --warmup gradual --epochs 20 \\
        --metrics results/train.jsonl --checkpoint results/train.pt --resume

Its flags are :class:`~hpcjobs.training.config.TrainConfig`'s fields, named
alike, with its defaults.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..collectives import ALGORITHMS
from ..compression.names import COMPRESSIONS, make_compressor
from ..convergence import LOSS_MODELS
from ..training.config import (AMP, EASGD_FORMS, GPT_MODELS, IMAGE_MODELS, MODELS, MODES, NONFINITE, OPTIMIZERS,
                               OVERLAPS, TrainConfig, parse_straggler)
from ..runtime import DEVICES
from ..training.data import DATASETS
from ..training.schedule import DECAYS, WARMUPS
from .args import (UsageError, check_amp, check_outputs, dataclass_values, nonnegative_float, nonnegative_int,
                   parse_bytes, positive_float, positive_int, seed_int, usage)

DEFAULTS = TrainConfig()


def _milestones(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"milestones are comma-separated epochs, got {text!r}") from None


def _checked_by(check):
    """An argparse type: the text itself, if ``check(text)`` raises no ValueError (its message is the error)."""
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    return parse


compression_spec = _checked_by(make_compressor)  # ``spec`` if it names a compressor
_straggler = _checked_by(parse_straggler)


def fill_experiment_samples(args) -> None:
    """An experiment's own sample count (:func:`add_model_data_arguments`' ``num_samples``), where none was given
    and the dataset takes one (the others refuse a count)."""
    from ..training.data import SIZED

    if args.num_samples is None and args.dataset in SIZED and args.dataset != "text":  # (text: its whole corpus)
        args.num_samples = args.experiment_samples


def add_model_data_arguments(p: argparse.ArgumentParser, num_samples: int | None = None) -> None:
    """Model and data flags, shared with the experiments (``num_samples``: theirs for mnist1d, synthetic, text)."""
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=MODELS + IMAGE_MODELS + GPT_MODELS, default=DEFAULTS.model,
                   help="default: %(default)s; resnet18/resnet50 on cifar10, gpt-mini/gpt2-small on text")
    g.add_argument("--width", type=positive_int, help="hidden units (mlp, default 256) or channels (cnn1d, default 32)")
    g.add_argument("--batch-norm", action="store_true", help="BatchNorm after hidden layers (per-worker statistics)")
    g.add_argument("--dataset", choices=DATASETS, default=DEFAULTS.dataset, help="default: %(default)s")
    g.add_argument("--data-dir", metavar="DIR",
                   help="mnist/cifar10 files; mnist1d cache (default $HPCJOBS_DATA_DIR, else "
                        "$XDG_CACHE_HOME/hpcjobs, else ~/.cache/hpcjobs); text: "
                        "the files to read (default: hpcjobs' own source); not for digits, synthetic")
    g.add_argument("--num-samples", type=positive_int,
                   help=(f"mnist1d samples to generate (tens) and synthetic size (default {num_samples} for both)"
                         if num_samples else "mnist1d samples to generate (tens; default 5000, 80%% train), synthetic "
                         "size (default 8192)") + ", text sequences (default: the whole corpus); not for digits, "
                        "mnist, cifar10")
    if num_samples:
        p.set_defaults(experiment_samples=num_samples)  # given where the dataset takes it: fill_experiment_samples
    g.add_argument("--data-seed", type=seed_int, default=DEFAULTS.data_seed,
                   help="seed of the generated data (mnist1d, synthetic) or of digits' split (default: %(default)s)")
    g.add_argument("--seq-len", type=positive_int, default=DEFAULTS.seq_len,
                   help="text: tokens (bytes) per sample (default %(default)s)")
    g.add_argument("--layers", type=positive_int, help="GPT blocks (default: the preset's, 6 or 12)")
    g.add_argument("--heads", type=positive_int, help="GPT attention heads (default: the preset's, 6 or 12)")
    g.add_argument("--embed", type=positive_int, help="GPT width, a multiple of --heads (default 384 or 768)")
    g.add_argument("--device", choices=DEVICES, default=DEFAULTS.device,
                   help="auto: this rank's GPU (by local rank) when every rank sees one, else the CPU; cuda: "
                        "fail without one (default: %(default)s)")
    g.add_argument("--amp", choices=AMP, default=DEFAULTS.amp,
                   help="mixed precision: bf16 (autocast); fp16 (autocast and a GradScaler) is for GPUs and refused "
                        "on CPUs (default none)")


def add_optim_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=DEFAULTS.optimizer,
                   help="default: %(default)s (with --momentum)")
    g.add_argument("--lr", type=positive_float, default=DEFAULTS.lr,
                   help="rate for --base-batch samples (default %(default)s)")
    g.add_argument("--base-batch", type=positive_int,
                   help="the batch --lr is tuned for; the rate is scaled by global/base (linear scaling rule). "
                        "Default: the global batch (no scaling)")
    g.add_argument("--momentum", type=nonnegative_float, default=DEFAULTS.momentum, help="default: %(default)s")
    g.add_argument("--weight-decay", type=nonnegative_float, default=DEFAULTS.weight_decay,
                   help="default: %(default)s")
    g.add_argument("--no-decay-bn-bias", action="store_true",
                   help="no weight decay on biases and normalization layers (every parameter of fewer than 2 dims: "
                   "BatchNorm, LayerNorm); LARS also steps them without its trust ratio")
    g.add_argument("--trust-coefficient", type=positive_float, default=DEFAULTS.trust_coefficient,
                   help="LARS eta (default %(default)s)")
    g.add_argument("--warmup", choices=WARMUPS, default=DEFAULTS.warmup, help="default: %(default)s")
    g.add_argument("--warmup-epochs", type=nonnegative_float, default=DEFAULTS.warmup_epochs,
                   help="default: %(default)s")
    g.add_argument("--decay", choices=DECAYS, default=DEFAULTS.decay, help="after warmup (default: %(default)s)")
    g.add_argument("--milestones", type=_milestones, default=DEFAULTS.milestones,
                   help="step decay epochs, e.g. 30,60,80")
    g.add_argument("--gamma", type=positive_float, default=DEFAULTS.gamma,
                   help="step decay factor (default %(default)s)")
    g.add_argument("--final-lr", type=nonnegative_float, default=DEFAULTS.final_lr,
                   help="the rate cosine decay ends at (default %(default)s)")
    g.add_argument("--no-momentum-correction", dest="momentum_correction", action="store_false",
                   help="emulate the uncorrected v <- m*v + lr*g momentum when the rate changes (ablation)")


def add_comm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("communication")
    g.add_argument("--algorithm", choices=("auto",) + ALGORITHMS, default=DEFAULTS.algorithm,
                   help="allreduce (default: %(default)s)")
    g.add_argument("--compression", type=compression_spec, default=DEFAULTS.compression, metavar="NAME[:PARAM]",
                   help=f"gradient compression: {', '.join(COMPRESSIONS)}; topk:RATIO, randomk:RATIO (unscaled: "
                        "without --error-feedback a step moves RATIO of the gradient), qsgd:LEVELS, powersgd:RANK "
                        "(default: %(default)s)")
    g.add_argument("--error-feedback", action="store_true",
                   help="add back what compression dropped at the next step (needs --compression)")
    g.add_argument("--fusion-bytes", type=parse_bytes, default=DEFAULTS.fusion_bytes,
                   help="largest gradient bucket (default 1M)")
    g.add_argument("--overlap", choices=OVERLAPS, default=DEFAULTS.overlap,
                   help="thread: reduce buckets during backward; none: after it (default: %(default)s)")
    g.add_argument("--nonfinite", choices=NONFINITE, default=DEFAULTS.nonfinite,
                   help="when an averaged gradient holds NaN/Inf: ignore, skip the step (warn), or abort naming "
                        "the parameters (default: %(default)s; a NaN loss still ends the run after its epoch)")
    g.add_argument("--backward-passes-per-step", type=positive_int, default=DEFAULTS.backward_passes_per_step,
                   help="micro-batches accumulated locally per step (default %(default)s)")


def add_mode_arguments(p: argparse.ArgumentParser) -> None:
    """``--mode`` and its knobs (docs/algorithms.md, "Asynchronous and local SGD"); shared with experiment async."""
    g = p.add_argument_group("SGD without lockstep (--mode)")
    g.add_argument("--mode", choices=MODES, default=DEFAULTS.mode,
                   help="sync: allreduce every step; async: parameter server (the first --servers ranks serve); "
                        "local: local SGD; easgd: elastic averaging; hogwild: lock-free shared memory, one node "
                        "(default: %(default)s)")
    g.add_argument("--servers", type=positive_int,
                   help="async (and easgd --easgd-form async): server ranks, each owning an equal shard "
                        f"(default {DEFAULTS.servers})")
    g.add_argument("--staleness-bound", type=nonnegative_int, metavar="S",
                   help="async: a worker more than S pushes ahead of the slowest waits (0: lockstep; default none)")
    g.add_argument("--staleness-lr", action="store_true",
                   help="async: weigh each gradient by 1/its staleness, in the momentum buffer too (Zhang et al. 2016)")
    g.add_argument("--fixed-delay", type=nonnegative_int, metavar="K",
                   help="async, deterministic: gradient i is computed on version i-K and applied in order")
    g.add_argument("--local-steps", type=positive_int, metavar="H",
                   help=f"local: steps between averages; easgd: between elastic moves (default {DEFAULTS.local_steps})")
    g.add_argument("--post-local-epochs", type=nonnegative_int, default=DEFAULTS.post_local_epochs,
                   metavar="E", help="local: average after every step for the first E epochs (post-local SGD)")
    g.add_argument("--average-momentum", action="store_true",
                   help="local: average the momentum buffers with the parameters (twice the bytes)")
    g.add_argument("--elastic-alpha", type=positive_float, metavar="A",
                   help="easgd: moving rate, in (0, 1), and with --easgd-form sync below 2 / (workers + 1) "
                        "(default 0.9 / workers: the ranks, less the servers with --easgd-form async)")
    g.add_argument("--easgd-form", choices=EASGD_FORMS,
                   help="easgd: sync (every rank holds the center; default) or async (the first --servers ranks "
                        "hold it, each worker meets it every H steps without waiting for the others)")
    g.add_argument("--hogwild-lock", action="store_true", help="hogwild: lock each update (the baseline)")
    g.add_argument("--straggler", type=_straggler, metavar="RANK:FACTOR",
                   help="that rank's steps take FACTOR times as long (it sleeps after each), in every mode")
    g.add_argument("--peer-timeout", type=positive_float, default=DEFAULTS.peer_timeout, metavar="SEC",
                   help="async: a worker silent this long is lost and the run goes on (needs mpirun "
                        "--enable-recovery); a server silent this long ends every rank with an error "
                        "(default %(default)s)")


def configure(p: argparse.ArgumentParser) -> None:
    add_model_data_arguments(p)
    g = p.add_argument_group("batch")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--batch-per-rank", "-b", type=positive_int,
                   help=f"samples per rank per pass (default {DEFAULTS.batch_per_rank})")
    b.add_argument("--global-batch", "-B", type=positive_int,
                   help="samples per step over all ranks; must divide by ranks x passes")
    add_optim_arguments(p)
    add_comm_arguments(p)
    add_mode_arguments(p)
    g = p.add_argument_group("run")
    g.add_argument("--epochs", type=positive_int, default=DEFAULTS.epochs, help="default: %(default)s")
    g.add_argument("--seed", type=seed_int, default=DEFAULTS.seed,
                   help="model init and data order (default %(default)s)")
    g.add_argument("--threads", type=positive_int, help="torch threads per rank (default: this rank's cores)")
    g.add_argument("--metrics", metavar="PATH", help="append one JSON line per epoch here (rank 0; - or "
                   "/dev/stdout: on stdout, once; fields: docs/training.md)")
    g.add_argument("--target-loss", type=positive_float, metavar="L",
                   help="from the 4th epoch (5th with --loss-model power), each epoch's line predicts the epoch at "
                        "which the training loss reaches L (the loss model fitted to the losses so far, with a "
                        "jackknife interval): predicted_epoch, predicted_epoch_low/high (null: never, by the fit)")
    g.add_argument("--loss-model", choices=LOSS_MODELS, default=DEFAULTS.loss_model,
                   help="for --target-loss: optimus, 1/(b0*k + b1) + b2 (Peng et al. 2018), or power, "
                        "a*(k + b)^-alpha from the 2nd epoch, for losses falling faster than 1/k (default: "
                        "%(default)s; docs/results/planner.md compares them)")
    g.add_argument("--noise-scale", action="store_true",
                   help="each epoch's line gains the gradient noise scale (McCandlish et al. 2018) from the ranks' "
                        "gradients before and after averaging: noise_scale (samples), grad_sq, grad_var (2+ ranks)")
    g.add_argument("--checkpoint", metavar="PATH",
                   help="write a checkpoint here after every epoch (atomic), and at the next step after a SIGTERM "
                        "or SIGUSR1 (then stop: exit status 128 + the signal's number; modes async and easgd "
                        "--easgd-form async at their workers' next pause)")
    g.add_argument("--checkpoint-every", type=positive_int, metavar="STEPS",
                   help="also write one after every STEPS-th step of the run (counted from its start; each epoch's "
                        "end writes one too), so a killed job loses at most that")
    g.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint if it exists (start fresh if it does not)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--quiet", "-q", action="store_true", help="no per-epoch lines on stdout")


def config_from_args(args, size: int) -> TrainConfig:
    """The TrainConfig the flags describe: every field a flag of the same
    name sets, the dataclass's default for the rest; ``--global-batch``
    becomes the batch per rank.

    Raises:
        UsageError: a global batch that does not divide, or a configuration
            TrainConfig refuses.
    """
    values = dataclass_values(TrainConfig, args)
    if getattr(args, "global_batch", None) and values.get("mode", "sync") != "sync":
        raise UsageError("--global-batch is for --mode sync; give --batch-per-rank (each worker's batch)")
    if getattr(args, "global_batch", None):
        passes = values.get("backward_passes_per_step", DEFAULTS.backward_passes_per_step)
        if args.global_batch % (size * passes):
            raise UsageError(f"--global-batch {args.global_batch} does not divide by {size} ranks x {passes} passes")
        values["batch_per_rank"] = args.global_batch // (size * passes)
    mode = values.get("mode", "sync")
    served = mode == "async" or values.get("easgd_form") == "async"
    if getattr(args, "servers", None) is not None and not served:  # left at its default, it said nothing
        raise UsageError(f"--servers is for --mode async and easgd --easgd-form async, not mode {mode}")
    if getattr(args, "local_steps", None) is not None and mode not in ("local", "easgd"):
        raise UsageError(f"--local-steps is for --mode local and easgd, not mode {mode}")
    if getattr(args, "noise_scale", False) and size < 2:
        raise UsageError("--noise-scale compares one rank's gradient with the average over ranks: run 2 or more")
    with usage():
        cfg = TrainConfig(**values)
        cfg.validate()
    return cfg


def check_job(args, size: int, cpu: bool = False) -> TrainConfig:
    """What the flags alone refuse at ``size`` ranks, before torch is imported
    (a second or more of every refusal), and the run's TrainConfig; ``cpu``:
    the ranks have no GPU (``slurm render --cpu`` checks a job with it)."""
    if args.metrics == "-":  # (it wrote a file named "-")
        args.metrics = "/dev/stdout"
    if args.resume and not args.checkpoint:
        raise UsageError("--resume needs --checkpoint PATH")
    if args.checkpoint_every and not args.checkpoint:
        raise UsageError("--checkpoint-every needs --checkpoint PATH")
    if args.loss_model != DEFAULTS.loss_model and not args.target_loss:
        raise UsageError("--loss-model picks the model that predicts --target-loss: give --target-loss L")
    cfg = config_from_args(args, size)
    if cpu or args.device == "cpu":
        check_amp(args.amp, "cpu")
    return cfg


def run(args) -> int:
    from mpi4py import MPI

    from ..runtime import pick_device, set_threads

    comm = MPI.COMM_WORLD
    cfg = check_job(args, comm.Get_size())
    with usage():
        check_amp(args.amp, pick_device(args.device, comm))
    check_outputs(comm, [("--metrics", args.metrics, False), ("--checkpoint", args.checkpoint, False)])
    set_threads(args.threads, comm)

    from ..training.checkpoint import CheckpointError
    from ..training.loop import Stopped, train
    from ..training.preempt import write_stop_file
    try:
        with usage(ValueError):  # a configuration the data cannot take: raised on every rank alike
            history = train(cfg, comm)
    except (CheckpointError, FileNotFoundError) as e:
        if comm.Get_rank() == 0:
            print(f"hpcjobs train: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Stopped as e:  # SIGTERM or SIGUSR1, after the checkpoint: the status a shell gives a signal's end
        if comm.Get_rank() == 0:
            try:
                print(f"hpcjobs train: {e}", file=sys.stderr, flush=True)
                write_stop_file(e)  # for `slurm launch --requeue`, which set HPCJOBS_STOP_FILE
            except Exception as why:  # noqa: BLE001 -- whatever it was, rank 0 still meets the others below
                print(f"hpcjobs train: warning: the stop file was not written ({why}): the job is not requeued",
                      file=sys.stderr, flush=True)
        if getattr(e, "lost", False):  # the parameter server's, with a worker lost: the ranks cannot meet again
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + e.signum)
        # none leaves before rank 0 has written it: srun --kill-on-bad-exit ends the others when one exits
        comm.Barrier()
        return 128 + e.signum
    loss = history[-1].get("loss") if history else None
    diverged = isinstance(loss, float) and not math.isfinite(loss)
    if diverged:  # a failed run, -q or not (it ended 0, and under -q without a word)
        if comm.Get_rank() == 0:
            kept = (f"; {cfg.checkpoint} is not written of that epoch" if cfg.checkpoint and cfg.mode == "sync"
                    else "")
            print(f"hpcjobs train: error: the loss is {loss} after epoch {history[-1]['epoch']}: the run diverged "
                  f"(a lower --lr, or a longer warmup){kept}", file=sys.stderr, flush=True)
    elif comm.Get_rank() == 0 and history and not cfg.quiet and cfg.mode != "sync":
        last = history[-1]
        print(f"# train: mode {cfg.mode}, final test accuracy {last['test_acc']:.4f} (error "
              f"{100 * (1 - last['test_acc']):.2f}%), {last['wall_s']:.1f} s", flush=True)
    elif comm.Get_rank() == 0 and history and not cfg.quiet:
        last = history[-1]
        print(f"# train: final test accuracy {last['test_acc']:.4f} (error {100 * (1 - last['test_acc']):.2f}%), "
              f"{last['samples_per_s']:.0f} samples/s, communication {100 * last['comm_share']:.1f}% of epoch time",
              flush=True)
    if history and history[-1].get("lost_workers"):
        # MPI defines nothing once a process of the job has died; MPI_Finalize may wait for it. The run is
        # done and reported: the survivors leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if diverged else 0)
    return 1 if diverged else 0
