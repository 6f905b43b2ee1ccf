"""``hpcjobs experiment async``: synchronous SGD against the modes without
lockstep, with and without a straggler (:mod:`hpcjobs.training.async_experiment`).

    mpirun -n 5 hpcjobs experiment async --out results/async      # 1 server + 4 workers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .._files import write_text
from .._plots import MISSING
from .args import (UsageError, check_outputs, comma_list, dataclass_values, nonnegative_float, positive_float,
                   positive_int, usage)
from .train import add_model_data_arguments, fill_experiment_samples


def configure(p) -> None:
    from ..collectives.names import MESSAGE_ALGORITHMS
    from ..training.config import async_row_names as row_names

    add_model_data_arguments(p, num_samples=10000)
    # Tuned here (docs/results/async.md): the large-batch experiment's rate per 32 samples, a cosine decay so the
    # last epochs settle, 10,000 samples
    p.set_defaults(model="cnn1d")
    g = p.add_argument_group("runs")
    g.add_argument("--rows", type=comma_list, default=row_names(),
                   help=f"comma-separated subset of: {', '.join(row_names())} (default: all)")
    g.add_argument("--seeds", type=positive_int, default=3, help="seeds per row (default 3)")
    g.add_argument("--epochs", type=positive_int, default=12, help="every run trains this long (default 12)")
    g.add_argument("--batch-per-rank", "-b", type=positive_int, default=32,
                   help="samples per worker per step (default 32)")
    g.add_argument("--lr", type=positive_float, default=0.02,
                   help="rate per --base-batch samples, scaled to each mode's batch per update (default 0.02)")
    g.add_argument("--base-batch", type=positive_int, default=32, help="default: %(default)s")
    g.add_argument("--momentum", type=nonnegative_float, default=0.9, help="default: %(default)s")
    g.add_argument("--warmup-epochs", type=nonnegative_float, default=2.0, help="gradual (default %(default)s)")
    g.add_argument("--decay", choices=("none", "cosine"), default="cosine", help="default: %(default)s")
    g.add_argument("--straggler-factor", type=at_least_one, default=3.0, metavar="F",
                   help="the second half of the runs: worker 0's steps F times as long (1: none; default 3)")
    g.add_argument("--algorithm", default="ring", choices=MESSAGE_ALGORITHMS,
                   help="allreduce of sync, local and easgd, a message-passing one, whose bytes are counted "
                        "(default ring)")
    g.add_argument("--peer-timeout", type=positive_float, default=60.0, help="async (default %(default)s s)")
    g.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default 1)")
    g.add_argument("--out", "-O", default="results/async", metavar="DIR",
                   help="runs.jsonl, table.md and error_vs_time.png go here (default: %(default)s)")


def at_least_one(text: str) -> float:
    value = positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a straggler's steps take F times as long: F >= 1 (1: none), got {text}")
    return value


def run(args) -> int:
    from mpi4py import MPI

    from ..collectives._shared import is_single_node
    from ..comm import print0
    from ..runtime import set_threads
    from ..training.async_experiment import markdown_table, plot, row_config, run_rows, summarize
    from ..training.config import ASYNC_ROWS as ROWS
    from ..training.config import TrainConfig, async_row_names as row_names

    comm = MPI.COMM_WORLD
    fill_experiment_samples(args)
    if comm.Get_size() < 2:
        raise UsageError("run 1 server + W workers, e.g. mpirun -n 5 (4 workers)")
    unknown = set(args.rows) - set(row_names())
    if unknown or not args.rows:
        raise UsageError(f"--rows takes a subset of {', '.join(row_names())}; unknown: {', '.join(sorted(unknown))}")
    rows = list(args.rows)
    workers = comm.Get_size() - 1
    sub = comm.Split(0 if comm.Get_rank() else MPI.UNDEFINED, comm.Get_rank())
    one_node = comm.allreduce(is_single_node(sub) if sub != MPI.COMM_NULL else True, op=MPI.LAND)
    if sub != MPI.COMM_NULL:
        sub.Free()
    if not one_node and any(r.startswith("hogwild") for r in rows):
        rows = [r for r in rows if not r.startswith("hogwild")]
        print0("# experiment async: the workers span nodes: the hogwild rows (one node) are left out")
        if not rows:
            raise UsageError("the workers span nodes and every row asked for is a hogwild row (one node): run on "
                             "one node, or ask for other rows (--rows)")
    with usage():
        template = TrainConfig(**{**dataclass_values(TrainConfig, args), "warmup": "gradual", "optimizer": "sgd"})
        checked = []
        for name, mode, over in ROWS:
            if name not in rows:
                continue
            cfg = row_config(template, mode, over)
            try:
                cfg.validate()
            except ValueError as e:  # a setting of the row's own (its momentum averaging), or the flags for it
                raise UsageError(f"row {name!r}: {e}; leave the row out (--rows) or change the flags") from None
            if over.get("post_local_epochs") == "quarter" and not cfg.post_local_epochs:  # plain local SGD
                raise UsageError(f"row {name!r} averages every step for a quarter of the epochs, and --epochs "
                                 f"{template.epochs} has none: train 4 epochs or more, or leave the row out (--rows)")
            checked.append((name, cfg))
        # the averaging rows' periods and rates on the W workers, before any row runs (run_rows runs them on
        # the workers alone: one refusing there would leave rank 0 waiting)
        from ..training.averaging import PeriodError, check_periods
        from ..training.data import load_dataset_of, steps_per_epoch
        from ..training.paramserver import elastic_problem

        ds = load_dataset_of(template, comm)
        for name, cfg in checked:
            if cfg.mode == "easgd" and cfg.easgd_form == "async":  # on the row's workers, as its servers count
                served = comm.Get_size() - cfg.servers
                problem = elastic_problem(cfg, served, steps_per_epoch(len(ds.train), cfg.batch_per_rank * served))
                if problem:
                    raise UsageError(f"row {name!r}: {problem[0]}; give more samples, smaller batches or more "
                                     "epochs (--num-samples, -b, --epochs), or leave the row out (--rows)")
            elif cfg.mode != "async":
                try:
                    check_periods(cfg, workers, steps_per_epoch(len(ds.train), cfg.batch_per_rank * workers))
                except PeriodError as e:  # (a row's own rate is not a flag here: the remedy is the row's)
                    longer = "train longer (--epochs, --num-samples) or " if e.too_short else ""
                    raise UsageError(f"row {name!r}: {e.problem}; {longer}leave the row out (--rows)") from None
    check_outputs(comm, [("--out", args.out, True)])
    set_threads(args.threads, comm)
    print0(f"# experiment async: {args.model} on {args.dataset} ({args.num_samples or 'all'} samples), 1 server + "
           f"{workers} workers, {args.seeds} seed(s), {args.epochs} epochs, batch {args.batch_per_rank} per worker "
           f"step, lr {args.lr} per {args.base_batch} samples ({args.decay} decay), straggler "
           f"{args.straggler_factor:g}x; rows: {', '.join(rows)}")
    with usage(ValueError):
        results = run_rows(template, rows, args.seeds, args.straggler_factor, args.out, comm, log=print0)
    if comm.Get_rank() == 0:
        out = Path(args.out)
        table = markdown_table(summarize(results))
        write_text(out / "table.md",
                   f"# SGD with and without lockstep on {args.dataset} (1 server + {workers} workers)\n\n"
                   f"`{' '.join(['hpcjobs', 'experiment', 'async'] + sys.argv[3:])}`\n\n{table}\n")
        print(table, flush=True)
        print(f"# wrote {out / 'table.md'}, {out / 'runs.jsonl'}, {plot(results, out) or f'no plot: {MISSING}'}",
              flush=True)
    return 0
