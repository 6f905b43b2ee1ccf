"""``hpcjobs train``: data-parallel training on our collectives.

    mpirun -n 4 hpcjobs train --dataset mnist1d --num-samples 40000 --model cnn1d \\
        --batch-per-rank 64 --lr 0.05 --base-batch 32 --warmup gradual --epochs 20 \\
        --metrics results/train.jsonl --checkpoint results/train.pt --resume
"""

from __future__ import annotations

import argparse
import sys

from ..cli import (UsageError, arguments, command, nonnegative_float, nonnegative_int, parse_bytes, positive_float,
                   positive_int)
from ..collectives import ALGORITHMS
from .data import DATASETS
from .distributed import DEFAULT_FUSION_BYTES, NONFINITE, OVERLAPS
from ..compression.names import COMPRESSIONS, check_spec
from .loop import OPTIMIZERS, TrainConfig
from .models import MODELS
from .schedule import DECAYS, WARMUPS


def _milestones(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"milestones are comma-separated epochs, got {text!r}") from None


def add_model_data_arguments(p: argparse.ArgumentParser) -> None:
    """Model and data flags, shared with ``experiment large-batch`` and ``bench train``."""
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=MODELS, default="mlp", help="default: %(default)s")
    g.add_argument("--width", type=positive_int, help="hidden units (mlp, default 256) or channels (cnn1d, default 32)")
    g.add_argument("--batch-norm", action="store_true", help="BatchNorm after hidden layers (per-worker statistics)")
    g.add_argument("--dataset", choices=DATASETS, default="mnist1d", help="default: %(default)s")
    g.add_argument("--data-dir", metavar="DIR",
                   help="mnist/cifar10 files; mnist1d cache (default $HPCJOBS_DATA_DIR or ~/.cache/hpcjobs)")
    g.add_argument("--num-samples", type=positive_int,
                   help="mnist1d samples to generate (default 5000, 80%% train) or synthetic size (default 8192)")
    g.add_argument("--data-seed", type=int, default=42, help="seed of the generated data (default: %(default)s)")


def add_optim_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="default: %(default)s (with --momentum)")
    g.add_argument("--lr", type=positive_float, default=0.1, help="rate for --base-batch samples (default 0.1)")
    g.add_argument("--base-batch", type=positive_int,
                   help="the batch --lr is tuned for; the rate is scaled by global/base (linear scaling rule). "
                        "Default: the global batch (no scaling)")
    g.add_argument("--momentum", type=nonnegative_float, default=0.9, help="default: %(default)s")
    g.add_argument("--weight-decay", type=nonnegative_float, default=0.0, help="default: %(default)s")
    g.add_argument("--no-decay-bn-bias", action="store_true", help="no weight decay on biases and BatchNorm")
    g.add_argument("--trust-coefficient", type=positive_float, default=0.001, help="LARS eta (default 0.001)")
    g.add_argument("--warmup", choices=WARMUPS, default="gradual", help="default: %(default)s")
    g.add_argument("--warmup-epochs", type=nonnegative_float, default=5.0, help="default: %(default)s")
    g.add_argument("--decay", choices=DECAYS, default="none", help="after warmup (default: %(default)s)")
    g.add_argument("--milestones", type=_milestones, default=(), help="step decay epochs, e.g. 30,60,80")
    g.add_argument("--gamma", type=positive_float, default=0.1, help="step decay factor (default 0.1)")
    g.add_argument("--no-momentum-correction", action="store_true",
                   help="emulate the uncorrected v <- m*v + lr*g momentum when the rate changes (ablation)")


def add_comm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("communication")
    g.add_argument("--algorithm", choices=("auto",) + ALGORITHMS, default="auto", help="allreduce (default: auto)")
    g.add_argument("--compression", type=check_spec, default="none", metavar="NAME[:PARAM]",
                   help=f"gradient compression: {', '.join(COMPRESSIONS)}; topk:RATIO, randomk:RATIO, "
                        "qsgd:LEVELS, powersgd:RANK (default: none)")
    g.add_argument("--error-feedback", action="store_true",
                   help="add back what compression dropped at the next step (needs --compression)")
    g.add_argument("--fusion-bytes", type=parse_bytes, default=DEFAULT_FUSION_BYTES,
                   help="largest gradient bucket (default 1M)")
    g.add_argument("--overlap", choices=OVERLAPS, default="auto",
                   help="thread: reduce buckets during backward; none: after it (default: auto)")
    g.add_argument("--nonfinite", choices=NONFINITE, default="ignore",
                   help="when an averaged gradient holds NaN/Inf: ignore, skip the step (warn), or abort naming "
                        "the parameters (default: ignore; a NaN loss still ends the run after its epoch)")
    g.add_argument("--backward-passes-per-step", type=positive_int, default=1,
                   help="micro-batches accumulated locally per step (default 1)")


