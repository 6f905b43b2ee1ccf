"""``hpcjobs experiment large-batch``: Goyal et al.'s table in miniature.

Goyal et al. 2017 train ResNet-50 on ImageNet with minibatches from 256 to
64k, every run with the linear scaling rule (lr = 0.1 * kn/256), and show
that with *gradual* warmup over 5 epochs the error stays flat up to 8k
(23.74% vs 23.60% at 256) and then rises (24.79 / 27.55 / 33.96% at
16k / 32k / 64k), while *no* warmup or a *constant* low-rate warmup fails
for large k. This command runs the same grid on MNIST-1D:

1. for every global batch ``B`` from ``--min-batch`` doubling to
   ``--max-batch``, every warmup in {none, constant, gradual} and every seed,
   train the same model for the same number of epochs with
   ``lr = --lr * B / --base-batch``, on all ranks of the job (per-rank batch
   ``B / P``);
2. at ``B = base batch`` (k = 1) the three warmups are the same run, so it
   is run once per seed;
3. report the final test error, mean and spread over seeds, as a Markdown
   table, a JSON-lines file of every epoch of every run, and plots: test
   error against batch size, the training curves at the largest batch, and
   (Goyal's figure 2) the curves at the largest batch where gradual warmup
   still ends within 2 points of the base batch.

Launch::

    mpirun -n 2 hpcjobs experiment large-batch --out results/large-batch
    sbatch slurm/train.sbatch experiment large-batch ...
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from ..cli import UsageError, arguments, command, nonnegative_float, positive_float, positive_int
from .cli import add_comm_arguments, add_model_data_arguments, set_threads
from .loop import TrainConfig, train
from .schedule import WARMUPS

__all__ = ["batch_sizes", "run_grid", "summarize", "markdown_table"]


def batch_sizes(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b <= hi:
        out.append(b)
        b *= 2
    return out


def _runs(batches, warmups, seeds, base_batch):
    for seed in seeds:
        for b in batches:
            if b == base_batch:
                yield b, "all", seed  # the warmups coincide when k = 1
            else:
                for w in warmups:
                    yield b, w, seed


def run_grid(args, comm, log=print) -> list[dict]:
    """Every run of the grid; returns one record per run (with its history)."""
    size = comm.Get_size()
    batches = batch_sizes(args.min_batch, args.max_batch)
    bad = [b for b in batches if b % size]
    if bad:
        raise UsageError(f"global batches {bad} do not divide by {size} ranks; pick --min-batch a multiple of {size}")
    base = args.base_batch or args.min_batch
    seeds = list(range(args.seeds))
    plan = list(_runs(batches, args.warmups, seeds, base))
    out_dir = Path(args.out)
    runs_path = out_dir / "runs.jsonl"
    if comm.Get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        runs_path.write_text("")
    results = []
    t_start = time.perf_counter()
    for i, (b, warmup, seed) in enumerate(plan):
        cfg = TrainConfig(model=args.model, width=args.width, batch_norm=args.batch_norm, dataset=args.dataset,
                          data_dir=args.data_dir, num_samples=args.num_samples, data_seed=args.data_seed,
                          batch_per_rank=b // size, optimizer="sgd", lr=args.lr, base_batch=base,
                          momentum=args.momentum, weight_decay=args.weight_decay,
                          warmup="none" if warmup == "all" else warmup, warmup_epochs=args.warmup_epochs,
                          algorithm=args.algorithm, compression=args.compression,
                          error_feedback=args.error_feedback, fusion_bytes=args.fusion_bytes,
                          overlap=args.overlap, epochs=args.epochs, seed=seed, quiet=True, progress=False)
        t0 = time.perf_counter()
        history = train(cfg, comm)
        last = history[-1]
        rec = {"global_batch": b, "k": b / base, "warmup": warmup, "seed": seed,
               "lr_peak": args.lr * b / base, "test_error": 1 - last["test_acc"],
               "diverged": not math.isfinite(last["loss"]), "train_loss": last["loss"], "epochs_run": len(history), "seconds": time.perf_counter() - t0,
               "history": history}
        results.append(rec)
        if comm.Get_rank() == 0:
            with open(runs_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            elapsed = time.perf_counter() - t_start
            eta = elapsed / (i + 1) * (len(plan) - i - 1)
            log(f"[{i + 1}/{len(plan)}] batch {b:5d} (k={b / base:g}) warmup {warmup:8s} seed {seed}: "
                f"test error {100 * rec['test_error']:.2f}%{' (diverged)' if rec['diverged'] else ''}  ({rec['seconds']:.1f} s, ~{eta / 60:.1f} min left)")
    return results


def summarize(results: list[dict]) -> dict:
    """{(batch, warmup): (mean error, stdev, n, diverged runs)}; the k=1 run
    counts for every warmup. A diverged run (non-finite loss) counts with the
    test error its last model had."""
    groups: dict[tuple[int, str], list[dict]] = {}
    warmups = sorted({r["warmup"] for r in results if r["warmup"] != "all"}, key=WARMUPS.index) or list(WARMUPS)
    for r in results:
        for w in (warmups if r["warmup"] == "all" else [r["warmup"]]):
            groups.setdefault((r["global_batch"], w), []).append(r)
    out = {}
    for key, runs in groups.items():
        v = [r["test_error"] for r in runs]
        out[key] = (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v),
                    sum(bool(r.get("diverged")) for r in runs))
    return out


def markdown_table(summary: dict, base_batch: int, lr: float) -> str:
    batches = sorted({b for b, _ in summary})
    warmups = [w for w in WARMUPS if any(k[1] == w for k in summary)]
    base_err = {w: summary[(base_batch, w)][0] for w in warmups if (base_batch, w) in summary}
    head = ("| global batch | k | peak lr | " + " | ".join(f"{w} warmup: test error %" for w in warmups)
            + " | gradual - base (points) |")
    lines = [head, "|" + "---|" * (4 + len(warmups))]
    for b in batches:
        cells = []
        for w in warmups:
            if (b, w) not in summary:
                cells.append("")
                continue
            mean, sd, n, diverged = summary[(b, w)]
            cell = f"{100 * mean:.2f} ± {100 * sd:.2f}" if n > 1 else f"{100 * mean:.2f}"
            cells.append(cell + (f" ({diverged}/{n} diverged)" if diverged else ""))
        gap = ""
        if (b, "gradual") in summary and "gradual" in base_err:
            gap = f"{100 * (summary[(b, 'gradual')][0] - base_err['gradual']):+.2f}"
        lines.append(f"| {b} | {b / base_batch:g} | {lr * b / base_batch:g} | " + " | ".join(cells) + f" | {gap} |")
    n = max(v[2] for v in summary.values())
    lines.append("")
    lines.append(f"Mean ± standard deviation of the final test error over {n} seed(s); "
                 f"every run uses the linear scaling rule (peak lr = {lr:g} x k).")
    return "\n".join(lines)


def plot(results: list[dict], summary: dict, out_dir: Path, base_batch: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    warmups = [w for w in WARMUPS if any(k[1] == w for k in summary)]
    fig, ax = plt.subplots(figsize=(6, 4))
    for w in warmups:
        pts = sorted((b, m, s) for (b, ww), (m, s, _, _) in summary.items() if ww == w)
        ax.errorbar([p[0] for p in pts], [100 * p[1] for p in pts], yerr=[100 * p[2] for p in pts],
                    marker="o", capsize=3, label=f"{w} warmup")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global minibatch size")
    ax.set_ylabel("final test error (%)")
    ax.set_title(f"MNIST-1D, linear scaling rule (base batch {base_batch})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "error_vs_batch.png", dpi=120)
    plt.close(fig)
    written.append(str(out_dir / "error_vs_batch.png"))

    largest = max(r["global_batch"] for r in results)
    written.append(_curves(results, warmups, largest, base_batch, out_dir / "curves_largest_batch.png"))
    # Goyal's figure 2 shows the curves at the largest batch that still works:
    # here the largest where gradual warmup ends within 2 points of the base batch.
    base_err = summary.get((base_batch, "gradual"), (None,))[0]
    working = [b for (b, w), v in summary.items() if w == "gradual" and base_err is not None
               and b != base_batch and v[0] <= base_err + 0.02]
    if working and max(working) != largest:
        b = max(working)
        written.append(_curves(results, warmups, b, base_batch, out_dir / f"curves_batch{b}.png"))
    return written


def _curves(results, warmups, batch, base_batch, path) -> str:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for w in warmups:
        runs = [r for r in results if r["global_batch"] == batch and r["warmup"] in (w, "all")]
        if not runs:
            continue
        n = max(len(r["history"]) for r in runs)
        epochs = list(range(1, n + 1))
        # a diverged run stops early: average over the runs still going
        loss = [statistics.fmean(r["history"][e]["loss"] for r in runs if e < len(r["history"])) for e in range(n)]
        err = [100 * statistics.fmean(1 - r["history"][e]["test_acc"] for r in runs if e < len(r["history"]))
               for e in range(n)]
        axes[0].plot(epochs, loss, label=f"{w} warmup")
        axes[1].plot(epochs, err, label=f"{w} warmup")
    axes[0].set_ylabel("training loss")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("test error (%)")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"training curves at global batch {batch} (k={batch // base_batch}), mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def _configure(p) -> None:
    add_model_data_arguments(p)
    # Tuned here (README, "Large-minibatch SGD"): the 1-D CNN at lr 0.02 per 32 samples is
    # near the largest stable rate at the base batch, which is where warmup matters.
    p.set_defaults(num_samples=20000, model="cnn1d")
    g = p.add_argument_group("grid")
    g.add_argument("--min-batch", type=positive_int, default=32, help="smallest global batch (default 32)")
    g.add_argument("--max-batch", type=positive_int, default=4096, help="largest, reached by doubling (default 4096)")
    g.add_argument("--base-batch", type=positive_int, help="the batch --lr is for (default: --min-batch)")
    g.add_argument("--warmups", type=lambda s: [w.strip() for w in s.split(",") if w.strip()],
                   default=list(WARMUPS), help="comma-separated subset of none,constant,gradual (default: all)")
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


@command("experiment large-batch",
         "Goyal et al.'s large-minibatch table on MNIST-1D: test error vs batch for no/constant/gradual warmup")
@arguments(_configure)
def main(args) -> int:
    from mpi4py import MPI

    from ..comm import print0

    comm = MPI.COMM_WORLD
    bad = [w for w in args.warmups if w not in WARMUPS]
    if bad or not args.warmups:
        raise UsageError(f"--warmups takes a subset of {','.join(WARMUPS)}, got {','.join(args.warmups)}")
    if args.min_batch > args.max_batch:
        raise UsageError("--min-batch must be <= --max-batch")
    if args.backward_passes_per_step != 1:
        raise UsageError("the experiment uses one backward pass per step")
    base = args.base_batch or args.min_batch
    if base not in batch_sizes(args.min_batch, args.max_batch):
        raise UsageError(f"--base-batch {base} must be one of the grid's batches "
                         f"{batch_sizes(args.min_batch, args.max_batch)}")
    set_threads(args, comm)
    print0(f"# experiment large-batch: {args.model} on {args.dataset} ({args.num_samples} samples), "
           f"{comm.Get_size()} ranks, batches {batch_sizes(args.min_batch, args.max_batch)}, "
           f"warmups {','.join(args.warmups)}, {args.seeds} seed(s), {args.epochs} epochs, lr {args.lr} per "
           f"{base} samples, {args.warmup_epochs:g} warmup epochs")
    try:
        results = run_grid(args, comm, log=print0)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if comm.Get_rank() == 0:
        out = Path(args.out)
        summary = summarize(results)
        table = markdown_table(summary, base, args.lr)
        (out / "table.md").write_text(
            f"# Large-minibatch SGD on MNIST-1D ({comm.Get_size()} ranks)\n\n"
            f"`{' '.join(['hpcjobs', 'experiment', 'large-batch'] + sys.argv[3:])}`\n\n"
            f"Model {args.model}, {args.num_samples} MNIST-1D samples (80% train), SGD momentum {args.momentum}, "
            f"{args.epochs} epochs, warmup {args.warmup_epochs:g} epochs.\n\n{table}\n")
        print(table, flush=True)
        written = plot(results, summary, out, base)
        print(f"# wrote {out / 'table.md'}, {out / 'runs.jsonl'}, {', '.join(written)}", flush=True)
    return 0
