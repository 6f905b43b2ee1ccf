"""The controller's coordinator (rank 0 of the ``hvd`` communicator): the
table of what each rank has submitted, and each cycle's responses.

A key is ready when every member of its process set that has not joined
has submitted it; the ready keys of a cycle become responses in the order
they became ready, with fusable allreduces (one process set, dtype,
device, op and scale factors) merged up to the fusion threshold. A
response carries an error instead of running when the ranks' fields
differ, when some rank's arguments failed, or when a rank has joined and
the operation is not an allreduce (or a barrier). When every rank has
joined, the join response carries the rank that joined last. A key pending
longer than the stall time prints Horovod's stall warning, naming the
ranks that have not submitted it (:mod:`~hpcjobs.horovod._controller`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from ..collectives.agreement import disagreements, ranks_text

__all__ = ["Coordinator"]


def _fuse_key(set_id: int, kind: str, meta: dict):
    """What fused allreduces share (None: not fusable)."""
    if kind != "allreduce" or "," in meta["dtypes"] or "," in meta["devices"]:
        return None
    return set_id, meta["dtypes"], meta["devices"], meta["op"], meta["prescale"], meta["postscale"]


def _mismatch(what: str, entries: dict) -> str | None:
    """The error text for a key's entries (rank -> wire tuple), or None."""
    calls = {r: (e[3], e[4]) for r, e in entries.items()}
    problems = disagreements(calls, dict.fromkeys(k for m, _ in calls.values() for k in m))
    if not problems:
        return None
    return f"{what}: the ranks disagree or failed, so nothing was sent -- " + " | ".join(problems)


class Coordinator:
    """Rank 0's table (module docstring). ``members(set_id)``: a process
    set's ranks, None while not registered here."""

    def __init__(self, size: int, members: Callable, fusion: int, stall_s: float):
        self.size, self.members, self.fusion, self.stall_s = size, members, fusion, stall_s
        self.table: dict[tuple, dict[int, tuple]] = {}  # (set, key) -> rank -> wire tuple
        self._since: dict[tuple, float] = {}
        self._warned: dict[tuple, float] = {}
        self.joined: list[int] = []
        self.quitting: set[int] = set()

    def record(self, rank: int, wires: list) -> None:
        now = time.monotonic()
        for w in wires:
            set_id, key, kind = w[0], w[1], w[2]
            if kind == "join":
                self.joined.append(rank)
                continue
            if kind == "shutdown":
                self.quitting.add(rank)
                continue
            self.table.setdefault((set_id, key), {})[rank] = w
            self._since.setdefault((set_id, key), now)

    def negotiate(self) -> list:
        """The responses ready this cycle (module docstring):
        ``(set_id, kind, keys, error, specs, meta)`` (meta: the first
        request's fields, which a joined rank's zeros follow)."""
        joined = set(self.joined)
        ready = []
        for (set_id, key), entries in list(self.table.items()):
            members = self.members(set_id)
            if members is None:
                continue  # a process set this rank has not registered yet
            needed = [r for r in members if r not in joined]
            if not needed or any(r not in entries for r in needed):
                continue
            del self.table[(set_id, key)]
            self._since.pop((set_id, key), None)
            self._warned.pop((set_id, key), None)
            first = entries[needed[0]]
            kind = first[2]
            error = _mismatch(f"hvd.{kind} {key!r}", entries)
            absent = sorted(joined & set(members))
            if error is None and absent and kind not in ("allreduce", "barrier"):
                error = (f"hvd.{kind} {key!r} is not supported with hvd.join(): {ranks_text(absent)} "
                         "joined and contribute nothing")
            ready.append([set_id, kind, [key], error, [first[6]], first[5], _fuse_key(set_id, kind, first[3]),
                          first[3]])
        responses = self._fuse(ready)
        if self.joined and len(joined) == self.size:
            responses.append((0, "join", ["join"], None, [self.joined[-1]], {}))
            self.joined = []
        if len(self.quitting) == self.size:  # last: after whatever else is ready
            responses.append((0, "shutdown", ["shutdown"], None, [], {}))
            self.quitting = set()
        return responses

    def _fuse(self, ready: list) -> list:
        """Fusable allreduces of the cycle merged, up to the threshold."""
        out, open_ = [], {}
        for set_id, kind, keys, error, specs, nbytes, fkey, meta in ready:
            if error is None and fkey is not None and self.fusion > 0:
                slot = open_.get(fkey)
                if slot is not None and slot[1] + nbytes <= self.fusion:
                    out[slot[0]][2].extend(keys)
                    out[slot[0]][4].extend(specs)
                    open_[fkey] = (slot[0], slot[1] + nbytes)
                    continue
                open_[fkey] = (len(out), nbytes)
            out.append([set_id, kind, keys, error, specs, meta])
        return [tuple(r) for r in out]

    def check_stalls(self) -> None:
        if not self.stall_s or not self._since:
            return
        now = time.monotonic()
        missing: dict[int, list[str]] = {}
        for k, t0 in self._since.items():
            if now - t0 < self.stall_s or now - self._warned.get(k, 0.0) < self.stall_s:
                continue
            self._warned[k] = now
            members = self.members(k[0]) or []
            for r in members:
                if r not in self.table.get(k, {}) and r not in self.joined:
                    missing.setdefault(r, []).append(k[1])
        if missing:
            lines = "\n".join(f"{r}: [{', '.join(sorted(names))}]" for r, names in sorted(missing.items()))
            print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] WARNING: hpcjobs.horovod stall inspector: One or more "
                  "tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are "
                  f"waiting for remainder of ranks for more than {self.stall_s:g} seconds. This may indicate that "
                  "different ranks are trying to submit different tensors or that only subset of ranks is "
                  f"submitting tensors, which will cause deadlock.\nMissing ranks:\n{lines}",
                  file=sys.stderr, flush=True)