def _configure(p: argparse.ArgumentParser) -> None:
    add_model_data_arguments(p)
    g = p.add_argument_group("batch")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--batch-per-rank", "-b", type=positive_int, help="samples per rank per pass (default 32)")
    b.add_argument("--global-batch", "-B", type=positive_int,
                   help="samples per step over all ranks; must divide by ranks x passes")
    add_optim_arguments(p)
    add_comm_arguments(p)
    g = p.add_argument_group("run")
    g.add_argument("--epochs", type=positive_int, default=10, help="default: %(default)s")
    g.add_argument("--seed", type=nonnegative_int, default=0, help="model init and data order (default 0)")
    g.add_argument("--threads", type=positive_int, help="torch threads per rank (default: this rank's cores)")
    g.add_argument("--metrics", metavar="PATH", help="append one JSON line per epoch here (rank 0)")
    g.add_argument("--checkpoint", metavar="PATH", help="write a checkpoint here after every epoch (atomic)")
    g.add_argument("--checkpoint-every", type=positive_int, metavar="STEPS",
                   help="also write one every STEPS steps inside an epoch, so a killed job loses at most that")
    g.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint if it exists (start fresh if it does not)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--quiet", "-q", action="store_true", help="no per-epoch lines on stdout")


def config_from_args(args, size: int, batch_per_rank: int | None = None) -> TrainConfig:
    passes = getattr(args, "backward_passes_per_step", 1)
    b = batch_per_rank or getattr(args, "batch_per_rank", None)
    if b is None and getattr(args, "global_batch", None):
        if args.global_batch % (size * passes):
            raise UsageError(f"--global-batch {args.global_batch} does not divide by {size} ranks x {passes} passes")
        b = args.global_batch // (size * passes)
    return TrainConfig(
        model=args.model, width=args.width, batch_norm=args.batch_norm, dataset=args.dataset,
        data_dir=args.data_dir, num_samples=args.num_samples, data_seed=args.data_seed,
        batch_per_rank=b or 32, backward_passes_per_step=passes, optimizer=args.optimizer, lr=args.lr,
        base_batch=args.base_batch, momentum=args.momentum, weight_decay=args.weight_decay,
        no_decay_bn_bias=args.no_decay_bn_bias, trust_coefficient=args.trust_coefficient, warmup=args.warmup,
        warmup_epochs=args.warmup_epochs, decay=args.decay, milestones=args.milestones, gamma=args.gamma,
        momentum_correction=not args.no_momentum_correction, algorithm=getattr(args, "algorithm", "auto"),
        compression=getattr(args, "compression", "none"), error_feedback=getattr(args, "error_feedback", False),
        fusion_bytes=getattr(args, "fusion_bytes", DEFAULT_FUSION_BYTES), overlap=getattr(args, "overlap", "auto"),
        nonfinite=getattr(args, "nonfinite", "ignore"),
        epochs=getattr(args, "epochs", 10), seed=getattr(args, "seed", 0),
        checkpoint=getattr(args, "checkpoint", None), checkpoint_every=getattr(args, "checkpoint_every", None) or 0,
        resume=getattr(args, "resume", False),
        metrics=getattr(args, "metrics", None), progress=not getattr(args, "no_progress", False),
        quiet=getattr(args, "quiet", False))


def set_threads(args, comm) -> int:
    import torch

    from .distributed import cores_per_rank

    n = getattr(args, "threads", None) or cores_per_rank(comm)
    torch.set_num_threads(n)
    return n


@command("train", "data-parallel training on our allreduce (MNIST-1D, digits, synthetic, MNIST, CIFAR-10)")
@arguments(_configure)
def main(args) -> int:
    from mpi4py import MPI

    from .loop import CheckpointError, train

    comm = MPI.COMM_WORLD
    if args.resume and not args.checkpoint:
        raise UsageError("--resume needs --checkpoint PATH")
    if args.checkpoint_every and not args.checkpoint:
        raise UsageError("--checkpoint-every needs --checkpoint PATH")
    cfg = config_from_args(args, comm.Get_size())
    try:
        cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    set_threads(args, comm)
    try:
        history = train(cfg, comm)
    except ValueError as e:  # a configuration the data cannot take: raised on every rank alike
        raise UsageError(str(e)) from None
    except (CheckpointError, FileNotFoundError) as e:
        if comm.Get_rank() == 0:
            print(f"hpcjobs train: error: {e}", file=sys.stderr, flush=True)
        return 1
    if comm.Get_rank() == 0 and history and not cfg.quiet:
        last = history[-1]
        print(f"# train: final test accuracy {last['test_acc']:.4f} (error {100 * (1 - last['test_acc']):.2f}%), "
              f"{last['samples_per_s']:.0f} samples/s, communication {100 * last['comm_share']:.1f}% of epoch time",
              flush=True)
    return 0
