"""``algorithm="auto"``: pick an allreduce algorithm from a measured tuning
table, and keep measuring.

The tuning table (written by ``hpcjobs tune``) lists, for a number of ranks
and nodes, the fastest algorithm up to each message size, and the
contenders that came close there::

    {"version": 1, "tables": [{"ranks": 2, "nodes": 1,
        "rows": [{"max_bytes": 4096, "algorithm": "recursive_doubling",
                  "candidates": ["recursive_doubling", "tree"]},
                 {"max_bytes": null, "algorithm": "shm"}]}]}

``auto`` reads the file named by ``HPCJOBS_TUNING`` (or :func:`set_tuning`),
takes the table with the same ranks and nodes (and, where the table records
them, the same ranks on each node: ``"local_sizes"``), else the same nodes
and the nearest ranks, else the nearest overall (rank 0 warns once where a
file has no table for the layout), and falls back on
:data:`DEFAULT_TABLE` when there is no file. It reads the node layout
(``hpcjobs.topology``, ``HPCJOBS_RANKS_PER_NODE``) once per communicator and
caches each decision on it per size, so a call costs a dictionary lookup.

Where a row lists several candidates, ``auto`` also times them in place: on
a shared node the fastest algorithm at a size changes with the load beside
it (the shared-memory one most: it relies on the last-level cache, which
neighbours share), so a table measured a minute ago can be wrong by 3x now.
The first calls at a size run each candidate in turn, in
:class:`hpcjobs.timing.Rounds` as ``hpcjobs bench`` times: twice untimed
(the first calls on a buffer pay for allocation and cold caches), then
:func:`timed_rounds` times (5, or 15 for small messages), each call timed
from a barrier, in a fresh order each round; then one small
``MPI_Allreduce`` (maximum over ranks) of those times gives every rank the
same numbers, and every rank keeps the candidate with the lowest median
time. It measures again every :data:`REMEASURE_EVERY` calls at that size.
Horovod's autotuner times its own settings online the same way.
Only candidates that give bitwise the same result are compared (every
algorithm does for min and max, for integers, and at two ranks), so which
one wins never changes a run's numbers; floating-point sums over three or
more ranks follow the table alone.
"""

from __future__ import annotations

import bisect
import os

import numpy as np
from mpi4py import MPI

from ..comm import by_value, private
from ..timing import Rounds
from ..topology import detect_private
from ._buffers import Flat, as_flat
from . import oneshot
from ._frame import Algorithm
from ._shared import is_single_node
from .tuning import DEFAULT_TABLE, _pick_table, load_tuning, warn_other_layout
from .device import DEVICE_REDUCE_DTYPES, DeviceFlat, as_device_flat, is_device_buffer
from .names import ALGORITHMS

__all__ = ["DEFAULT_TABLE", "DEVICE_SMALL_BYTES", "REMEASURE_EVERY", "UNTIMED_TURNS", "step", "oneshot_next",
           "allreduce_device", "candidates", "choose", "device_candidates", "kept",
           "load_tuning", "remeasure", "same_bits", "set_tuning", "settled", "table_used", "timed_rounds"]

# Calls at one message size between two measurements of its candidates.
REMEASURE_EVERY = 1000
# Untimed turns of every candidate before a measurement's timed rounds. On a
# fresh buffer the shared-memory algorithm's first two calls here took 1.5-2x
# its steady time (the others' about 1.3x); one turn left its first timed
# round in that, enough to lose a 1 MB measurement it wins by 1.3x.
UNTIMED_TURNS = 2
# Timed calls of each candidate per measurement, of which the median counts:
# in a busy spell here one call in three or four of the shared-memory
# algorithm's is 2-3x slow, which a median of five rides over. A measurement
# is then (2 + 5) calls per candidate, 2% of the calls between measurements.
TIMED_ROUNDS = 5
# Up to SMALL_BYTES a call takes ~10 us here, and one call's noise (about
# 1 us) is larger than the gaps between the latency-bound algorithms; the
# median of 15 halves the error of a median of 5, for half a millisecond.
SMALL_TIMED_ROUNDS, SMALL_BYTES = 15, 16 << 10


