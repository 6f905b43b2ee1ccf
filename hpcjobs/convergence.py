"""Optimus's convergence model: the training loss after k epochs as

    l(k) = 1 / (β0·k + β1) + β2,     β0, β1, β2 >= 0

(Peng et al., "Optimus", EuroSys 2018, §4.1), fitted to a run's loss
history, and the epochs it predicts to a target loss.

The fit: for a fixed asymptote β2 below every observed loss,
1 / (l - β2) = β0·k + β1 is linear in (β0, β1), solved by non-negative
least squares (two unknowns: the unconstrained solution, or the best with
one of them at 0); β2 is searched on a grid in [0, min(l)) and refined
around the best point, keeping the fit with the smallest squared error in
the loss itself. Nothing beyond numpy.

The interval: the fit repeated without each point in turn (a jackknife);
the predicted epochs to the target from those fits give its low and high
ends. A target at or below a fit's asymptote is never reached by that fit
(``inf``).

A second model, ``power`` (:func:`fit_power`), for curves that fall faster
than 1/k, which Optimus's cannot follow (its decay is at most 1/k):

    l(k) = a·(k + b)^(−α),     a > 0, α >= 0, 0 <= b <= 20 epochs,

fitted by least squares in log l (the errors that matter are relative:
the loss spans orders of magnitude) to the epochs after the first. The
first epoch's loss is the mean over training's steepest fall, not a point
on the curve. For fixed b it is linear in (log a, α); b is searched on a
grid. It has no floor: it suits runs whose loss is still falling, not
ones at their noise floor. Chosen on the curves of docs/results/planner.md
(b) and checked there on runs made after it was fixed.

``hpcjobs train --target-loss L`` prints the prediction with each epoch's
line once it has :func:`min_points` epochs (``--loss-model`` picks the
model); :func:`fit_metrics` reads a ``--metrics`` JSONL file.

The statistical side (McCandlish et al., "An empirical model of large-batch
training", 2018, App. A.1): the squared norms of gradients over batches of
two sizes, b (one rank's) and B (the average over P ranks), estimate the
true gradient's squared norm and the per-sample gradient variance,

    |G|² ≈ (B·|G_B|² − b·|G_b|²) / (B − b),  S ≈ (|G_b|² − |G_B|²) / (1/b − 1/B),

each unbiased, so they are averaged over an epoch's steps before the ratio
B_noise = S / |G|² (the gradient noise scale, in samples) is taken
(:func:`noise_scale`; ``train --noise-scale``). From it the samples needed
for a given progress grow with the batch as E(B) = E_min·(1 + B/B_noise)
and the steps shrink as S(B) = S_min·(1 + B_noise/B):
:func:`epochs_factor` is what a batch B costs in epochs against a batch B0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from ._nnls import nonnegative_line

__all__ = ["LOSS_MODELS", "MIN_POINTS", "Fit", "PowerFit", "Prediction", "epochs_factor", "fit", "fit_metrics",
           "json_lines", "fit_power", "is_number", "last_run", "min_points", "noise_scale", "predict_epochs",
           "prediction_fields"]

LOSS_MODELS = ("optimus", "power")
MIN_POINTS = 4  # epochs before a fit of three parameters says anything (one to spare for the jackknife)
_POWER_B = np.linspace(0.0, 20.0, 401)  # the power law's offsets b tried, in epochs
_GRID = 64  # asymptote values tried in [0, min loss), then again around the best
_HUGE = 1e30  # a loss above this has diverged (float32's largest is 3.4e38): the fit's gap**4 weights overflow
_FLAT = 1e-9  # beta0 below this fraction of 1/(target - beta2) per epoch: a billion epochs or more, never


@dataclass(frozen=True)
class Fit:
    beta0: float
    beta1: float
    beta2: float
    rmse: float  # of the fitted losses against the observed, in loss units
    points: int

    def loss(self, k: float) -> float:
        """The loss the fit predicts after ``k`` epochs."""
        d = self.beta0 * k + self.beta1
        return math.inf if d <= 0 else 1.0 / d + self.beta2

    def epochs_to(self, target: float) -> float:
        """Epochs (from the start) until the loss reaches ``target``;
        ``inf`` if the fit's asymptote is at or above it. A flat fit
        (beta0 ~ 0 by round-off) is at its level 1/beta1 + beta2 throughout:
        0 where the target is at or above it, as PowerFit's."""
        if target <= self.beta2:
            return math.inf
        if self.beta0 <= _FLAT * (1.0 / (target - self.beta2)):
            return 0.0 if target >= self.loss(0) else math.inf
        return max(0.0, (1.0 / (target - self.beta2) - self.beta1) / self.beta0)


