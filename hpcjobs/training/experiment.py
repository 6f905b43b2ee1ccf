"""Goyal et al.'s large-minibatch table in miniature (``hpcjobs experiment
large-batch`` runs it).

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
2. at ``B <= base batch`` (k <= 1) the three warmups are the same run, so it
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

import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Callable

from mpi4py import MPI

from .._plots import pyplot
from .config import TrainConfig
from .loop import train
from .schedule import WARMUPS
from .stepping import json_line

WARMUP_EPOCHS = TrainConfig.__dataclass_fields__["warmup_epochs"].default  # the runs without warmup keep it

__all__ = ["batch_sizes", "run_grid", "summarize", "markdown_table", "plot"]


def batch_sizes(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b <= hi:
        out.append(b)
        b *= 2
    return out


def _runs(batches, warmups, seeds, base_batch):
    for seed in seeds:
        for b in batches:
            if b <= base_batch:
                yield b, "all", seed  # the warmups coincide when k <= 1 (warmup never climbs down)
            else:
                for w in warmups:
                    yield b, w, seed


def run_grid(template: TrainConfig, batches: list[int], warmups: list[str], seeds: int, base_batch: int,
             out_dir: str | Path, comm: MPI.Intracomm, log: Callable[[str], None] = print) -> list[dict]:
    """Every run of the grid (module docstring): ``template`` with each
    global batch, warmup and seed, the rate scaled linearly from
    ``template.lr`` at ``base_batch``. Appends each run to
    ``out_dir``/runs.jsonl (rank 0) and returns one record per run (with
    its history).

    Raises:
        ValueError: an unknown warmup, a base batch not in ``batches``, or a
            batch that does not divide by the ranks (before any run).
    """
    size = comm.Get_size()
    if not warmups or set(warmups) - set(WARMUPS):
        raise ValueError(f"warmups must be a subset of {', '.join(WARMUPS)}, got {warmups}")
    if base_batch not in batches or any(b % size for b in batches):
        raise ValueError(f"base_batch {base_batch} must be one of the batches {batches}, each a multiple of the "
                         f"{size} ranks")
    plan = list(_runs(batches, warmups, range(seeds), base_batch))
    runs_path = Path(out_dir) / "runs.jsonl"
    if comm.Get_rank() == 0:
        runs_path.parent.mkdir(parents=True, exist_ok=True)
        runs_path.write_text("")
    results = []
    t_start = time.perf_counter()
    for i, (b, warmup, seed) in enumerate(plan):
        cfg = dataclasses.replace(template, batch_per_rank=b // size, backward_passes_per_step=1,
                                  base_batch=base_batch, warmup="none" if warmup == "all" else warmup, seed=seed,
                                  warmup_epochs=WARMUP_EPOCHS if warmup in ("all", "none") else template.warmup_epochs,
                                  quiet=True, progress=False)
        t0 = time.perf_counter()
        history = train(cfg, comm)
        last = history[-1]
        rec = {"global_batch": b, "k": b / base_batch, "warmup": warmup, "seed": seed,
               "lr_peak": template.lr * b / base_batch, "test_error": 1 - last["test_acc"],
               "diverged": not math.isfinite(last["loss"]), "train_loss": last["loss"], "epochs_run": len(history),
               "seconds": time.perf_counter() - t0, "history": history}
        results.append(rec)
        if comm.Get_rank() == 0:
            with open(runs_path, "a") as f:
                f.write(json_line(rec) + "\n")
            elapsed = time.perf_counter() - t_start
            eta = elapsed / (i + 1) * (len(plan) - i - 1)
            log(f"[{i + 1}/{len(plan)}] batch {b:5d} (k={b / base_batch:g}) warmup {warmup:8s} seed {seed}: "
                f"test error {100 * rec['test_error']:.2f}%{' (diverged)' if rec['diverged'] else ''}  "
                f"({rec['seconds']:.1f} s, ~{eta / 60:.1f} min left)")
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
    """The figures' paths: none without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []
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
    plt = pyplot()

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
