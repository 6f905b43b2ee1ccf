"""MNIST-1D's cache: made once, by rank 0, and again by each node's first
rank where the node does not see it (``mnist1d.data.make_dataset``,
offline, ~9 s per 40,000 samples), and memory-mapped by every rank.

The cache is a folder per (sample count, seed) of ``.npy`` files, written in
a folder of its own and renamed into place, its files flushed to the disk
first; a damaged one is named, with the way out. A write killed mid-way
leaves its folder, which the next load (rank 0's) removes an hour on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .._files import fsync_dir

__all__ = ["default_cache_dir", "folder", "generate", "make_where_missing", "arrays", "check_samples"]


def default_cache_dir() -> Path:
    """``$HPCJOBS_DATA_DIR``, else ``$XDG_CACHE_HOME/hpcjobs`` (``~/.cache/hpcjobs``)."""
    if os.environ.get("HPCJOBS_DATA_DIR"):
        return Path(os.environ["HPCJOBS_DATA_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpcjobs"


def folder(cache_dir: Path, num_samples: int, seed: int) -> Path:
    """The cache's folder for ``num_samples`` made from ``seed``."""
    return cache_dir / f"mnist1d-n{num_samples}-seed{seed}"


def generate(target: Path, num_samples: int, seed: int) -> None:
    """Make MNIST-1D offline and write it atomically (a temp dir renamed)."""
    import random

    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    # make_dataset seeds the global random and numpy generators; put them back.
    saved = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep(target)
    # a folder of its own (a pid alone was another job's, or a killed one's, on a shared file system), its
    # files on the disk before the rename (a crash left empty ones that every later job trusted), and gone
    # again where the write failed (a full disk left a partial copy per attempt)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for key in ("x", "y", "x_test", "y_test"):
            arr = data[key].astype(np.float32 if key.startswith("x") else np.int64)
            with open(tmp / f"{key}.npy", "wb") as f:
                np.save(f, arr)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # (mkdtemp's 0o700: the cache is shared)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (renamed: nothing there; another job's made first: ours)
    fsync_dir(target.parent)


STALE_S = 3600.0  # a temporary folder untouched this long is a killed write's, not one under way (seconds)


def _sweep(target: Path) -> None:
    """Remove the temporary folders of writes of ``target`` that were killed
    (a job killed mid-write left one, ~0.5 MB, each time): those untouched
    for :data:`STALE_S`; a write under way, another job's on a shared file
    system too, takes seconds. Never raises."""
    import time

    try:
        for old in target.parent.glob(f".{target.name}.*"):
            if old.is_dir() and time.time() - old.stat().st_mtime > STALE_S:
                shutil.rmtree(old, ignore_errors=True)
    except OSError:  # (a folder that cannot be listed, one gone meanwhile: the load goes on)
        pass


def make_where_missing(target: Path, num_samples: int, seed: int, comm=None) -> None:
    """Make the cache ``target`` wherever a rank of ``comm`` does not see it
    (collective; None: this process): rank 0 first, once for the job on a
    file system the nodes share; then each node's first rank where its node
    does not see rank 0's (rank 0's alone had left the other nodes a cache
    they could not see, "damaged" every time); then a rank that still does
    not see it (a data directory of its own). Whether the copies hold the
    same data is the data's fingerprint's to say
    (:func:`hpcjobs.training.data.load_dataset`).

    Raises:
        RuntimeError: the generation failed (on the ranks that waited for it alike).
    """
    if comm is None or comm.Get_rank() == 0:  # (where the cache is there too: a killed write's folder stays else)
        _sweep(target)
    if comm is None:
        error = _make_unless_there(target, num_samples, seed)
    else:
        from mpi4py import MPI  # comm exists: MPI is up

        error = comm.bcast(_make_unless_there(target, num_samples, seed) if comm.Get_rank() == 0 else None, root=0)
        if not error:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # (every rank: the error above was every rank's)
            try:
                error = node.bcast(_make_unless_there(target, num_samples, seed) if node.Get_rank() == 0 else None,
                                   root=0)
            finally:
                node.Free()
        if not error:
            error = _make_unless_there(target, num_samples, seed)
    if error:
        raise RuntimeError(error)


def _make_unless_there(target: Path, num_samples: int, seed: int) -> str | None:
    try:
        if not target.exists():
            generate(target, num_samples, seed)
    except Exception as e:  # noqa: BLE001 -- said on the node's ranks, then on every rank
        return f"generating MNIST-1D into {target} failed: {type(e).__name__}: {e}"
    return None


def arrays(d: Path) -> dict:
    """The cache in ``d``, memory-mapped: x, y, x_test, y_test.

    Raises:
        ValueError: a damaged cache, naming its folder (numpy's own words,
            "No data left in file" or advice on pickled data, named neither
            the file nor the way out).
    """
    try:
        arr = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ("x", "y", "x_test", "y_test")}
        if len(arr["x"]) != len(arr["y"]) or len(arr["x_test"]) != len(arr["y_test"]) or not len(arr["x"]):
            raise ValueError(f"{len(arr['x'])} training inputs and {len(arr['y'])} labels")
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{d}: a damaged MNIST-1D cache ({type(e).__name__}: {e}); remove the folder and it is "
                         "made again") from None
    return arr


def check_samples(name: str, num_samples: int | None) -> None:
    """MNIST-1D makes num_samples // 10 samples of each digit: another
    count was rounded down without a word (100 to 109 made one dataset, in
    ten caches)."""
    if name == "mnist1d" and num_samples is not None and num_samples % 10:
        raise ValueError(f"mnist1d makes num_samples / 10 samples of each digit: give a multiple of 10 "
                         f"({num_samples} would make {num_samples // 10 * 10})")
