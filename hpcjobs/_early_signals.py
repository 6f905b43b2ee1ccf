"""A SIGUSR1 that reaches a rank before its run has set its handlers is
noted, not the rank's end: the ranks of ``hpcjobs slurm launch --requeue``
(which sets ``HPCJOBS_STOP_FILE``) start ``train`` with this handler, the
first thing ``hpcjobs.cli.main`` does, and the run's own
(:class:`hpcjobs.training.preempt.Noted`) takes what it noted over: a
requeued job reading a large checkpoint, or one still loading its data,
stops at its first step with a checkpoint where the signal had killed it.
A run that takes no signals (no ``--checkpoint``) gets the default action
back, and a signal noted meanwhile is raised again: it ends the run, as it
would have. Nothing here imports MPI."""

from __future__ import annotations

import signal

__all__ = ["note", "take"]

_noted: list[int] = []
_installed: list[int] = []


def note(signums=(signal.SIGUSR1,)) -> None:
    """Note ``signums`` from now on, until :func:`take`."""
    for s in signums:
        signal.signal(s, lambda sig, frame: _noted.append(sig))
        _installed.append(s)


def take(keep: bool) -> tuple[int, list[int]]:
    """The first signal noted since :func:`note` (0: none), once, and the
    signals that were noted. ``keep``: the caller has set its own handlers
    (whose previous one, this, is the default action); otherwise the
    default actions come back, and a signal noted is raised again (it ends
    the process)."""
    first, installed = (_noted[0] if _noted else 0), list(_installed)
    _noted.clear()
    _installed.clear()
    if not keep:
        for s in installed:
            signal.signal(s, signal.SIG_DFL)
        if first:
            signal.raise_signal(first)
    return first, installed
