"""A weighted least-squares line with both coefficients non-negative: the
fits where a negative slope or intercept would mean nothing physical
(Optimus's loss model, :mod:`hpcjobs.convergence`; a link's α + n·β,
:mod:`hpcjobs.perfmodel`)."""

from __future__ import annotations

import numpy as np

__all__ = ["nonnegative_line"]


def nonnegative_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """``(slope, intercept)`` minimising sum(w·(slope·x + intercept - y)^2)
    over slope, intercept >= 0."""
    A = np.stack([x, np.ones_like(x)], axis=1) * np.sqrt(w)[:, None]
    t = y * np.sqrt(w)
    (b0, b1), *_ = np.linalg.lstsq(A, t, rcond=None)
    if b0 >= 0 and b1 >= 0:
        return float(b0), float(b1)
    best = None
    for fixed in (0, 1):  # one of them at 0: the other's constrained optimum
        col = A[:, 1 - fixed]
        v = max(0.0, float(col @ t / (col @ col))) if col @ col > 0 else 0.0
        cand = (v, 0.0) if fixed == 1 else (0.0, v)
        err = float(np.sum((A @ np.array(cand) - t) ** 2))
        if best is None or err < best[0]:
            best = (err, cand)
    return best[1]
