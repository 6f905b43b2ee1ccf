"""``hpcjobs experiment large-batch``: Goyal et al.'s large-minibatch table on
MNIST-1D (:mod:`hpcjobs.training.experiment`).

    mpirun -n 2 hpcjobs experiment large-batch --out results/large-batch
"""

from __future__ import annotations

import sys
from pathlib import Path

from .._files import write_text
from .._plots import MISSING
from ..training.schedule import WARMUPS
from .args import (UsageError, check_amp, check_outputs, comma_list, dataclass_values, nonnegative_float,
                   positive_float, positive_int, usage)
from .train import add_comm_arguments, add_model_data_arguments, fill_experiment_samples


def configure(p) -> None:
    add_model_data_arguments(p, num_samples=20000)
    # Tuned here (docs/results/large-batch.md, "Test error against global batch"): the 1-D CNN at lr 0.02 per
    # 32 samples is near the largest stable rate at the base batch, which is where warmup matters.
    p.set_defaults(model="cnn1d")
    g = p.add_argument_group("grid")
    g.add_argument("--min-batch", type=positive_int, default=32, help="smallest global batch (default 32)")
    g.add_argument("--max-batch", type=positive_int, default=4096, help="largest, reached by doubling (default 4096)")
    g.add_argument("--base-batch", type=positive_int, help="the batch --lr is for (default: --min-batch)")
    g.add_argument("--warmups", type=comma_list, default=list(WARMUPS),
                   help="comma-separated subset of none,constant,gradual (default: all)")
    g.add_argument("--seeds", type=positive_int, default=3, help="seeds per cell (default 3)")
    g.add_argument("--epochs", type=positive_int, default=20, help="every run trains this long (default 20)")
    g.add_argument("--lr", type=positive_float, default=0.02, help="rate at the base batch (default 0.02)")
    g.add_argument("--momentum", type=nonnegative_float, default=0.9, help="default: %(default)s")
    g.add_argument("--weight-decay", type=nonnegative_float, default=0.0, help="default: %(default)s")
    g.add_argument("--warmup-epochs", type=nonnegative_float, default=5.0, help="default: %(default)s (Goyal)")
    add_comm_arguments(p)
    g.add_argument("--threads", type=positive_int, help="torch threads per rank (default: this rank's cores)")
    g.add_argument("--out", "-O", default="results/large-batch", metavar="DIR",
                   help="runs.jsonl, table.md and PNG plots go here (default: %(default)s)")


def run(args) -> int:
    from mpi4py import MPI

    from ..comm import print0
    from ..runtime import pick_device, set_threads
    from ..training.config import TrainConfig
    from ..training.experiment import batch_sizes, markdown_table, plot, run_grid, summarize

    comm = MPI.COMM_WORLD
    fill_experiment_samples(args)
    with usage():
        check_amp(args.amp, pick_device(args.device, comm))
    if not args.warmups or set(args.warmups) - set(WARMUPS):
        raise UsageError(f"--warmups takes a subset of {','.join(WARMUPS)}, got {','.join(args.warmups)}")
    if args.warmup_epochs == 0 and set(args.warmups) & {"gradual", "constant"}:  # rows the same as none's
        raise UsageError("--warmup-epochs 0 makes the gradual and constant warmups no warmup: give a length, or "
                         "--warmups none")
    if args.min_batch > args.max_batch:
        raise UsageError("--min-batch must be <= --max-batch")
    if args.backward_passes_per_step != 1:
        raise UsageError("the experiment uses one backward pass per step")
    base, batches = args.base_batch or args.min_batch, batch_sizes(args.min_batch, args.max_batch)
    if base not in batches:
        raise UsageError(f"--base-batch {base} must be one of the grid's batches {batches}")
    indivisible = [b for b in batches if b % comm.Get_size()]
    if indivisible:
        raise UsageError(f"global batches {indivisible} do not divide by {comm.Get_size()} ranks; pick --min-batch "
                         f"a multiple of {comm.Get_size()}")
    with usage():
        template = TrainConfig(**{**dataclass_values(TrainConfig, args), "optimizer": "sgd", "base_batch": base})
        template.validate()
        from ..training.data import load_dataset_of

        train_size = len(load_dataset_of(template, comm).train)
    if max(batches) > train_size:  # before the grid: steps_per_epoch would refuse it after the smaller batches ran
        raise UsageError(f"--max-batch {max(batches)} is larger than the {train_size} training samples: lower it or "
                         "give more --num-samples")
    if args.warmup_epochs >= args.epochs and set(args.warmups) & {"gradual", "constant"}:
        print0(f"# experiment large-batch: warning: {args.warmup_epochs:g} warmup epochs in a run of {args.epochs}: "
               "the warmup rows never reach their peak rate")
    check_outputs(comm, [("--out", args.out, True)])
    set_threads(args.threads, comm)
    print0(f"# experiment large-batch: {args.model} on {args.dataset} ({args.num_samples or 'all'} samples), "
           f"{comm.Get_size()} ranks, batches {batches}, warmups {','.join(args.warmups)}, {args.seeds} seed(s), "
           f"{args.epochs} epochs, lr {args.lr} per {base} samples, {args.warmup_epochs:g} warmup epochs")
    with usage(ValueError):  # a configuration the data cannot take: raised on every rank alike
        results = run_grid(template, batches, args.warmups, args.seeds, base, args.out, comm, log=print0)
    if comm.Get_rank() == 0:
        out = Path(args.out)
        summary = summarize(results)
        table = markdown_table(summary, base, args.lr)
        write_text(out / "table.md",
                   f"# Large-minibatch SGD on {args.dataset} ({comm.Get_size()} ranks)\n\n"
                   f"`{' '.join(['hpcjobs', 'experiment', 'large-batch'] + sys.argv[3:])}`\n\n"
                   f"Model {args.model}, dataset {args.dataset} ({args.num_samples or 'all'} samples), "
                   f"SGD momentum {args.momentum}, "
                   f"{args.epochs} epochs, warmup {args.warmup_epochs:g} epochs.\n\n{table}\n")
        print(table, flush=True)
        written = plot(results, summary, out, base) or [f"no plots: {MISSING}"]
        print(f"# wrote {out / 'table.md'}, {out / 'runs.jsonl'}, {', '.join(written)}", flush=True)
    return 0