def timed_rounds(nbytes: int) -> int:
    """Timed calls of each candidate in one measurement at ``nbytes``."""
    return SMALL_TIMED_ROUNDS if nbytes <= SMALL_BYTES else TIMED_ROUNDS


_tuning_path: str | None = None


def set_tuning(path: str | None) -> None:
    """Use this tuning file for ``auto`` from now on (None: ``HPCJOBS_TUNING``
    or the built-in default). Clears cached decisions (:func:`remeasure`),
    so, as that, call it on every rank, between collectives; the next call
    at each size checks that the ranks' tables agree there."""
    global _tuning_path
    _tuning_path = path
    load_tuning.cache_clear()
    remeasure()


def remeasure() -> None:
    """Forget what ``auto`` measured, on every communicator: its next call at
    each size times the candidates again, as it does every
    :data:`REMEASURE_EVERY` calls. Call it on every rank, between
    collectives; ``hpcjobs bench --passes`` does before each pass, so that
    each pass measures as a fresh job would."""
    global _decisions_generation, _last
    _decisions_generation += 1
    _last = (None, None)


def _tuning_file() -> str | None:
    """The tuning file in effect: :func:`set_tuning`'s, else ``HPCJOBS_TUNING``'s, else None (built-in)."""
    return _tuning_path or os.environ.get("HPCJOBS_TUNING") or None


def _tuning() -> dict:
    return load_tuning(_tuning_file())


def table_used(comm: MPI.Comm | None = None) -> str:
    """Which tuning table ``auto`` uses on ``comm`` (collective the first
    time: it reads the node layout), e.g. "tuning.json: 4 ranks on 2 nodes
    [2, 2], link 0.98 Gbit/s (tuned 4 ranks on 2 nodes [2, 2])"."""
    comm = private(comm)
    topo = detect_private(comm)
    path = _tuning_file()
    t = _pick_table(_tuning(), comm.Get_size(), topo.num_nodes, topo.local_sizes, topo.source == "override")
    shape = f"{t['ranks']} ranks on {t['nodes']} node(s)" + (f" {list(t['local_sizes'])}" if t.get("local_sizes")
                                                            else "")
    link = f", link {t['link_gbps']:.2f} Gbit/s" if t.get("link_gbps") else ""
    here = f"{comm.Get_size()} ranks on {topo.num_nodes} node(s) {list(topo.local_sizes)}"
    return f"{path or 'built-in table'}: the table of {shape}{link}, for {here}"


def _warn_layout(topo, ranks: int) -> None:
    try:  # (a table this rank cannot read is refused on every rank by the step's check)
        warn_other_layout(_tuning_file(), _tuning(), ranks, topo.num_nodes, topo.local_sizes, topo.source == "override")
    except ValueError:
        pass


def _row(nbytes: int, ranks: int, nodes: int, tuning: dict | None, local_sizes: tuple | None = None,
         simulated: bool | None = None) -> dict:
    table = _pick_table(tuning or _tuning(), ranks, nodes, local_sizes, simulated)
    rows = table["rows"]
    bounds = [r["max_bytes"] for r in rows[:-1]]
    return rows[bisect.bisect_left(bounds, nbytes)]


def _placed(name: str, one_node: bool) -> str:
    if one_node:
        return name
    return {"shm": "hierarchical", "oneshot": "recursive_doubling"}.get(name, name)


def choose(nbytes: int, ranks: int, nodes: int = 1, tuning: dict | None = None) -> str:
    """The algorithm the table gives ``auto`` for ``nbytes`` over ``ranks``
    ranks on ``nodes`` nodes (what it runs until it has timed the others)."""
    return _placed(_row(nbytes, ranks, nodes, tuning)["algorithm"], nodes == 1)


