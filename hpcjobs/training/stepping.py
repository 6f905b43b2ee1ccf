"""What the modes without lockstep share (:mod:`hpcjobs.training.paramserver`,
:mod:`hpcjobs.training.averaging`): a model whose parameters are views of
one flat vector, one worker's local step, the straggler, and the epoch's
record in the same fields as the synchronous loop's.

A flat vector is what a parameter server shards, what local SGD averages
and what Hogwild! shares: :func:`flatten` makes every parameter of a model
a view into one float32 tensor (its own, or a given shared one), so that
writing the vector writes the model and the optimizers update it in place.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from mpi4py import MPI

from .._files import finite, is_stdout, is_stream, write_text
from ..collectives.watchdog import guard
from ..runtime import autocast
from .config import TrainConfig, parse_straggler
from .data import Dataset, eval_shard

__all__ = ["Progress", "losses_of", "flatten", "grad_vector", "Straggler", "compute_step", "evaluate_local", "evaluate",
           "finish_record", "report"]


def flatten(model: torch.nn.Module, into: torch.Tensor | None = None, fill: bool = True) -> torch.Tensor:
    """Make the parameters of ``model`` views of one flat float32 vector and
    return it: ``into`` (e.g. shared memory; the model's values are copied
    in only where ``fill``) or a new tensor holding their values."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    if into is None:
        into = torch.empty(n, dtype=torch.float32)
    elif into.numel() != n:
        raise ValueError(f"a flat vector of {into.numel()} values for {n} parameters")
    off = 0
    with torch.no_grad():
        for p in params:
            view = into[off:off + p.numel()].view_as(p)
            if fill:
                view.copy_(p.detach())
            p.data = view
            off += p.numel()
    return into


def grad_vector(model: torch.nn.Module, out: np.ndarray) -> np.ndarray:
    """The parameters' gradients, in :func:`flatten`'s order, into ``out`` (float32)."""
    off = 0
    for p in model.parameters():
        n = p.numel()
        if p.grad is None:
            out[off:off + n] = 0
        else:
            out[off:off + n] = p.grad.reshape(-1).numpy()
        off += n
    return out


class Straggler:
    """``--straggler RANK:FACTOR``: on that rank every step's compute is
    followed by a sleep of (FACTOR - 1) times its own duration, so its steps
    take FACTOR times as long, whatever the machine, and the cores it leaves
    idle stay idle (as a slower device would leave them)."""

    def __init__(self, spec: str | None, rank: int, size: int):
        self.factor = 1.0
        if spec:
            who, factor = parse_straggler(spec)
            if who >= size:
                raise ValueError(f"straggler rank {who} is not one of the {size} ranks")
            if who == rank:
                self.factor = factor
        self.slept_s = 0.0

    def __call__(self, compute_s: float) -> None:
        if self.factor > 1:
            pause = (self.factor - 1) * compute_s
            time.sleep(pause)
            self.slept_s += pause