@dataclass(frozen=True)
class PowerFit:
    a: float
    alpha: float
    b: float
    rmse: float  # of the fitted losses against the observed, in loss units
    points: int

    def loss(self, k: float) -> float:
        """The loss the fit predicts after ``k`` epochs."""
        return self.a * (k + self.b) ** -self.alpha

    def epochs_to(self, target: float) -> float:
        """Epochs (from the start) until the loss reaches ``target``;
        ``inf`` for a flat fit."""
        if self.alpha <= _FLAT:
            return 0.0 if target >= self.a else math.inf
        log_k = math.log(self.a / target) / self.alpha
        return math.inf if log_k > 700 else max(0.0, math.exp(log_k) - self.b)


@dataclass(frozen=True)
class Prediction:
    target: float
    epochs: float  # from the start of training
    low: float
    high: float
    fit: Fit | PowerFit


def _fit_at(k: np.ndarray, loss: np.ndarray, b2: float) -> tuple[float, float, float]:
    gap = loss - b2
    y = 1.0 / gap
    # Errors in 1/(l - b2) grow as gap^-2 times the loss's: weight by gap^4 so
    # the linear fit approximates least squares in the loss.
    b0, b1 = nonnegative_line(k, y, gap ** 4)
    d = b0 * k + b1
    pred = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0) + b2, np.inf)
    return b0, b1, float(np.sum((pred - loss) ** 2))


def fit(epochs, losses) -> Fit:
    """Fit ``l = 1/(β0·k + β1) + β2`` to losses observed after ``epochs``
    (1, 2, ...; any positive numbers, in any order).

    Raises:
        ValueError: fewer than three points, lengths that differ, or a
            loss that is not a positive finite number.
    """
    k, loss = _checked(epochs, losses)
    top = float(loss.min())
    grid = np.linspace(0.0, top, _GRID, endpoint=False)
    best = min(((b2, *_fit_at(k, loss, b2)) for b2 in grid), key=lambda r: r[3])
    step = top / _GRID
    lo, hi = max(0.0, best[0] - step), min(top * (1 - 1e-9), best[0] + step)
    best = min([best, *((b2, *_fit_at(k, loss, b2)) for b2 in np.linspace(lo, hi, _GRID))], key=lambda r: r[3])
    b2, b0, b1, sse = best
    return Fit(b0, b1, float(b2), math.sqrt(sse / len(k)), len(k))


def fit_power(epochs, losses) -> PowerFit:
    """Fit ``l = a·(k + b)^(−α)`` to losses observed after ``epochs``, by
    least squares in log l (module docstring); every point given is used.

    Raises:
        ValueError: as :func:`fit`.
    """
    k, loss = _checked(epochs, losses)
    y, x = np.log(loss), np.log(k[None, :] + _POWER_B[:, None])  # one row per offset b
    xm, ym = x.mean(axis=1, keepdims=True), y.mean()
    sxx = ((x - xm) ** 2).sum(axis=1)
    slope = np.where(sxx > 0, ((x - xm) * (y - ym)).sum(axis=1) / np.where(sxx > 0, sxx, 1.0), 0.0)
    alpha = np.maximum(0.0, -slope)  # a rising fit is a flat one
    log_a = ym + alpha * xm[:, 0]
    sse = (((log_a[:, None] - alpha[:, None] * x) - y) ** 2).sum(axis=1)
    i = int(np.argmin(sse))
    a, b = math.exp(log_a[i]), float(_POWER_B[i])
    rmse = math.sqrt(float(np.mean((a * (k + b) ** -alpha[i] - loss) ** 2)))
    return PowerFit(a, float(alpha[i]), b, rmse, len(k))