def candidates(nbytes: int, ranks: int, nodes: int = 1, tuning: dict | None = None,
               local_sizes: tuple | None = None, simulated: bool | None = None) -> list[str]:
    """The table's choice first, then the row's other contenders: its
    ``candidates``, or for a table without them (an older ``hpcjobs tune``)
    the runner-ups it measured. ``local_sizes``: ranks on each node, and
    ``simulated``: nodes simulated on one host, to pick the table tuned on
    the same layout."""
    row = _row(nbytes, ranks, nodes, tuning, local_sizes, simulated)
    names = row.get("candidates") or [row["algorithm"], *(m.get("runner_up") for m in row.get("measured", []))]
    names = [n for n in names if n in ALGORITHMS]  # a hand-edited table's "measured" may name anything
    return list(dict.fromkeys(_placed(n, nodes == 1) for n in [row["algorithm"], *names]))


# Up to this size auto tries the staged transport before cuda_ipc on CUDA
# tensors: on one H100 shared by 4 ranks staged took 0.42-0.71 ms up to
# 512 KB against cuda_ipc's 1.07-1.55 ms, and they met at 2 MB
# (docs/results/gpu.md). Where auto cannot time both (float sums over 3 or
# more ranks) the first one is what it runs.
DEVICE_SMALL_BYTES = 1 << 20


def device_candidates(nbytes: int, dtype: str, one_node: bool) -> list[str]:
    """The device transports ``auto`` runs on CUDA tensors, its first
    choice first: names in :data:`hpcjobs.collectives.select.DEVICE_REGISTRY`."""
    if dtype not in DEVICE_REDUCE_DTYPES:
        return ["staged"]
    direct = "cuda_ipc" if one_node else "hierarchical"
    return ["staged", direct] if nbytes <= DEVICE_SMALL_BYTES else [direct, "staged"]


def same_bits(dtype: str, op: str, ranks: int) -> bool:
    """Whether every algorithm gives the same result: min and max, integers
    (wrap-around sums and products do not depend on order), and any op at
    two ranks (a + b, once): the same values, bit for bit but for the sign of
    a zero min or max and a NaN's payload, which follow the operands' order.
    Floating-point sums over three or more ranks round differently in
    different orders."""
    return op in ("min", "max") or ranks <= 2 or not (dtype == "bfloat16" or dtype.startswith("float"))


class _Timing:
    """``auto``'s decision at one message size, and its measurement.

    A measurement is one :class:`~hpcjobs.timing.Rounds` of the candidates:
    :data:`UNTIMED_TURNS` untimed rounds (the first calls on a buffer are
    slow: allocation, cold caches, and on this VM fresh pages stay slow for
    a few passes), then :func:`timed_rounds` timed ones, one turn per call.
    After the last one the times are maxed over ranks and the candidate with
    the lowest median kept, until :data:`REMEASURE_EVERY` calls after the
    measurement began (at least one call: :func:`settled` must become
    true). ``left`` counts the calls to go before the next measurement.
    """

    __slots__ = ("names", "fns", "fn", "timed", "rounds", "left", "nbytes", "measured")

    def __init__(self, names: list[str], registry: dict[str, Algorithm], nbytes: int, device: bool = False):
        self.names = names
        self.fns = [registry[n].bound for n in names]
        if device:
            self.fns = [_waited(fn) for fn in self.fns]
        self.fn = self.fns[0]
        self.timed, self.nbytes, self.measured = timed_rounds(nbytes), nbytes, 0
        # each measurement in its own orders, the same on every rank: seeded by the size and its count
        self.rounds = Rounds(len(names), UNTIMED_TURNS, self.timed, (nbytes, 0)) if len(names) > 1 else None
        self.left = 0 if len(names) > 1 else float("inf")

    def count(self) -> None:
        """A call the agreement check ran for the kept algorithm (oneshot_next)."""
        self.left -= 1

    def measure(self, flat: Flat, op: str, comm: MPI.Intracomm) -> None:
        """One call of the measurement, in the candidates' turn order."""
        rounds = self.rounds
        rounds.call(comm, self.fns[rounds.current], flat, op, comm)
        if rounds.done:  # agree on the fastest
            comm.Allreduce(MPI.IN_PLACE, rounds.times, op=MPI.MAX)
            # The median, not the best round: the shared-memory algorithm
            # swings between fast and 3x slower calls in a busy spell, and
            # its best call would hide that.
            self.fn = self.fns[int(np.argmin(np.median(rounds.times, axis=0)))]
            self.left = max(1, REMEASURE_EVERY - rounds.calls)
            self.measured += 1
            self.rounds = Rounds(len(self.names), UNTIMED_TURNS, self.timed, (self.nbytes, self.measured))