def losses_of(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-sample cross-entropy and the number of samples right. A language
    model's sample is a sequence: its loss is the mean over its positions,
    and it counts as the fraction of its next tokens predicted right."""
    if y.ndim == 2:  # (N, T) targets, (N, T, V) logits
        loss = torch.nn.functional.cross_entropy(out.transpose(1, 2).float(), y, reduction="none").mean(1)
        return loss, float((out.argmax(-1) == y).float().mean(1).sum())
    return (torch.nn.functional.cross_entropy(out.float(), y, reduction="none"),
            float((out.argmax(1) == y).sum()))


def compute_step(model: torch.nn.Module, ds: Dataset, idx: np.ndarray) -> tuple[float, float, int, float]:
    """Forward and backward on the training samples ``idx`` (gradients left
    in ``p.grad``); returns (loss sum, right, samples, seconds)."""
    t0 = time.perf_counter()
    for p in model.parameters():
        p.grad = None
    x, y = ds.batch(ds.train, idx)
    losses, correct = losses_of(model(torch.from_numpy(x)), torch.from_numpy(y))
    losses.mean().backward()
    return float(losses.detach().sum()), correct, len(idx), time.perf_counter() - t0


@torch.no_grad()
def evaluate_local(model: torch.nn.Module, ds: Dataset, idx: np.ndarray | None = None, amp: str = "none",
                   device: torch.device = torch.device("cpu"),
                   between: Callable[[], None] | None = None) -> np.ndarray:
    """(loss sum, right, samples) of ``model`` on the test samples ``idx`` (all when None), in this process;
    the forward under ``amp``'s autocast on ``device``, where the model is. ``between`` is called after each
    batch of 256 (a parameter server heartbeats there: a long test is not its death)."""
    model.eval()
    idx = np.arange(len(ds.test)) if idx is None else idx
    sums = np.zeros(3)
    for lo in range(0, len(idx), 256):
        x, y = ds.batch(ds.test, idx[lo:lo + 256])
        with autocast(amp, device):
            out = model(torch.from_numpy(x).to(device))
        loss, correct = losses_of(out, torch.from_numpy(y).to(device))
        sums += [float(loss.sum()), correct, len(y)]
        if between is not None:
            between()
    model.train()
    return sums


def evaluate(model: torch.nn.Module, ds: Dataset, comm: MPI.Comm, amp: str = "none",
             device: torch.device = torch.device("cpu")) -> tuple[float, float]:
    """Test loss and accuracy, each rank of ``comm`` taking a shard (collective)."""
    sums = evaluate_local(model, ds, eval_shard(len(ds.test), comm.Get_rank(), comm.Get_size()), amp, device)
    with guard("evaluate", comm):  # watched: a rank stalled in its shard had left the others here for good
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    return sums[0] / sums[2], sums[1] / sums[2]


def finish_record(cfg: TrainConfig, record: dict, workers: int) -> dict:
    """The fields every mode's epoch line has, as plain Python numbers."""
    record = {"epoch": record.pop("epoch"), "mode": cfg.mode, **record, "workers": workers}
    record["samples_per_s"] = record["samples"] / record["epoch_s"] if record["epoch_s"] > 0 else 0.0
    return {k: (v if v is None or isinstance(v, str) else int(v) if isinstance(v, (int, np.integer)) or k in COUNTS
                else float(v)) for k, v in record.items()}


COUNTS = ("samples", "sent_bytes")  # counts summed in float arrays: written as the integers they are


def report(cfg: TrainConfig, record: dict) -> None:
    """One JSON line on stdout and in ``cfg.metrics`` (the caller is the rank that reports); every mode's."""
    line = json_line(record)
    if cfg.metrics:
        Path(cfg.metrics).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.metrics, "a") as f:
            f.write(line + "\n")
    if not cfg.quiet and not (cfg.metrics and is_stdout(cfg.metrics)):  # (--metrics /dev/stdout: once, not twice)
        print(line, flush=True)


def amend_report(cfg: TrainConfig, record: dict) -> None:
    """Rewrites the last line of ``cfg.metrics`` as ``record``: the epoch line :func:`report` wrote, with fields
    known only later (the parameter server's audit, where the run stopped at an epoch's end). A file it cannot
    amend (changed meanwhile, unwritable) gets a warning, not an error: the run itself went well."""
    if not cfg.metrics:
        return
    try:
        if is_stream(cfg.metrics):  # --metrics /dev/stdout: what went there cannot be read back and rewritten
            raise ValueError("it is a stream, not a file")
        lines = Path(cfg.metrics).read_text().splitlines(keepends=True)
        if not lines or json.loads(lines[-1]).get("epoch") != record.get("epoch"):
            raise ValueError(f"its last line is not epoch {record.get('epoch')}'s, written there by this run")
        lines[-1] = json_line(record) + "\n"
        write_text(cfg.metrics, "".join(lines))
    except (OSError, ValueError) as e:  # (json's JSONDecodeError is a ValueError)
        print(f"# train: warning: the audit is not in {cfg.metrics}: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)


def json_line(record: dict) -> str:
    """The record as one line of JSON: a NaN or an infinity (a diverged run's loss) is null, since JSON has none
    (Python wrote NaN, which jq, JavaScript and strict parsers refuse). Every JSON-lines file of train's and the
    experiments' is written so."""
    return json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=False)


def _plain(v):
    return finite(v, _rounded)


def _rounded(v: float) -> float:  # 6 decimals; 6 significant digits below 0.001 (squared gradient norms)
    return round(v, 6) if abs(v) >= 1e-3 else float(f"{v:.6g}")


class Progress:
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
