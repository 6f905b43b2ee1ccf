"""``hpcjobs experiment async``: synchronous SGD against the modes without
lockstep (docs/algorithms.md, "Asynchronous and local SGD"), on the same
model, data and schedule, with and without one slow worker.

The job has W + 1 ranks: rank 0 is the parameter server of the ``async``
rows (and holds the center of asynchronous EASGD's) and waits (asleep,
not spinning) while ranks 1..W run the others on a communicator of their
own. For every row, seed and straggler setting it
trains ``epochs`` epochs and keeps every epoch's line; the straggler is
worker 0 (world rank 1) in every row, its steps FACTOR times as long.

The table gives, per row: the final test error (mean and sd over seeds);
the wall time to the *target* (the synchronous row's final error, plus
one point, in the same straggler setting) as a ratio of the synchronous
row's whole run; bytes sent per worker per epoch (and the ratio to sync);
the staleness the servers saw.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .._plots import pyplot
from .config import ASYNC_ROWS as ROWS
from .config import TrainConfig, async_row_names as row_names
from .loop import train
from .stepping import json_line

__all__ = ["ROWS", "row_names", "resolve", "row_config", "run_rows", "summarize", "markdown_table", "plot"]


def _polite_errors(comm: MPI.Intracomm, error: Exception | None) -> list:
    """Every rank's error (its text, or None) where any rank has one, else
    []: a barrier that sleeps (the idle rank leaves the cores to the others)."""
    mine, total = np.array([error is not None], np.int32), np.zeros(1, np.int32)
    req = comm.Iallreduce(mine, total, op=MPI.SUM)
    while not req.Test():
        time.sleep(0.002)
    return comm.allgather(None if error is None else str(error)) if total[0] else []


def resolve(overrides: dict, template: TrainConfig) -> dict:
    """A row's overrides with its epoch counts spelled out: "quarter" and
    "double" of the template's epochs."""
    epochs = {"quarter": template.epochs // 4, "double": 2 * template.epochs}
    return {k: epochs.get(v, v) if isinstance(v, str) else v for k, v in overrides.items()}


def row_config(template: TrainConfig, mode: str, overrides: dict, **fields) -> TrainConfig:
    """A row's configuration: ``template`` in ``mode`` with the row's
    resolved ``overrides``, less what the mode would refuse as ignored: the
    allreduce where nothing is reduced (the servers' and Hogwild!'s rows),
    the servers' timeout where none serves."""
    over = resolve(overrides, template)
    served = mode == "async" or over.get("easgd_form") == "async"
    if served or mode == "hogwild":
        fields.setdefault("algorithm", "auto")
    if not served:
        fields.setdefault("peer_timeout", TrainConfig.peer_timeout)
    return dataclasses.replace(template, mode=mode, **over, **fields)


def run_rows(template: TrainConfig, rows: list[str], seeds: int, factor: float, out_dir: str,
             comm: MPI.Intracomm, log=print) -> list[dict]:
    """Every row x seed x straggler setting; returns the runs (rank 0 writes
    ``runs.jsonl`` as they finish)."""
    rank = comm.Get_rank()
    workers = comm.Get_size() - 1
    sub = comm.Split(0 if rank else MPI.UNDEFINED, rank)  # the workers, without the server
    path = Path(out_dir) / "runs.jsonl"
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    results = []
    settings = [1.0] + ([factor] if factor > 1 else [])
    try:
        for slow in settings:
            for name, mode, overrides in ROWS:
                if name not in rows:
                    continue
                for seed in range(seeds):
                    served = mode == "async" or overrides.get("easgd_form") == "async"  # rank 0 serves
                    straggler = (f"{1 if served else 0}:{slow:g}") if slow > 1 else None
                    cfg = row_config(template, mode, overrides, seed=seed, straggler=straggler, quiet=True,
                                     progress=False, metrics=None)
                    t0 = time.monotonic()
                    error = None
                    try:
                        if served:
                            history = train(cfg, comm)
                        elif rank:
                            history = train(cfg, sub)
                    except ValueError as e:  # raised on every worker (modes.train ends the job on other errors)
                        error = e
                    errors = _polite_errors(comm, error)
                    if errors:  # rank 0, waiting, would never have heard: every rank raises, rank 0 says why
                        raise ValueError(f"row {name!r}, seed {seed}: " + "; ".join(
                            f"rank {r}: {text}" for r, text in enumerate(errors) if text)) from error
                    if rank == 1 and not served:
                        comm.send(history, dest=0, tag=77)
                    if rank == 0:
                        if not served:
                            history = comm.recv(source=1, tag=77)
                        run = {"row": name, "mode": mode, "seed": seed, "straggler": slow, "workers": workers,
                               "history": history}
                        results.append(run)
                        with open(path, "a") as f:
                            f.write(json_line(run) + "\n")
                        last = history[-1]
                        log(f"# {name}, seed {seed}, straggler {slow:g}x: test error "
                            f"{100 * (1 - last['test_acc']):.2f}% after {last['wall_s']:.1f} s "
                            f"({time.monotonic() - t0:.0f} s with evaluation)")
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()
    return results


def _time_to(history: list[dict], target_error: float) -> float | None:
    for r in history:
        if 1 - r["test_acc"] <= target_error:
            return r["wall_s"]
    return None


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def summarize(results: list[dict]) -> dict:
    """Per (straggler, row): error mean/sd, wall, time to target (and how many
    seeds reached it), bytes per worker per epoch, staleness."""
    summary = {}
    for slow in sorted({r["straggler"] for r in results}):
        runs = [r for r in results if r["straggler"] == slow]
        sync = [r for r in runs if r["row"] == "sync"]
        target = (statistics.fmean(1 - r["history"][-1]["test_acc"] for r in sync) + 0.01) if sync else None
        sync_wall = statistics.fmean(r["history"][-1]["wall_s"] for r in sync) if sync else None
        for name in dict.fromkeys(r["row"] for r in runs):
            rs = [r for r in runs if r["row"] == name]
            errors = [1 - r["history"][-1]["test_acc"] for r in rs]
            times = [_time_to(r["history"], target) for r in rs] if target is not None else []
            reached = [t for t in times if t is not None]
            hist = [h for r in rs for h in r["history"]]
            summary[(slow, name)] = {
                "error": _mean_sd(errors), "wall_s": statistics.fmean(r["history"][-1]["wall_s"] for r in rs),
                "target": target, "sync_wall_s": sync_wall, "reached": len(reached), "seeds": len(rs),
                "time_to_target_s": statistics.fmean(reached) if reached else None,
                # (None where a run counted none, not 0: every ratio to it would read 0)
                "sent_bytes": (statistics.fmean(h["sent_bytes"] for h in hist)
                               if all("sent_bytes" in h for h in hist) else None),
                "staleness_mean": (statistics.fmean(h["staleness_mean"] for h in hist)
                                   if "staleness_mean" in hist[0] else None),
                "staleness_max": max((h["staleness_max"] for h in hist), default=None)
                if "staleness_max" in hist[0] else None,
            }
    return summary


def markdown_table(summary: dict) -> str:
    lines = []
    for slow in sorted({k[0] for k in summary}):
        rows = {name: v for (s, name), v in summary.items() if s == slow}
        sync = rows.get("sync")
        target = next(iter(rows.values()))["target"]
        head = "no straggler" if slow == 1 else f"worker 0 {slow:g}x slower"
        lines += [f"**{head}**" + (f" (target: sync's final error + 1 point = {100 * target:.2f}%)"
                                   if target is not None else ""), "",
                  "| row | final test error % | wall s | time to target s | ÷ sync wall | sent MB/worker/epoch | "
                  "sync's bytes ÷ row's | staleness mean / max |", "|---|---|---:|---:|---:|---:|---:|---|"]
        for name, v in rows.items():
            m, sd = v["error"]
            tt = v["time_to_target_s"]
            reach = "" if v["reached"] == v["seeds"] else f" ({v['reached']}/{v['seeds']} seeds)"
            ratio = f"{tt / v['sync_wall_s']:.2f}" if tt is not None and v["sync_wall_s"] else "—"
            byte_ratio = (f"{sync['sent_bytes'] / v['sent_bytes']:.2f}" if sync and sync["sent_bytes"] is not None
                          and v["sent_bytes"] and name != "sync" else "—")
            sent = "—" if v["sent_bytes"] is None else f"{v['sent_bytes'] / 1e6:.3f}"
            stale = (f"{v['staleness_mean']:.2f} / {v['staleness_max']}" if v["staleness_mean"] is not None
                     else "—")
            lines.append(f"| {name} | {100 * m:.2f} ± {100 * sd:.2f} | {v['wall_s']:.1f} | "
                         f"{'never' if tt is None else f'{tt:.1f}'}{reach} | {ratio} | {sent} | "
                         f"{byte_ratio} | {stale} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], out_dir: Path) -> str | None:
    """Test error against wall time, one panel per straggler setting (seed 0's runs); its path, or None
    without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None

    settings = sorted({r["straggler"] for r in results})
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    names = list(dict.fromkeys(r["row"] for r in results))
    colors = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(names)}  # one colour per row
    for ax, slow in zip(axes[0], settings):
        for r in (r for r in results if r["straggler"] == slow and r["seed"] == 0):
            h = r["history"]
            ax.plot([x["wall_s"] for x in h], [100 * (1 - x["test_acc"]) for x in h], marker=".",
                    label=r["row"], color=colors[r["row"]],
                    linestyle="-" if r["mode"] in ("sync", "async") else "--")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("test error (%)")
        ax.set_title("no straggler" if slow == 1 else f"worker 0 {slow:g}x slower")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "error_vs_time.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