# Decisions live on the communicator (MPI attribute), so they go with it;
# the latest communicator's are also kept here, which skips MPI_Comm_get_attr
# (half a microsecond) on the usual run of calls on one communicator.
_DECISIONS_KEYVAL = MPI.Comm.Create_keyval()
_decisions_generation = 0
_last: tuple = (None, None)


def _decisions(comm: MPI.Intracomm) -> dict:
    decisions = comm.Get_attr(_DECISIONS_KEYVAL)
    if decisions is None or decisions.get("generation") != _decisions_generation:
        decisions = {"generation": _decisions_generation}
        comm.Set_attr(_DECISIONS_KEYVAL, decisions)
    return decisions


def _timing(flat: Flat, op: str, comm: MPI.Intracomm, decisions: dict, registry: dict) -> _Timing:
    topo = decisions.get("topology")
    if topo is None:  # the layout, read once per communicator (and set_tuning)
        topo = decisions["topology"] = detect_private(comm)
        if comm.Get_rank() == 0:
            _warn_layout(topo, comm.Get_size())
    single = is_single_node(comm)  # (collective the first time: before anything that may raise on one rank)
    try:
        names, error = candidates(flat.nbytes, comm.Get_size(), topo.num_nodes, local_sizes=topo.local_sizes,
                                  simulated=topo.source == "override"), None
    except Exception as e:  # noqa: BLE001 -- this rank's own table (set_tuning's file, missing or bad here)
        names, error = [], f"{type(e).__name__}: {e}"
    # One simulated node may still span hosts: shm needs real shared memory.
    names = list(dict.fromkeys(_placed(n, single) for n in names))
    if not same_bits(flat.dtype, op, comm.Get_size()):
        names = names[:1]
    _agree_on(names, error, flat.nbytes, comm)
    timing = decisions[(flat.nbytes, flat.dtype, op)] = _Timing(names, registry, flat.nbytes)
    return timing


def _agree_on(names: list[str], error: str | None, nbytes: int, comm: MPI.Intracomm) -> None:
    """Raise on every rank where a rank could not read its tuning table
    (``error``) or the ranks' tables give them different candidates at this
    size (a table on some hosts only, or another one there): each would run
    its own algorithm, and the job would hang or, where their messages
    happen to match, reduce wrongly. Once per size on a communicator,
    whatever the agreement checks are set to."""
    everyone = comm.allgather((names, error))
    if all(theirs == (names, None) for theirs in everyone):
        return
    raise ValueError(f"auto at {nbytes} bytes: the ranks' tuning tables "
                     + ("could not be read or give different algorithms" if any(e for _, e in everyone)
                        else "give different algorithms") + " -- "
                     + by_value([err or ", ".join(theirs) for theirs, err in everyone])
                     + " -- give every rank the same table (HPCJOBS_TUNING or set_tuning; `hpcjobs info "
                       "--all-ranks` names each rank's)")


def _waited(fn):
    """``fn``, then wait for the device: a device transport returns before
    its GPU work is done, and a timed call must include it. (Outside a
    measurement the kept one runs unwaited.)"""

    def call(flat, op, comm):
        fn(flat, op, comm)
        if flat.tensor.is_cuda:
            import torch

            torch.cuda.current_stream(flat.tensor.device).synchronize()

    call.unwaited = fn
    return call