def _checked(epochs, losses) -> tuple[np.ndarray, np.ndarray]:
    k = np.asarray(epochs, dtype=np.float64)
    loss = np.asarray(losses, dtype=np.float64)
    if k.shape != loss.shape or k.ndim != 1:
        raise ValueError(f"epochs and losses must be two lists of one length, got {k.shape} and {loss.shape}")
    if len(k) < 3:
        raise ValueError(f"the loss model has three parameters: it needs at least 3 points, got {len(k)}")
    if not np.all(np.isfinite(loss)) or np.any(loss <= 0):
        raise ValueError("losses must be positive finite numbers")
    if np.any(loss > _HUGE):
        raise ValueError(f"a loss of {loss.max():.3g} is a diverged run's: there is no curve to fit (losses up to "
                         f"{_HUGE:g})")
    if not np.all(np.isfinite(k)) or np.any(k <= 0):
        raise ValueError("epochs must be positive finite numbers")
    return k, loss


def min_points(model: str = "optimus") -> int:
    """Epochs of losses a prediction by ``model`` needs: three points to
    fit and one to spare for the jackknife, after the power law's skipped
    first epoch."""
    if model not in LOSS_MODELS:
        raise ValueError(f"unknown loss model {model!r}: one of {', '.join(LOSS_MODELS)}")
    return MIN_POINTS + (model == "power")


def predict_epochs(epochs, losses, target: float, model: str = "optimus") -> Prediction:
    """Epochs to reach ``target`` by ``model`` (``optimus`` or ``power``),
    with the jackknife interval (module docstring). The power law leaves
    out the epochs up to the first (k <= 1).

    Raises:
        ValueError: as :func:`fit`, fewer than :func:`min_points` points,
            an unknown model, or a target that is not a positive number.
    """
    if not target > 0:
        raise ValueError(f"the target loss must be a positive number, got {target}")
    need = min_points(model)
    k, loss = list(epochs), list(losses)
    if len(k) < need:
        raise ValueError(f"a prediction needs at least {need} epochs of losses, got {len(k)}")
    if model == "power":
        kept = [i for i, v in enumerate(k) if v > 1] if len(k) > 1 and min(k) <= 1 else list(range(len(k)))
        if len(kept) < need - 1:
            raise ValueError(f"the power law needs {need - 1} epochs after the first, got {len(kept)}")
        k, loss = [k[i] for i in kept], [loss[i] for i in kept]
    fitter = fit_power if model == "power" else fit
    whole = fitter(k, loss)
    ends = [fitter(k[:i] + k[i + 1:], loss[:i] + loss[i + 1:]).epochs_to(target) for i in range(len(k))]
    middle = whole.epochs_to(target)
    return Prediction(target, middle, min([middle, *ends]), max([middle, *ends]), whole)


def last_run(records: list) -> list:
    """The records of the last run in a ``train --metrics`` file's lines
    (a file appended to by several runs: from its last epoch 1)."""
    starts = [i for i, r in enumerate(records) if isinstance(r, dict) and r.get("epoch") == 1]
    return records[starts[-1]:] if starts else records


