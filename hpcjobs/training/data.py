"""Datasets for data-parallel training, each rank reading only its shard.

Datasets (:data:`DATASETS`):

- ``mnist1d`` -- MNIST-1D (Greydanus 2020), *generated* offline with
  ``mnist1d.data.make_dataset`` for any sample count and seed (its
  ``get_dataset`` downloads by default and is never called;
  :mod:`~hpcjobs.training.mnist1d_cache`). Generation is
  slow (~9 s per 40,000 samples), so each node's first rank writes it once
  to the cache directory as ``.npy`` files where its node does not see it
  (once for the job on a shared file system) and every rank memory-maps them.
- ``digits`` -- scikit-learn's 8x8 digits (1,797 images, shipped with it).
- ``synthetic`` -- Gaussian inputs labelled by a fixed random two-layer
  teacher: learnable, any size, made in memory from the seed.
- ``mnist`` -- the standard IDX files (``train-images-idx3-ubyte`` etc.,
  optionally ``.gz``) from ``data_dir``.
- ``cifar10`` -- the CIFAR-10 binary batches (``data_batch_1.bin`` ..
  ``data_batch_5.bin``, ``test_batch.bin``) from ``data_dir``.
- ``text`` -- bytes of text for the GPTs, ``seq_len`` tokens per sample
  and the next byte at each position as its targets: hpcjobs' own source,
  or every file under ``data_dir`` (:mod:`hpcjobs.training.text`).

Sharding (:mod:`~hpcjobs.training.sharding`): every epoch one permutation of the training set is drawn from
``(seed, epoch)`` -- the same on every rank, no communication. Step ``s``
uses global batch ``perm[s*B:(s+1)*B]`` with ``B = P*b``; rank ``r`` takes
its ``b`` samples ``[r*b:(r+1)*b]`` of it, so the ranks together see exactly
the batch one process with batch ``B`` would see. The last partial global
batch of an epoch is dropped, so every step has the same size (which the
linear scaling rule assumes). Uncompressed files are memory-mapped and each
rank touches only the rows of its own samples.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import mnist1d_cache, text
from .mnist1d_cache import check_samples as check_mnist1d_samples, default_cache_dir
from .sharding import eval_shard, rank_batches, steps_per_epoch

__all__ = ["DATASETS", "SIZED", "SEEDED", "Rows", "Split", "Dataset", "load_dataset", "load_dataset_of", "read_idx",
           "fingerprint", "opened_fingerprint", "default_cache_dir", "rank_batches", "steps_per_epoch", "eval_shard",
           "check_mnist1d_samples"]

DATASETS = ("mnist1d", "digits", "synthetic", "mnist", "cifar10", "text")
SIZED, SEEDED = ("mnist1d", "synthetic", "text"), ("mnist1d", "synthetic", "digits")  # what num_samples, seed take
DEFAULT_SAMPLES = {"mnist1d": 5000, "synthetic": 8192}  # num_samples left out (text: the whole corpus)


class Rows:
    """Rows of one or more arrays (numpy or memmap) stacked along axis 0,
    read by index without loading the rest."""

    def __init__(self, *parts: np.ndarray):
        if not parts:
            raise ValueError("Rows needs at least one array")
        shapes = {p.shape[1:] for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"row shapes differ: {sorted(shapes)}")
        self.parts = parts
        self.row_shape = parts[0].shape[1:]
        self.dtype = parts[0].dtype
        self._ends = np.cumsum([len(p) for p in parts])

    def __len__(self) -> int:
        return int(self._ends[-1])

    def take(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"row index out of range [0, {len(self)})")
        if len(self.parts) == 1:
            return np.asarray(self.parts[0][index])
        out = np.empty((len(index),) + self.row_shape, self.dtype)
        part = np.searchsorted(self._ends, index, side="right")
        starts = np.concatenate([[0], self._ends[:-1]])
        for k in np.unique(part):
            sel = part == k
            out[sel] = self.parts[k][index[sel] - starts[k]]
        return out


@dataclass
class Split:
    x: Rows
    y: Rows

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Dataset:
    """A train and a test split; inputs are normalised as ``(x - mean) / std``
    when a batch is taken (so memory-mapped raw bytes stay raw). ``tokens``:
    inputs are token ids (int64, never normalised) and each sample has a
    target per position; ``num_classes`` is then the vocabulary."""

    name: str
    train: Split
    test: Split
    num_classes: int
    mean: float = 0.0
    std: float = 1.0
    tokens: bool = False

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.row_shape)

    def batch(self, split: Split, index: np.ndarray):
        """``(x float32, y int64)`` numpy arrays for the given rows (``x``
        int64 for tokens)."""
        if self.tokens:
            return split.x.take(index).astype(np.int64), split.y.take(index).astype(np.int64)
        x = split.x.take(index).astype(np.float32)
        if self.mean != 0.0 or self.std != 1.0:
            x = (x - np.float32(self.mean)) / np.float32(self.std)
        return x, split.y.take(index).astype(np.int64)


def fingerprint(ds: Dataset) -> str:
    """A digest of every byte of the data ``ds`` holds as opened (each split's inputs and targets, their shapes
    and types; blake2b, 128 bits): two opens agree only on the same data. Not the normalisation (digits' is the
    data's)."""
    h = hashlib.blake2b(repr((ds.name, ds.num_classes, ds.tokens)).encode(), digest_size=16)
    for rows in (ds.train.x, ds.train.y, ds.test.x, ds.test.y):
        for part in rows.parts:
            h.update(repr((part.shape, part.dtype.str)).encode())
            step = max(1, (64 << 20) // max(1, part[:1].nbytes))  # rows of 64 MB at a time: a copy where strided
            for i in range(0, len(part), step):
                h.update(np.ascontiguousarray(part[i:i + step]).data)
    return h.hexdigest()


_OPENED: dict[tuple, str] = {}  # the data settings this process opened -> the data's fingerprint


def opened_fingerprint(cfg) -> str | None:
    """The fingerprint of the data this process opened for ``cfg``'s
    settings (:func:`load_dataset_of`), None where it opened none: what a
    checkpoint records, and a resume compares."""
    return _OPENED.get(_settings(cfg))


def _settings(cfg) -> tuple:
    return cfg.dataset, cfg.data_dir, cfg.num_samples, cfg.data_seed, cfg.seq_len


# --- readers ---------------------------------------------------------------

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (the MNIST format) as an array; memory-mapped unless gzipped.

    Raises:
        ValueError: not an IDX file, or its size disagrees with its header.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) != 4 or head[:2] != b"\0\0" or head[2] not in _IDX_DTYPES:
                raise ValueError(f"{path}: not an IDX file (magic {head.hex() or 'empty'})")
            ndim = head[3]
            dims = struct.unpack(f">{ndim}I", f.read(4 * ndim))
            dtype = np.dtype(_IDX_DTYPES[head[2]])
            offset = 4 + 4 * ndim
            expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
            if path.suffix == ".gz":
                data = f.read()
                if len(data) != expected:
                    raise ValueError(f"{path}: header says {dims} ({expected} bytes), file has {len(data)}")
                return np.frombuffer(data, dtype).reshape(dims)
    except (EOFError, struct.error, gzip.BadGzipFile) as e:  # a truncated .gz, a web page saved as one
        raise ValueError(f"{path}: truncated, or not an IDX file ({type(e).__name__}: {e}); download it again") \
            from None
    size = path.stat().st_size - offset
    if size != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes), file has {size}")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=dims)


