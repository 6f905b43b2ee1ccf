"""Error feedback, a.k.a. memory (Seide et al. 2014; Stich et al. 2018;
Karimireddy et al. 2019): what compression drops this step is added back
the next.

For each tensor, by name::

    x     = g + e           # compensate: the gradient plus the residual
    sent  = C(x)            # compress (what reaches the other ranks)
    e     = x - D(sent)     # update: what was not sent, kept for next step

so g + e_old = D(C(x)) + e_new exactly, at every step: nothing is lost,
only delayed. The residuals belong to this rank (each rank drops different
things) and go into checkpoints through ``state_dict``.

Whether a step counts is decided from the average, which is the same on
every rank, not from this rank's own numbers: where the average is not
finite (an overflow anywhere, which fp16's loss scaling or
``nonfinite="skip"`` then skips on every rank) every rank keeps the residual
it had, as nothing was applied; where it is finite the residual is updated,
its own non-finite entries (an overflow here that the compressor did not
send: random-k's unsampled inf) set to zero, as inf minus inf kept would
turn every later gradient into NaN. Before 2026-11-28 each rank decided from
its own tensor: a rank whose own inf went unsent kept its old residual and
sent it again, and ranks without an overflow lost what they had sent in a
step the others' overflow then skipped.
Where an optimizer skips a whole step on one tensor's overflow
(``nonfinite="skip"``, fp16's GradScaler), the other tensors' steps are
skipped too. With ``per_step=True`` (what
:class:`~hpcjobs.training.DistributedOptimizer` uses) :meth:`update` holds
the new residuals back until :meth:`commit` at the end of the step's
reductions, which, told the step is all or none, keeps them all where every
tensor's average was finite and none where one was not (each tensor's own
average decides otherwise). Per tensor alone, a finite tensor's residual was
updated in a step that another's overflow skipped, and what it had sent that
step was lost.
Residuals of gradients scaled by a loss scale are in its units: when the
scale changes, :meth:`rescale` them by new / old.
"""

from __future__ import annotations

import torch

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Per-tensor residuals of a compressor, keyed by name."""

    def __init__(self, per_step: bool = False):
        self.residuals: dict[str, torch.Tensor] = {}
        self.per_step = per_step  # hold updates back until commit() (module docstring)
        self.pending: dict[str, tuple[torch.Tensor, bool]] = {}

    def check(self, name: str, tensor: torch.Tensor) -> None:
        """ValueError where the residual kept for ``name`` is not of
        ``tensor``'s shape and dtype (compressed_allreduce asks every rank
        before any of them compensates)."""
        e = self.residuals.get(name)
        if e is not None and (e.shape != tensor.shape or e.dtype != tensor.dtype):
            raise ValueError(f"error feedback for {name!r}: residual is {e.dtype}{tuple(e.shape)}, "
                             f"the tensor {tensor.dtype}{tuple(tensor.shape)}; one name, one tensor")

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` plus the residual stored for ``name`` (a new tensor)."""
        self.check(name, tensor)
        e = self.residuals.get(name)
        if e is None:
            return tensor.clone()
        if e.device != tensor.device:  # loaded on another device (a state saved on a GPU read with map_location)
            e = self.residuals[name] = e.to(tensor.device)
        return tensor + e

    def update(self, name: str, compensated: torch.Tensor, decompressed: torch.Tensor,
               applied: bool = True) -> None:
        """Keep ``compensated - decompressed`` as ``name``'s residual, its
        non-finite entries zero, if the step was ``applied`` (its average
        finite, the same on every rank); else the residual stays as it was
        (module docstring). With ``per_step``, held back until :meth:`commit`."""
        if self.per_step:
            self.pending[name] = (compensated - decompressed if applied else None, applied)
            return
        if not applied:
            return
        self.residuals[name] = (compensated - decompressed).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def commit(self, all_or_none: bool) -> bool:
        """End a step (``per_step``): keep the residuals :meth:`update` held
        back, each where its tensor's average was finite, or, ``all_or_none``
        (the optimizer skips the whole step on one overflow), all of them
        where every average was finite and none otherwise. Returns whether
        every average was finite (True with nothing held)."""
        pending, self.pending = self.pending, {}
        counted = all(applied for _, applied in pending.values())
        for name, (e, applied) in pending.items():
            if applied and (counted or not all_or_none):
                self.residuals[name] = e.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return counted

    def discard(self) -> None:
        """Drop what :meth:`update` held back (a step that failed)."""
        self.pending = {}

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (a loss scale's new / old)."""
        for e in self.residuals.values():
            e.mul_(factor)

    def state_dict(self) -> dict:
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}

    def __repr__(self) -> str:
        return f"ErrorFeedback({len(self.residuals)} tensors)"