def is_number(value) -> bool:
    """A finite int or float (not a bool, a string or None)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def json_lines(path: str) -> list[tuple[int, object]]:
    """A JSON-lines file's records, each with its line number (blank lines
    skipped); ValueError naming the file where it cannot be read or a line
    is not JSON (or the file not text)."""
    records, n = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    records.append((n, json.loads(line)))
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON lines ({e.msg}, line {n})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not JSON lines (not UTF-8 text)") from None
    return records


def fit_metrics(path: str, key: str = "loss") -> tuple[list[int], list[float]]:
    """(epochs, losses) from a ``train --metrics`` JSONL file (its ``epoch``
    and ``key`` fields) of its last run (:func:`last_run`).

    Raises:
        ValueError: unreadable, not JSON lines, or a line without a numeric
            ``epoch`` and ``key``.
    """
    numbered = json_lines(path)
    numbered = numbered[len(numbered) - len(last_run([r for _, r in numbered])):]
    lines = [r for _, r in numbered]
    bad = [n for n, r in numbered if not isinstance(r, dict) or not is_number(r.get("epoch"))
           or not is_number(r.get(key))]
    if not lines or bad:
        where = f" (line {bad[0]} is not)" if bad else ""
        raise ValueError(f"{path}: every line of its last run needs a numeric 'epoch' and {key!r}{where}")
    return [int(r["epoch"]) for r in lines], [float(r[key]) for r in lines]


def prediction_fields(history: list[dict], target: float, key: str = "loss", model: str = "optimus") -> dict:
    """What ``train --target-loss`` adds to an epoch's line: the epoch at
    which ``key`` reaches ``target`` by ``model`` fitted to ``history`` (the
    epoch records so far), and its interval; None where the fit never
    reaches it."""
    losses = [r[key] for r in history]
    if not all(math.isfinite(v) and 0 < v <= _HUGE for v in losses):  # a diverged (or exact) run: no fit, no abort
        return {"predicted_epoch": None, "predicted_epoch_low": None, "predicted_epoch_high": None}
    p = predict_epochs([r["epoch"] for r in history], losses, target, model)

    def finite(v: float):
        return None if math.isinf(v) else round(v, 2)

    return {"predicted_epoch": finite(p.epochs), "predicted_epoch_low": finite(p.low),
            "predicted_epoch_high": finite(p.high)}


def noise_scale(small_sq: float, big_sq: float, small: float, big: float) -> dict:
    """The gradient noise scale from mean squared gradient norms at two
    batch sizes: ``small_sq`` over batches of ``small`` samples (one rank's),
    ``big_sq`` over ``big`` (all ranks'). Returns ``grad_sq`` (|G|²),
    ``grad_var`` (S, the trace of one sample's gradient covariance) and
    ``noise_scale`` (S/|G|², samples; None when the estimate of |G|² is not
    positive, as a few noisy steps can make it).

    Raises:
        ValueError: ``big`` not larger than ``small``, or a negative norm.
    """
    if not big > small > 0:
        raise ValueError(f"the two batch sizes must be 0 < small < big, got {small} and {big}")
    if small_sq < 0 or big_sq < 0:
        raise ValueError("squared norms cannot be negative")
    g2 = (big * big_sq - small * small_sq) / (big - small)
    var = (small_sq - big_sq) / (1.0 / small - 1.0 / big)
    return {"grad_sq": g2, "grad_var": var, "noise_scale": var / g2 if g2 > 0 and var >= 0 else None}


def epochs_factor(noise: float | None, base_batch: float, batch: float) -> float:
    """Epochs to the same progress at global batch ``batch`` over those at
    ``base_batch``: (1 + B/B_noise) / (1 + B0/B_noise). 1.0 when the noise
    scale is unknown (None): epochs taken as independent of the batch, as
    perfect linear scaling assumes."""
    if not (base_batch > 0 and batch > 0):
        raise ValueError(f"batches must be positive, got {base_batch} and {batch}")
    if noise is None:
        return 1.0
    if not noise > 0:
        raise ValueError(f"the noise scale must be positive, got {noise}")
    return (1.0 + batch / noise) / (1.0 + base_batch / noise)