def _find(data_dir: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        if (data_dir / name).exists():
            return data_dir / name
    raise FileNotFoundError(f"{data_dir}: no {stem} (or {stem}.gz); download the MNIST IDX files there")


def _mnist(data_dir: Path) -> Dataset:
    parts = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        x = read_idx(_find(data_dir, f"{prefix}-images-idx3-ubyte"))
        y = read_idx(_find(data_dir, f"{prefix}-labels-idx1-ubyte"))
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{data_dir}: {prefix} images {x.shape} and labels {y.shape} do not match")
        _check_labels(f"{data_dir}: {prefix} labels", y)
        parts[split] = Split(Rows(x), Rows(y))
    # The usual MNIST normalisation, in raw byte units.
    return Dataset("mnist", parts["train"], parts["test"], 10, mean=0.1307 * 255, std=0.3081 * 255)


_CIFAR_RECORD = 1 + 3 * 32 * 32


def _cifar_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    size = path.stat().st_size
    if size == 0 or size % _CIFAR_RECORD:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {_CIFAR_RECORD}-byte CIFAR-10 records")
    rec = np.memmap(path, dtype=np.uint8, mode="r", shape=(size // _CIFAR_RECORD, _CIFAR_RECORD))
    _check_labels(f"{path}: labels", rec[:, 0])
    return rec[:, 1:].reshape(-1, 3, 32, 32), rec[:, 0]


def _check_labels(what: str, y: np.ndarray, classes: int = 10) -> None:
    """Labels past the classes (EMNIST's letters, CIFAR-100's) failed at the first batch, or the epoch's test."""
    if len(y) and not 0 <= int(y.min()) <= int(y.max()) < classes:
        raise ValueError(f"{what} run from {int(y.min())} to {int(y.max())}; this dataset has {classes} classes")


def _cifar10(data_dir: Path) -> Dataset:
    if (data_dir / "cifar-10-batches-bin").is_dir():
        data_dir = data_dir / "cifar-10-batches-bin"
    train = sorted(data_dir.glob("data_batch_*.bin"))
    test = data_dir / "test_batch.bin"
    if not train or not test.exists():
        raise FileNotFoundError(f"{data_dir}: need data_batch_*.bin and test_batch.bin (CIFAR-10 binary version)")
    tr = [_cifar_file(p) for p in train]
    te = _cifar_file(test)
    return Dataset("cifar10", Split(Rows(*[x for x, _ in tr]), Rows(*[y for _, y in tr])),
                   Split(Rows(te[0]), Rows(te[1])), 10, mean=0.4734 * 255, std=0.2516 * 255)


def _text(data_dir: str | os.PathLike | None, seq_len: int, num_samples: int | None) -> Dataset:
    data = text.corpus(data_dir)
    if num_samples is not None:
        if num_samples * seq_len + 1 > len(data):  # (it was the whole corpus, said to be num_samples)
            raise ValueError(f"--num-samples {num_samples} asks for more text than the corpus has ({len(data)} bytes: "
                             f"{(len(data) - 1) // seq_len} sequences of {seq_len}); leave it out for the whole corpus")
        data = data[:num_samples * seq_len + 1]
    cut = int(0.9 * len(data))
    train, test = text.windows(data[:cut], seq_len), text.windows(data[cut:], seq_len)
    if len(train) == 0 or len(test) == 0:
        raise ValueError(f"the text corpus has {len(data)} bytes: too few for a test split of sequences of "
                         f"{seq_len} (lower --seq-len or raise --num-samples)")
    return Dataset("text", Split(Rows(train[:, :-1]), Rows(train[:, 1:])),
                   Split(Rows(test[:, :-1]), Rows(test[:, 1:])), text.VOCAB, tokens=True)


def _digits(seed: int) -> Dataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = d.data.astype(np.float32).reshape(-1, 8, 8)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng([seed, 0xD161]).permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = perm[:cut], perm[cut:]
    return Dataset("digits", Split(Rows(x[tr]), Rows(y[tr])), Split(Rows(x[te]), Rows(y[te])), 10,
                   mean=float(x[tr].mean()), std=float(x[tr].std()))


def _synthetic(num_samples: int, seed: int, features: int = 64, classes: int = 10) -> Dataset:
    rng = np.random.default_rng([seed, 0x5EED])
    x = rng.standard_normal((num_samples, features)).astype(np.float32)
    w1 = rng.standard_normal((features, 64)) / np.sqrt(features)
    w2 = rng.standard_normal((64, classes)) / 8.0
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1).astype(np.int64)
    cut = int(0.8 * num_samples)
    return Dataset("synthetic", Split(Rows(x[:cut]), Rows(y[:cut])), Split(Rows(x[cut:]), Rows(y[cut:])), classes)


def _mnist1d(cache_dir: Path, num_samples: int, seed: int) -> Dataset:
    arr = mnist1d_cache.arrays(mnist1d_cache.folder(cache_dir, num_samples, seed))
    return Dataset("mnist1d", Split(Rows(arr["x"]), Rows(arr["y"])),
                   Split(Rows(arr["x_test"]), Rows(arr["y_test"])), 10)


def load_dataset(name: str, *, comm=None, data_dir: str | os.PathLike | None = None,
                 num_samples: int | None = None, seed: int = 42, seq_len: int = 128) -> Dataset:
    """Open a dataset on every rank of ``comm``.

    Args:
        name: one of :data:`DATASETS`.
        comm: an MPI communicator; for ``mnist1d`` rank 0 generates the
            cache when missing, and each node's first rank where its node
            does not see it, while the others wait. None: this process alone. With it, every rank
            checks that all opened the same data (:func:`fingerprint`).
        data_dir: where ``mnist``/``cifar10`` files are, where ``mnist1d``
            is cached (default :func:`default_cache_dir`), the ``text``
            corpus (default: hpcjobs' source).
        num_samples: ``mnist1d``: samples generated (default 5,000, 80% for
            training, as the MNIST-1D paper); ``synthetic``: default 8,192;
            ``text``: about this many sequences (default: the whole corpus).
        seq_len: ``text``: tokens per sample.
        seed: the data seed (generation of ``mnist1d``/``synthetic``, the
            ``digits`` split).

    Raises:
        ValueError: unknown name or bad sizes; FileNotFoundError: files
        missing. With ``comm``, every rank raises when one rank fails (files
        on one node only, a cache another node cannot see yet), naming it:
        alone, it would leave the others waiting in the job's next collective.
    """
    if comm is None:
        return _load(name, None, data_dir, num_samples, seed, seq_len)
    ds, digest, error = None, None, None
    try:
        ds = _load(name, comm, data_dir, num_samples, seed, seq_len)
        digest = fingerprint(ds)  # (reads every byte: a read error here is said on every rank too)
    except Exception as e:  # noqa: BLE001 -- told to every rank, raised there (a truncated .gz: EOFError)
        error = (type(e).__name__, str(e))
    failed = [(r, e) for r, e in enumerate(comm.allgather(error)) if e]
    if failed:
        kinds = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError}
        (rank, (kind, message)), alike = failed[0], len({e for _, e in failed}) == 1
        if not (alike and len(failed) == comm.Get_size()):  # not every rank alike: say which
            message = f"on rank {rank}{f' and {len(failed) - 1} other(s)' if len(failed) > 1 else ''}: {message}"
        raise kinds.get(kind, RuntimeError)(message)
    _check_alike(name, ds, digest, comm)
    _OPENED[(name, data_dir, num_samples, seed, seq_len)] = digest
    return ds


def _check_alike(name: str, ds: Dataset, mine: str, comm) -> None:
    """``mine``, the data's :func:`fingerprint`, the same on every rank; ValueError on
    every rank where the ranks opened other data (each node reads its own
    copy of the files: one missing a CIFAR batch, a corpus of another
    install, an MNIST-1D cache another mnist1d made, Fashion-MNIST's files
    where MNIST's are): a rank with fewer samples ran fewer steps and left
    the others waiting in its last allreduce until the watchdog, and data of
    the same size trained each node on its own, silently."""
    seen: dict[tuple, list[int]] = {}
    for rank, opened in enumerate(comm.allgather((len(ds.train), len(ds.test), tuple(ds.input_shape), mine))):
        seen.setdefault(opened, []).append(rank)
    if len(seen) > 1:
        sizes = len({opened[:3] for opened in seen}) > 1
        said = "; ".join(f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: "
                         + (f"{train} training and {test} test samples of shape {shape}" if sizes
                            else f"data {digest[:12]}") for (train, test, shape, digest), ranks in seen.items())
        made = {"mnist1d": "; MNIST-1D made on other kinds of node can differ: give --data-dir a folder the nodes "
                           "share, or copy one node's cache to the others",
                "synthetic": "; synthetic data made on other kinds of node can differ in a label"}.get(name, "")
        raise ValueError(f"the ranks opened different {name} data ({said}"
                         + ("" if sizes else "; the same sizes, other bytes") + "): each reads its own copy of the "
                         "files (or of MNIST-1D's cache), which must be the same on every node" + made)


def load_dataset_of(cfg, comm=None) -> Dataset:
    """:func:`load_dataset` with a :class:`~hpcjobs.training.TrainConfig`'s
    settings: what every mode and experiment trains on."""
    return load_dataset(cfg.dataset, comm=comm, data_dir=cfg.data_dir, num_samples=cfg.num_samples,
                        seed=cfg.data_seed, seq_len=cfg.seq_len)


def _load(name: str, comm, data_dir, num_samples: int | None, seed: int, seq_len: int) -> Dataset:
    """:func:`load_dataset` on this rank (``comm``: for MNIST-1D's cache)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if num_samples is not None and num_samples < 10:
        raise ValueError(f"num_samples must be >= 10, got {num_samples}")
    check_mnist1d_samples(name, num_samples)
    if name == "digits":
        return _digits(seed)
    if name == "synthetic":
        return _synthetic(num_samples or DEFAULT_SAMPLES["synthetic"], seed)
    if name == "text":
        return _text(data_dir, seq_len, num_samples)
    if name in ("mnist", "cifar10"):
        if data_dir is None:
            raise ValueError(f"dataset {name!r} reads local files: give data_dir (--data-dir)")
        return _mnist(Path(data_dir)) if name == "mnist" else _cifar10(Path(data_dir))
    cache = Path(data_dir) if data_dir is not None else default_cache_dir()
    n = num_samples or DEFAULT_SAMPLES["mnist1d"]
    mnist1d_cache.make_where_missing(mnist1d_cache.folder(cache, n, seed), n, seed, comm)
    return _mnist1d(cache, n, seed)