def allreduce_device(flat: DeviceFlat, op: str, comm: MPI.Intracomm, registry: dict[str, Algorithm]) -> None:
    """The step of ``algorithm="auto"`` on a CUDA tensor: the kept device
    transport from ``registry`` (module docstring)."""
    decisions = _decisions(comm)
    key = (flat.nbytes, flat.dtype, op, "device")
    timing = decisions.get(key)
    if timing is None:
        names = device_candidates(flat.nbytes, flat.dtype, is_single_node(comm))
        if not same_bits(flat.dtype, op, comm.Get_size()):
            names = names[:1]
        timing = decisions[key] = _Timing(names, registry, flat.nbytes, device=True)
    if timing.left:
        timing.left -= 1
        getattr(timing.fn, "unwaited", timing.fn)(flat, op, comm)
    else:
        timing.measure(flat, op, comm)


def step(registry: dict[str, Algorithm], device_registry: dict[str, Algorithm] | None, flat, op: str,
         comm: MPI.Intracomm) -> None:
    """``auto``'s step: the kept candidate (or the measurement's next one) on
    a :class:`Flat`, :func:`allreduce_device` on a CUDA tensor's DeviceFlat.
    ``allreduce(algorithm="auto")`` runs it with the registries bound (a
    ``functools.partial``: no Python call in between on small messages)."""
    global _last
    if type(flat) is not Flat:
        return allreduce_device(flat, op, comm, device_registry)
    last_comm, decisions = _last
    if last_comm is not comm:  # (set_tuning clears _last)
        decisions = _decisions(comm)
        _last = (comm, decisions)
    timing = decisions.get((flat.data.nbytes, flat.dtype, op)) or _timing(flat, op, comm, decisions, registry)
    if timing.left:  # the usual call: the kept algorithm, no method call in between
        timing.left -= 1
        timing.fn(flat, op, comm)
    else:
        timing.measure(flat, op, comm)


def oneshot_next(flat: Flat, op: str, comm: MPI.Intracomm):
    """Whether ``auto``'s next call on ``flat`` runs oneshot's step in one
    piece, without measuring -- then the agreement check may carry the
    message (:func:`hpcjobs.collectives.agreement.agree_or_raise`): a
    function to call once it has, which counts the call as the step would
    have (so every rank measures again at the same call); else None. The
    same on every rank that calls with the same signature."""
    last_comm, decisions = _last
    if last_comm is not comm:
        decisions = _decisions(comm)
    timing = decisions.get((flat.data.nbytes, flat.dtype, op))
    if timing is not None and timing.left > 0 and timing.fn is oneshot.allreduce and flat.data.nbytes <= oneshot.MAX_BYTES:
        return timing.count
    return None


def _decision(nbytes: int, dtype: str, op: str, comm: MPI.Comm | None, device: bool = False) -> _Timing | None:
    return _decisions(private(comm)).get((nbytes, dtype, op, "device") if device else (nbytes, dtype, op))


def settled(buf, op: str = "sum", comm: MPI.Comm | None = None) -> bool:
    """Whether ``auto`` has done measuring for ``buf``'s size and dtype and
    ``op`` on ``comm``: its next such call runs the algorithm it kept (until
    the next measurement, :data:`REMEASURE_EVERY` calls on). False before the
    first call; always True on one rank, which reduces nothing and so has
    nothing to measure. The same on every rank, so ranks may loop on it, as
    ``hpcjobs bench`` does to time what ``auto`` settles on."""
    if private(comm).Get_size() == 1:
        return True
    device = is_device_buffer(buf)
    flat = as_device_flat(buf) if device else as_flat(buf)
    timing = _decision(flat.nbytes, flat.dtype, op, comm, device)
    return timing is not None and timing.left > 0


def kept(nbytes: int, dtype: str, op: str = "sum", comm: MPI.Comm | None = None, device: bool = False) -> str | None:
    """The algorithm ``auto`` runs now for ``nbytes`` of ``dtype`` (its name,
    e.g. "float32" or "bfloat16") and ``op`` on ``comm``: the table's choice
    until its contenders are timed, then the fastest. None before its first
    call there. ``device``: what it runs on CUDA tensors (a device
    transport's name)."""
    timing = _decision(nbytes, dtype, op, comm, device)
    return None if timing is None else timing.names[timing.fns.index(timing.fn)]
