"""A run told to stop (SIGTERM, SIGUSR1) writes a checkpoint and stops, on
every rank at the same step.

Slurm ends a job at its time limit or on preemption with SIGTERM to every
task, and SIGKILL ``KillWait`` seconds later (30 by default); the train
template's ``sbatch --signal=B:USR1@120`` warns with SIGUSR1 two minutes
before the limit, which ``hpcjobs slurm launch`` hands to ``srun`` or
``mpirun``, and they pass it on to every rank. Without this, what a
run did since its last checkpoint was lost (a whole epoch, or
``--checkpoint-every`` steps). Slurm's SIGTERM also reaches the launcher,
and ``srun`` and ``mpirun`` end their tasks on it: the ranks race them
(docs/reliability.md, "Checkpoints"); a SIGUSR1 they pass on without
ending their tasks.

A rank's handler only notes the signal. Each step, the ranks combine what
they noted in a nonblocking ``MPI_Iallreduce`` (MAX) on a communicator of
its own, started after the step and completed after the next: it costs no
wait, and every rank sees the same answer after the same step, one step
after the first rank noted it -- a signal that reaches the ranks a moment
apart, or one rank only, still stops them all together. At an epoch's end
the ranks agree once more (blocking), after its checkpoint. Only a run with
a checkpoint to write (``train --checkpoint``) takes the signals over, and
gives the previous handlers back when it ends. The ranks meet once more
after a checkpoint written mid-epoch, so none leaves (and none of its
launcher's kill-on-exit rules fires) while rank 0 still writes it.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import numpy as np
from mpi4py import MPI

from .._early_signals import take
from .._files import atomic_write
from ..collectives.watchdog import guard
from ..slurm import STOP_FILE_ENV, stop_point

__all__ = ["SIGNALS", "Noted", "Stopped", "StopSignals", "write_stop_file"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The communicator and poll of a run that ended in an error, kept for the process's life: an active
# nonblocking collective freed with its communicator crashed a later call's progress.
_ABANDONED: list = []


class Stopped(Exception):
    """Raised on every rank by :func:`hpcjobs.training.loop.train` once a
    signal stopped the run after its checkpoint was written: the signal, and
    where the checkpoint left the run (whole epochs done, steps of the next).
    ``hpcjobs train`` exits with 128 + the signal's number, as a shell
    reports a command a signal ended."""

    def __init__(self, signum: int, epoch: int, step: int, path: str, written: bool = True):
        self.signum, self.epoch, self.step, self.path, self.written = signum, epoch, step, path, written
        where = stop_point(epoch, step)
        super().__init__(f"{signal.Signals(signum).name}: checkpoint {path} written {where}; stopped "
                         "(--resume continues from it)" if written else
                         f"{signal.Signals(signum).name}: stopped {where}, with parameters that are not finite: "
                         f"{path} not written (--resume continues from the last one, if any)")


class Noted:
    """SIGTERM and SIGUSR1 noted on this rank (``signum``: the first, 0:
    none), where ``on`` and this is the main thread (where Python runs signal
    handlers); :meth:`restore` gives the previous handlers back."""

    def __init__(self, on: bool):
        main = threading.current_thread() is threading.main_thread()
        on = on and main
        self.signum = 0
        self._previous = {s: signal.signal(s, self._note) for s in SIGNALS} if on else {}
        if main:  # one that came before this run's handlers (hpcjobs._early_signals): this run's, or raised again
            first, replaced = take(keep=on)
            self.signum = first or self.signum  # the earlier one; one may have come in between
            self._previous.update({s: h for s, h in replaced.items() if s in self._previous})

    def _note(self, signum: int, frame) -> None:
        self.signum = self.signum or signum

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)  # None: set outside Python
        self._previous = {}


class StopSignals:
    """The signals noted on this rank and agreed across ``comm`` (collective
    to make and to :meth:`close`). Off (never stops, takes no signal) when
    ``enabled`` is false or this is not the main thread (where Python runs
    signal handlers)."""

    def __init__(self, comm: MPI.Intracomm, enabled: bool):
        on = enabled and threading.current_thread() is threading.main_thread()
        with guard("train: signals", comm):
            on = comm.allreduce(int(on), op=MPI.MIN) == 1  # a rank off would never join the ranks' polls
        self._comm = comm.Dup() if on else None
        self._mine, self._any = np.zeros(1, np.int64), np.zeros(1, np.int64)
        self._request: MPI.Request | None = None
        self._signals = Noted(on)

    @property
    def noted(self) -> int:
        """The first signal this rank got, 0: none."""
        return self._signals.signum

    def _finish(self) -> int:
        """The answer of the poll in flight (0 when none is)."""
        if self._request is None:
            return 0
        self._request.Wait()
        self._request = None
        return int(self._any[0])

    def poll(self) -> int:
        """After each step, on every rank: the signal some rank had noted by
        the previous call (0: none, or off). Collective."""
        if self._comm is None:
            return 0
        answer = self._finish()
        if not answer:
            self._mine[0] = self.noted
            self._request = self._comm.Iallreduce(self._mine, self._any, op=MPI.MAX)
        return answer

    def agree(self) -> int:
        """The signal some rank has noted by now (0: none, or off), blocking:
        at an epoch's end. Collective."""
        if self._comm is None:
            return 0
        with guard("train: signals", self._comm):  # at an epoch's end, where a rank stalled in its tests waited
            earlier = self._finish()
            self._mine[0] = self.noted
            self._comm.Allreduce(self._mine, self._any, op=MPI.MAX)
        return earlier or int(self._any[0])

    def close(self) -> None:
        """Completes the poll in flight, frees the communicator and gives the
        signals back to their previous handlers. Collective where on."""
        if self._comm is None:
            return
        self._finish()
        self._comm.Free()
        self._comm = None
        self.restore()

    def restore(self) -> None:
        """Gives the signals back to their previous handlers; this rank's
        alone, so also after an error where the ranks cannot meet to
        :meth:`close` (a SIGTERM noted here after training would be lost).
        A signal after this goes to the previous handler and is not noted;
        polls, still collective until :meth:`close`, report what was noted
        before."""
        self._signals.restore()
        if self._comm is not None:  # not closed (an error): its poll may be in flight, and neither may be freed
            _ABANDONED.append((self._comm, self._request))


def write_stop_file(stopped: Stopped) -> str | None:
    """Rank 0, after a signal's stop: writes where it stopped, as JSON, to
    ``$HPCJOBS_STOP_FILE`` if that is set (whole, through a rename).
    Returns the path written, or None."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        return None
    record = {"signal": signal.Signals(stopped.signum).name, "epoch": stopped.epoch, "step": stopped.step,
              "checkpoint": stopped.path, "written": stopped.written}
    with atomic_write(path) as f:
        f.write(json.dumps(record) + "\n")
    return path
