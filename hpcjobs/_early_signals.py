"""A SIGUSR1 that reaches a rank before its run has set its handlers is
noted, not the rank's end: the ranks of ``hpcjobs slurm launch --requeue``
(which sets ``HPCJOBS_STOP_FILE``) run ``train`` with this handler from
the moment ``hpcjobs.cli.main`` knows the command, and the run's own
(:class:`hpcjobs.training.preempt.Noted`) takes what it noted over: a rank
still loading torch, its data or the checkpoint it resumes from stops after
the run's second step (the parameter server: at its first pause) with a
checkpoint, where the signal had killed it. A run that takes no signals (no
``--checkpoint``) gets the previous action back, and a signal noted
meanwhile is raised again where that action was the default: it ends the
rank once its set-up is done. Nothing here imports MPI."""

from __future__ import annotations

import signal

__all__ = ["note", "take"]

_noted: list[int] = []
_previous: dict = {}  # signal -> the handler note() replaced


def note(signums=(signal.SIGUSR1,)) -> None:
    """Note ``signums`` from now on, until :func:`take`."""
    for s in signums:
        _previous.setdefault(s, signal.signal(s, lambda sig, frame: _noted.append(sig)))


def take(keep: bool) -> tuple[int, dict]:
    """Once: the first signal noted since :func:`note` (0: none) and the
    handlers note() replaced, by signal. ``keep``: the caller has set its
    own handlers (and gives those back when it ends); otherwise the
    replaced handlers come back, and a signal noted is raised again where
    its handler was the default action (it ends the process)."""
    previous = dict(_previous)
    _previous.clear()
    if not keep:  # before reading what was noted: a signal from now on meets the handler it would have
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    first = _noted[0] if _noted else 0
    _noted.clear()
    if not keep and first and previous.get(first, signal.SIG_DFL) in (signal.SIG_DFL, None):
        signal.raise_signal(first)
    return first, previous
