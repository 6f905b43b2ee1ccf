"""Communicators the suite talks on, and rank-0 printing.

Every collective in hpcjobs runs on a *private duplicate* of the communicator
it is given, so its messages can never match a receive the user posted on
that communicator (MPI matches on communicator, source and tag; a Dup gives a
new matching context). The duplicate is made once per communicator, cached
on it with MPI attribute caching (``MPI_Comm_set_attr``), and freed by MPI
when the user frees their communicator.

``Comm.Dup`` is collective: the first hpcjobs collective called on a
communicator must be called by all of its ranks, which a collective is anyway.
The first on COMM_WORLD also makes the stall watchdog's own duplicate, on
which ranks ask each other where they are when a collective times out
(:mod:`hpcjobs.collectives.watchdog`). As it makes a duplicate, every rank
compares the settings that must be the same everywhere
(:func:`shared_settings`) and any job parameter it could not use, and all
raise together where they differ (:func:`refusals`), rather than one rank
alone or each running its own way.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import zlib

import numpy as np
from mpi4py import MPI

__all__ = ["world", "private", "is_root", "print0", "expect_world_size", "signature", "extremes", "agree", "exchange",
           "ranks_in", "ranks_text", "by_value", "SAME_EVERYWHERE", "SETTINGS", "LIBRARIES", "install", "libraries",
           "setting", "shared_settings", "refusals", "environment_problem", "closed_at_exit"]


def _free_private(comm, keyval, attr):
    # Runs when the user frees their communicator; at MPI_Finalize the library
    # frees everything itself and freeing here again would be an error.
    global _last
    if _last[1] is attr:  # the freed communicator was the last one asked for
        _last = (None, None)
    if not MPI.Is_finalized() and attr != MPI.COMM_NULL:
        attr.Free()


_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_private)


def private(comm: MPI.Comm | None = None, *, free_if_refused: bool = False) -> MPI.Intracomm:
    """Return the suite's private duplicate of ``comm``, made on the first
    call for it, when its ranks also compare :func:`shared_settings`.

    Args:
        comm: an intracommunicator, or None for MPI.COMM_WORLD.
        free_if_refused: ``comm`` was made for the caller, who has no use
            for it if the ranks' settings are refused: free it then too.

    Returns:
        A duplicate of ``comm``, the same object on every call for the same
        communicator.

    Raises:
        TypeError: ``comm`` is not an MPI intracommunicator.
        ValueError: ``comm`` is MPI.COMM_NULL; or, on every rank of it, a
            rank's environment cannot be used or the ranks' settings differ.
    """
    global _world_dup, _last
    if comm is None or comm is MPI.COMM_WORLD:  # the usual call, which cannot be freed: no lookup
        if _world_dup is not None:
            return _world_dup
        comm = MPI.COMM_WORLD
    last = _last
    if comm is last[0]:  # the communicator of the last call: no checks, no attribute lookup (0.6 us)
        return last[1]
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL: this rank is not part of the communicator")
    if comm.Is_inter():
        raise TypeError("hpcjobs collectives need an intracommunicator, got an intercommunicator")
    dup = comm.Get_attr(_KEYVAL)
    if dup is None:
        dup = comm.Dup()
        try:  # once per communicator, before anything runs its own way on it
            _check_shared_settings(dup)
        except BaseException:
            dup.Free()
            if free_if_refused and comm is not MPI.COMM_WORLD:
                comm.Free()
            raise
        comm.Set_attr(_KEYVAL, dup)
        if comm == MPI.COMM_WORLD:  # collective here anyway: one more for the stall watchdog
            from .collectives import watchdog

            watchdog.attach(comm.Dup())
    if comm is MPI.COMM_WORLD:
        _world_dup = dup
    else:
        _last = (comm, dup)
    return dup


_world_dup = None
_last: tuple = (None, None)  # (communicator, its duplicate) of the last call on one other than COMM_WORLD

# Read from the environment by each rank, and each rank would exchange or
# reduce its own way where they differ: how the agreement checks exchange,
# the GPU one-shot size and fence, the torch.distributed backend's algorithm;
# each with its default (unset and the default are the same setting).
SAME_EVERYWHERE = {"HPCJOBS_AGREE_VIA": "oneshot", "HPCJOBS_CUDA_IPC_ONE_SHOT": str(256 << 10),
                   "HPCJOBS_CUDA_IPC_SYNC": "events", "HPCJOBS_TORCH_ALGORITHM": "auto"}
# The names :func:`refusals` compares, in its order: the CLI adds the ranks
# per simulated node after --ranks-per-node (``detect`` compares the rest).
SETTINGS = ("hpcjobs", *(LIBRARIES := ("numpy", "torch", "mpi4py", "python")), "HPCJOBS_CHECKS",
            "HPCJOBS_RANKS_PER_NODE", *SAME_EVERYWHERE)


@functools.cache
def install() -> tuple[str, str]:
    """This process's hpcjobs: its version with a crc32 of its modules' names
    and sizes (1 ms; their contents would take 20), and where it is. A host
    with another version, or an older copy of the same one, shows here: its
    collectives could split, segment or check differently, and hang or
    reduce wrongly beside the others'. A module that cannot be read counts
    as size ``?``; an install that cannot be listed (a zip) gives no names."""
    from . import __version__

    root = os.path.dirname(os.path.abspath(__file__))
    items = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                try:
                    size = str(os.path.getsize(path))
                except OSError:
                    size = "?"
                items.append(f"{os.path.relpath(path, root)}:{size}")
    return f"{__version__} ({zlib.crc32(chr(10).join(items).encode()):08x})", root


def setting(name: str) -> str:
    """One of :data:`SAME_EVERYWHERE` as in effect: its value, stripped, or
    its default when unset or empty. The code that acts on it reads it
    here, so that what the ranks compare is what they run."""
    return os.environ.get(name, "").strip() or SAME_EVERYWHERE[name]


@functools.cache
def libraries() -> dict:
    """The versions of the libraries whose results the ranks must share (numpy draws random-k's positions and
    each epoch's order on every rank alone), from their metadata: torch is not imported for it."""
    import importlib.metadata
    import platform

    import mpi4py

    try:  # (a local suffix, +cpu or +cu130, is the build's, not the code's)
        torch = importlib.metadata.version("torch").partition("+")[0]
    except importlib.metadata.PackageNotFoundError:
        torch = "none"
    return {"numpy": np.__version__, "torch": torch, "mpi4py": mpi4py.__version__,
            "python": ".".join(platform.python_version_tuple()[:2])}  # (a patch release: the same language)


def shared_settings() -> dict:
    """This process's settings that every rank must share: its hpcjobs
    (:func:`install`), its libraries (:func:`libraries`), the agreement
    checks on or off (``HPCJOBS_CHECKS``, ``set_checks``) and
    :data:`SAME_EVERYWHERE` as in effect; and, said rather than compared,
    where its hpcjobs is (``"hpcjobs at"``)."""
    from .collectives.agreement import checks_enabled

    version, root = install()
    return {"hpcjobs": version, "hpcjobs at": root, **libraries(),
            "HPCJOBS_CHECKS": "on" if checks_enabled() else "off", **{name: setting(name) for name in SAME_EVERYWHERE}}


def refusals(problem: str | None, settings: dict, comm: MPI.Intracomm) -> list[str]:
    """Why this job cannot go on, the same list on every rank of ``comm``:
    each rank's ``problem`` (a job parameter it cannot use, or None) with the
    ranks it came from when not all, else each of :data:`SETTINGS` whose
    value in ``settings`` differs across the ranks, with their values. Empty
    when all is well: one small allreduce then. Collective."""
    try:
        mine = signature([problem is not None, *(settings.get(n) for n in SETTINGS)])
    except Exception as e:  # noqa: BLE001 -- a value no signature holds: said on every rank, not raised here
        problem, settings = f"{type(e).__name__}: {e}", {}
        mine = signature([True, *(None for _ in SETTINGS)])
    if agree(mine, comm).all() and problem is None:
        return []
    everyone = comm.allgather((problem, settings))
    problems = [p for p, _ in everyone]
    out = []
    for p in dict.fromkeys(p for p in problems if p):
        rs = [r for r, q in enumerate(problems) if q == p]
        out.append(p if len(rs) == len(problems) else f"{p} (on {ranks_text(rs)} of {len(problems)})")
    if out:
        return out
    for name in SETTINGS:
        values = [s.get(name) for _, s in everyone]
        if len(set(values)) > 1:
            fix = "install the same on every host" if name in LIBRARIES else "set it the same on every host"
            if name == "hpcjobs":
                fix = f"install the same on every host ({by_value([s.get('hpcjobs at') for _, s in everyone])})"
            out.append(f"{name} differs across ranks ({by_value(values)}): {fix}")
    return out


def closed_at_exit(method: str) -> list:
    """A list for weak references to objects that own communicators (torch
    groups, DDP hooks): at exit, before MPI_Finalize, ``method`` is called on
    each still alive, in the order appended, so their collective frees meet
    alike on every rank; a forked child's list is emptied, as its exit frees
    nothing of MPI's."""
    kept: list = []
    os.register_at_fork(after_in_child=kept.clear)

    def close_all() -> None:
        for obj in [o for o in (ref() for ref in kept) if o is not None]:
            getattr(obj, method)()

    atexit.register(close_all)
    return kept


def environment_problem() -> str | None:
    """What this process's environment sets that the library cannot use, or
    None: a number it read at import (``HPCJOBS_TIMEOUT``,
    ``HPCJOBS_STALL_WARNING``, ``HPCJOBS_CUDA_IPC_ONE_SHOT``) or a choice
    outside its values (``HPCJOBS_CHECKS``, ``HPCJOBS_BIND_GPU``, and those of
    :data:`SAME_EVERYWHERE` that name one: ``HPCJOBS_CHECKS=maybe`` had left
    the checks on, ``HPCJOBS_AGREE_VIA=xyz`` meant mpi, and
    ``HPCJOBS_TORCH_ALGORITHM=xyz`` failed at a script's first allreduce)."""
    from .collectives import cuda_ipc, watchdog
    from .collectives.agreement import AGREE_VIA_VALUES, CHECKS_VALUES, checks_choice
    from .collectives.names import ALGORITHMS, DEVICE_ALGORITHMS

    problems = [p for p in (watchdog.ENV_ERROR, cuda_ipc.ENV_ERROR) if p]
    choices = {"HPCJOBS_AGREE_VIA": AGREE_VIA_VALUES, "HPCJOBS_CUDA_IPC_SYNC": cuda_ipc.SYNC_MODES,
               "HPCJOBS_TORCH_ALGORITHM": ("auto", *ALGORITHMS, *DEVICE_ALGORITHMS)}
    for name, values in choices.items():
        if setting(name) not in values:
            problems.append(f"{name}={os.environ[name]!r}: choose one of {', '.join(values)}")
    if checks_choice() not in ("", *CHECKS_VALUES):
        problems.append(f"HPCJOBS_CHECKS={os.environ['HPCJOBS_CHECKS']!r}: choose one of {', '.join(CHECKS_VALUES)}")
    if os.environ.get("HPCJOBS_BIND_GPU", "") not in ("", "0", "1"):  # 1 binds (hpcjobs.runtime.bind_gpu)
        problems.append(f"HPCJOBS_BIND_GPU={os.environ['HPCJOBS_BIND_GPU']!r}: choose 1 (each rank its own GPU) or 0")
    return "; ".join(problems) or None


def _check_shared_settings(comm: MPI.Intracomm) -> None:
    """ValueError on every rank of ``comm`` where a rank's environment cannot
    be used or :func:`shared_settings` differ across them: a rank checking
    its calls beside one that does not waits for it in a collective the
    other never runs (a 2-rank job hung until the watchdog). One small
    allreduce when all is well. Collective."""
    try:
        problem, settings = environment_problem(), shared_settings()
    except Exception as e:  # noqa: BLE001 -- said on every rank, not raised on this one alone
        problem, settings = f"{type(e).__name__}: {e}", {}
    found = refusals(problem, settings, comm)
    if found:
        raise ValueError(" | ".join(found))


# Open MPI's TCP transport sends a message of up to 64 KiB at once (its eager
# limit, its own header included); a longer one is announced and waits for
# the receiver's answer.
EXCHANGE_SEND_FIRST_BYTES = 64 << 10


def exchange(comm, sendbuf: np.ndarray, dest: int, recvbuf: np.ndarray, source: int, tag: int) -> None:
    """``comm.Sendrecv(sendbuf, dest, tag, recvbuf, source, tag)``, except
    that two ranks swapping messages (``dest == source``) of 64 KiB or more
    post the send before the receive.

    Why: over TCP, Open MPI announces such a message and sends it once the
    receiver answers, and the answer shares one connection with the
    answering rank's own data. With ``Sendrecv``, which posts its receive
    first, the answer often went out behind that rank's whole message, and
    the two directions took turns. A capture across emulated hosts showed
    it: h1 sent h2 its data, then a 344-byte message, and only then did
    h2's data start. Posting the send first, both went at once. At
    50 Mbit/s recursive doubling across 4 hosts took 605-691 ms for 1 MiB
    in each of 5 launches, against 351 ms this way (335.5 ms on the wire), and
    the 2-rank ring lost 41-82 ms in 6 of 8 launches, against none
    (docs/results/multinode.md, "Pairs that take turns"). Shorter messages
    keep ``Sendrecv``, which costs 0.2-0.3 us less per call in mpi4py; most
    go at once (the last few bytes under 64 KiB do not, the header counting
    against the limit, and are left as they were)."""
    if dest == source and sendbuf.nbytes >= EXCHANGE_SEND_FIRST_BYTES:
        request = comm.Isend(sendbuf, dest, tag)
        comm.Recv(recvbuf, source, tag)
        request.Wait()
    else:
        comm.Sendrecv(sendbuf, dest, tag, recvbuf, source, tag)


def world() -> MPI.Intracomm:
    """The suite's private duplicate of MPI.COMM_WORLD (made on first use)."""
    return private(MPI.COMM_WORLD)


def signature(values) -> np.ndarray:
    """``values`` as int64s that ranks can compare with one allreduce:
    integers as they are, True/False as 1/0, None as -1, anything else
    (strings, dtypes, reprs) as the crc32 of its text."""
    return np.array([_code(v) for v in values], dtype=np.int64)


def _code(value) -> int:
    if isinstance(value, bool) or value is None:
        return int(bool(value)) - (value is None)
    if isinstance(value, (int, np.integer)) and -2**63 <= value < 2**63:
        return int(value)
    return zlib.crc32(str(value).encode("utf-8", "surrogatepass"))  # the environment's undecodable bytes too


def extremes(values, comm: MPI.Comm) -> tuple[np.ndarray, np.ndarray]:
    """The smallest and the largest of each of ``values`` (signed integers or
    floats, the same length and dtype on every rank) over the ranks of
    ``comm``: one MIN allreduce of ``[v, -v]``. Collective."""
    v = np.asarray(values).reshape(-1)
    both = np.concatenate([v, -v])
    out = np.empty_like(both)
    comm.Allreduce(both, out, op=MPI.MIN)
    return out[:v.size], -out[v.size:]


def agree(values, comm: MPI.Comm) -> np.ndarray:
    """Which of ``values`` (as for :func:`extremes`; e.g. a :func:`signature`)
    are equal on every rank of ``comm``: a boolean array. Collective."""
    lo, hi = extremes(values, comm)
    return lo == hi


def ranks_in(comm: MPI.Comm, other: MPI.Comm | None = None) -> list[int]:
    """Each rank of ``comm``'s number in ``other`` (default COMM_WORLD), in
    ``comm``'s order; ``MPI.UNDEFINED`` for one that is not in it. Local: no
    communication."""
    mine, theirs = comm.Get_group(), (other or MPI.COMM_WORLD).Get_group()
    try:
        return list(MPI.Group.Translate_ranks(mine, list(range(mine.Get_size())), theirs))
    finally:
        mine.Free()
        theirs.Free()


def ranks_text(rs) -> str:
    """``rank 3`` or ``ranks 0,2``."""
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def by_value(values) -> str:
    """Each distinct text among ``values`` (one per rank, indexed by rank)
    with the ranks that have it, in order of first appearance: ``rank 0:
    2; ranks 1,2: unset``. For messages about ranks that disagree."""
    seen: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        seen.setdefault(str(v), []).append(r)
    return "; ".join(f"{ranks_text(rs)}: {v}" for v, rs in seen.items())


def is_root(comm: MPI.Comm | None = None) -> bool:
    return (comm or MPI.COMM_WORLD).Get_rank() == 0


def print0(*args, comm: MPI.Comm | None = None, file=None, **kwargs) -> None:
    """``print`` on rank 0 of ``comm`` only, flushed so mpirun shows it at once."""
    if is_root(comm):
        print(*args, file=file or sys.stdout, flush=True, **kwargs)


def expect_world_size(comm: MPI.Comm | None = None) -> None:
    """Fail loudly when the job came up with a different world size than asked.

    A launcher/MPI mismatch (e.g. an Open MPI build started by ``srun`` with
    the wrong ``--mpi`` plugin) starts every rank as a singleton "0 of 1" and
    the job would otherwise exit 0 having computed nothing. Job scripts set
    ``HPCJOBS_EXPECT_WORLD_SIZE``; unset, nothing is checked.

    Raises:
        RuntimeError: the world size differs from the expected one.
    """
    comm = comm or MPI.COMM_WORLD
    expected = os.environ.get("HPCJOBS_EXPECT_WORLD_SIZE", "").strip()
    if not expected:
        return
    try:
        want = int(expected)
    except ValueError:
        raise RuntimeError(f"HPCJOBS_EXPECT_WORLD_SIZE={expected!r} is not an integer") from None
    if comm.Get_size() != want:
        why = ("the ranks did not find each other (wrong launcher or srun --mpi plugin for this MPI?)"
               if comm.Get_size() == 1 else "the job launched another size than its script expects, or its ranks "
                                            "were given different values")
        raise RuntimeError(f"MPI world size is {comm.Get_size()} but HPCJOBS_EXPECT_WORLD_SIZE={want}: {why}")
