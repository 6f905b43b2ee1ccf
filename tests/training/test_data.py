"""Datasets, readers and the per-epoch sharding."""

import gzip
import re
import struct

import numpy as np
import pytest
from mpi4py import MPI

from hpcjobs.training.data import (Rows, eval_shard, load_dataset, rank_batches, read_idx, steps_per_epoch)


def write_idx(path, arr: np.ndarray, code=0x08, compress=False):
    head = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = head + arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    (gzip.open if compress else open)(path, "wb").write(data)


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_round_trips(tmp_path, compress):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("x.idx" + (".gz" if compress else ""))
    write_idx(path, arr, compress=compress)
    np.testing.assert_array_equal(read_idx(path), arr)
    f32 = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    write_idx(tmp_path / "f.idx", f32, code=0x0D)
    np.testing.assert_array_equal(read_idx(tmp_path / "f.idx"), f32)


def test_read_idx_refuses_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x12\x34\x56\x78")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", np.zeros((4, 4), np.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])
    with pytest.raises(ValueError, match="header says"):
        read_idx(tmp_path / "short")
    # a truncated .gz, a web page saved as one, a header cut short: numpy's or gzip's words named no file
    write_idx(tmp_path / "whole", np.zeros((40, 4), np.uint8))
    (tmp_path / "cut.gz").write_bytes(gzip.compress((tmp_path / "whole").read_bytes())[:-20])
    (tmp_path / "page.gz").write_bytes(b"<html>not found</html>")
    (tmp_path / "stub").write_bytes(b"\0\0\x08\x02\0\0")
    for name in ("cut.gz", "page.gz", "stub"):
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name}: truncated, or not an IDX file")):
            read_idx(tmp_path / name)


def test_mnist_idx_dataset(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 12), ("t10k", 5)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)).astype(np.uint8))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", (np.arange(n) % 10).astype(np.uint8), compress=True)
    ds = load_dataset("mnist", data_dir=tmp_path)
    assert (len(ds.train), len(ds.test), ds.input_shape, ds.num_classes) == (12, 5, (28, 28), 10)
    x, y = ds.batch(ds.train, np.array([3, 1]))
    raw = read_idx(tmp_path / "train-images-idx3-ubyte")
    np.testing.assert_allclose(x, (raw[[3, 1]].astype(np.float32) - 0.1307 * 255) / (0.3081 * 255), rtol=1e-6)
    np.testing.assert_array_equal(y, [3, 1])


def test_mnist_missing_files_say_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_dataset("mnist", data_dir=tmp_path)
    with pytest.raises(ValueError, match="data_dir"):
        load_dataset("mnist")


@pytest.mark.mpi(min_size=2)
def test_files_on_one_node_only_fail_every_rank_naming_the_ranks(tmp_path_factory):
    """--data-dir read by every rank: where the files are on rank 0's node
    only, the ranks that cannot read them must not leave rank 0 waiting in
    the job's next collective. Every rank raises, naming them."""
    comm = MPI.COMM_WORLD
    mine = tmp_path_factory.mktemp("mnist-here")  # each rank's own folder: rank 0's alone has the files
    if comm.rank == 0:
        for prefix, n in (("train", 12), ("t10k", 5)):
            write_idx(mine / f"{prefix}-images-idx3-ubyte", np.zeros((n, 28, 28), np.uint8))
            write_idx(mine / f"{prefix}-labels-idx1-ubyte", (np.arange(n) % 10).astype(np.uint8))
    others = "" if comm.size == 2 else f" and {comm.size - 2} other(s)"
    with pytest.raises(FileNotFoundError, match=re.escape(f"on rank 1{others}: ") + ".*train-images-idx3-ubyte"):
        load_dataset("mnist", comm=comm, data_dir=mine)
    nowhere = comm.bcast(str(mine / "nowhere"))  # every rank fails alike: the message as it is
    with pytest.raises(FileNotFoundError, match="^" + re.escape(f"{nowhere}: no train-images-idx3-ubyte")):
        load_dataset("mnist", comm=comm, data_dir=nowhere)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_open_data_of_other_sizes_fail_every_rank_naming_them(tmp_path_factory):
    """Each node reads its own copy: rank 0's with a CIFAR batch more than
    the others'. The ranks with fewer samples ran fewer steps and left rank
    0 waiting in its last allreduce until the watchdog."""
    comm = MPI.COMM_WORLD
    mine = tmp_path_factory.mktemp("cifar-here")
    rng = np.random.default_rng(0)
    for name in ["data_batch_1.bin", "test_batch.bin"] + (["data_batch_2.bin"] if comm.rank == 0 else []):
        rec = rng.integers(0, 256, (4, 1 + 3 * 32 * 32), dtype=np.uint8)
        rec[:, 0] %= 10
        rec.tofile(mine / name)
    others = ", ".join(map(str, range(1, comm.size)))
    want = (f"the ranks opened different cifar10 data (rank 0: 8 training and 4 test samples of shape (3, 32, 32); "
            f"rank{'s' * (comm.size > 2)} {others}: 4 training")
    with pytest.raises(ValueError, match=re.escape(want)):
        load_dataset("cifar10", comm=comm, data_dir=mine)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_open_other_bytes_of_the_same_size_fail_every_rank_naming_them(tmp_path_factory):
    """Each node reads its own copy, here of the same size: rank 0's has one
    pixel more. Every rank trained on its own data, and nothing said so."""
    comm = MPI.COMM_WORLD
    mine = tmp_path_factory.mktemp("cifar-bytes")
    for name in ("data_batch_1.bin", "test_batch.bin"):
        rec = np.random.default_rng(len(name)).integers(0, 256, (4, 1 + 3 * 32 * 32), dtype=np.uint8)
        rec[:, 0] %= 10
        rec[2, 100] += comm.rank == 0 and name == "data_batch_1.bin"
        rec.tofile(mine / name)
    others = ", ".join(map(str, range(1, comm.size)))
    with pytest.raises(ValueError) as refused:
        load_dataset("cifar10", comm=comm, data_dir=mine)
    found = re.fullmatch(rf"the ranks opened different cifar10 data \(rank 0: data ([0-9a-f]{{12}}); "
                         rf"ranks? {others}: data ([0-9a-f]{{12}}); the same sizes, other bytes\): each reads its own "
                         r"copy of the files \(or of MNIST-1D's cache\), which must be the same on every node",
                         str(refused.value))
    assert found and found[1] != found[2], str(refused.value)
    alike = comm.bcast(str(mine) if comm.rank == 1 else None, root=1)  # rank 1's copy for everyone: opened alike
    assert load_dataset("cifar10", comm=comm, data_dir=alike).train.x.row_shape == (3, 32, 32)


@pytest.mark.mpi(min_size=2)
def test_mnist1d_caches_of_their_own_are_each_made_and_must_agree(tmp_path_factory):
    """A cache folder per rank (a node's local disk, HPCJOBS_DATA_DIR set per
    rank): rank 0 alone made its own, and the others found no cache, called
    "damaged" on every run. Each now makes the one it does not see; the
    data must still be the same on every rank: one made from another seed
    under this seed's name (another mnist1d's, say) is refused."""
    from hpcjobs.training import mnist1d_cache
    from hpcjobs.training.data import fingerprint

    comm = MPI.COMM_WORLD
    mine = tmp_path_factory.mktemp("mnist1d-own")
    ds = load_dataset("mnist1d", comm=comm, data_dir=mine, num_samples=100, seed=7)
    assert (mine / "mnist1d-n100-seed7").is_dir() and len(ds.train) == 80
    assert len(set(comm.allgather(fingerprint(ds)))) == 1
    if comm.rank == 1:
        mnist1d_cache.generate(mine / "mnist1d-n100-seed8", 100, 8)
        (mine / "mnist1d-n100-seed8").rename(mine / "mnist1d-n100-seed9")
    else:
        mnist1d_cache.generate(mine / "mnist1d-n100-seed9", 100, 9)
    with pytest.raises(ValueError, match="the same sizes, other bytes"):
        load_dataset("mnist1d", comm=comm, data_dir=mine, num_samples=100, seed=9)


def test_a_killed_mnist1d_writes_folder_is_swept_by_the_next_write(tmp_path):
    """A job killed while it wrote the cache left its temporary folder (one
    per kill); the next write or load removes those untouched for an hour,
    and leaves a younger one (another job's write under way) alone."""
    import os
    import time

    from hpcjobs.training import mnist1d_cache

    target = tmp_path / "mnist1d-n100-seed3"
    killed, writing = tmp_path / ".mnist1d-n100-seed3.k1ll3d", tmp_path / ".mnist1d-n100-seed3.w0rk1n"
    for d in (killed, writing):
        d.mkdir()
        (d / "x.npy").write_bytes(b"partial")
    hour_ago = time.time() - mnist1d_cache.STALE_S - 60
    os.utime(killed, (hour_ago, hour_ago))
    mnist1d_cache.generate(target, 100, 3)
    assert target.is_dir() and not killed.exists() and writing.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [writing.name, target.name]
    # a job killed mid-write, resubmitted within the hour: its folder is left then, and swept by a later load
    # where the cache is there (no write comes again)
    os.utime(writing, (hour_ago, hour_ago))
    load_dataset("mnist1d", data_dir=tmp_path, num_samples=100, seed=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_labels_past_the_classes_are_refused_naming_the_file(tmp_path):
    """EMNIST's letters under MNIST's names loaded, trained an epoch and
    failed in the test with torch's "Target 26 is out of bounds"."""
    rng = np.random.default_rng(0)
    for prefix, n, top in (("train", 6, 10), ("t10k", 4, 27)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)).astype(np.uint8))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", np.arange(n, dtype=np.uint8) * (top - 1) // (n - 1))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: t10k labels run from 0 to 26; this dataset has "
                                                   "10 classes")):
        load_dataset("mnist", data_dir=tmp_path)
    rec = rng.integers(0, 256, (4, 1 + 3 * 32 * 32), dtype=np.uint8)
    rec[:, 0] = [0, 3, 99, 9]  # CIFAR-100's fine labels in a CIFAR-10 file
    rec.tofile(tmp_path / "data_batch_1.bin")
    rec.tofile(tmp_path / "test_batch.bin")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'data_batch_1.bin'}: labels run from 0 to 99")):
        load_dataset("cifar10", data_dir=tmp_path)


def test_cifar10_binary_batches(tmp_path):
    d = tmp_path / "cifar-10-batches-bin"
    d.mkdir()
    rng = np.random.default_rng(1)
    records = {}
    for name, n in (("data_batch_1.bin", 3), ("data_batch_2.bin", 4), ("test_batch.bin", 2)):
        rec = rng.integers(0, 256, (n, 3073)).astype(np.uint8)
        rec[:, 0] = rng.integers(0, 10, n)
        (d / name).write_bytes(rec.tobytes())
        records[name] = rec
    ds = load_dataset("cifar10", data_dir=tmp_path)
    assert (len(ds.train), len(ds.test), ds.input_shape) == (7, 2, (3, 32, 32))
    both = np.concatenate([records["data_batch_1.bin"], records["data_batch_2.bin"]])
    idx = np.array([6, 0, 3, 2])
    np.testing.assert_array_equal(ds.train.x.take(idx), both[idx, 1:].reshape(-1, 3, 32, 32))
    np.testing.assert_array_equal(ds.train.y.take(idx), both[idx, 0])
    (d / "data_batch_3.bin").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="CIFAR-10 records"):
        load_dataset("cifar10", data_dir=tmp_path)


def test_digits_and_synthetic():
    ds = load_dataset("digits")
    assert len(ds.train) + len(ds.test) == 1797 and ds.input_shape == (8, 8)
    x, _ = ds.batch(ds.train, np.arange(len(ds.train)))
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3
    s1, s2 = load_dataset("synthetic", num_samples=200, seed=3), load_dataset("synthetic", num_samples=200, seed=3)
    assert len(s1.train) == 160
    np.testing.assert_array_equal(s1.train.x.take(np.arange(160)), s2.train.x.take(np.arange(160)))
    assert len(np.unique(s1.train.y.take(np.arange(160)))) >= 5   # the teacher uses several classes


@pytest.mark.mpi(min_size=1)
def test_mnist1d_is_generated_once_and_shared(tmp_path_factory):
    comm = MPI.COMM_WORLD
    # One directory for the whole job: rank 0's path, told to everyone.
    root = comm.bcast(str(tmp_path_factory.mktemp("mnist1d")) if comm.rank == 0 else None)
    ds = load_dataset("mnist1d", comm=comm, data_dir=root, num_samples=200, seed=7)
    assert (len(ds.train), len(ds.test), ds.input_shape) == (160, 40, (40,))
    x, y = ds.batch(ds.train, np.arange(160))
    digest = np.array([float(np.round(x.sum(), 3)), float(y.sum())])
    everyone = comm.allgather(digest)
    assert all(np.array_equal(d, digest) for d in everyone)
    from mnist1d.data import get_dataset_args, make_dataset
    args = get_dataset_args()
    args.num_samples, args.seed = 200, 7
    ref = make_dataset(args)
    np.testing.assert_allclose(x, ref["x"].astype(np.float32), rtol=1e-6)
    np.testing.assert_array_equal(y, ref["y"])


def test_mnist1d_generation_failure_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match="generating MNIST-1D"):
        load_dataset("mnist1d", data_dir=blocker, num_samples=100)


def test_a_damaged_mnist1d_cache_says_which_and_what_to_do(tmp_path, monkeypatch):
    """A crash after the rename left short files, trusted by every later
    job with numpy's words alone; a failed write left its partial folder."""
    load_dataset("mnist1d", data_dir=tmp_path, num_samples=100)
    assert [p.name for p in tmp_path.iterdir()] == ["mnist1d-n100-seed42"]  # nothing else left
    x = tmp_path / "mnist1d-n100-seed42" / "x.npy"
    for cut in (0, 1000):
        x.write_bytes(x.read_bytes()[:cut] if cut else b"")
        with pytest.raises(ValueError, match=re.escape(f"{x.parent}: a damaged MNIST-1D cache (") + ".*remove the "
                                                                                                    "folder"):
            load_dataset("mnist1d", data_dir=tmp_path, num_samples=100)
    calls = []

    def full_disk(f, arr):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(122, "Disk quota exceeded")
        return np.lib.format.write_array(f, arr)

    monkeypatch.setattr(np, "save", full_disk)
    with pytest.raises(RuntimeError, match="Disk quota exceeded"):
        load_dataset("mnist1d", data_dir=tmp_path, num_samples=110)
    assert [p.name for p in tmp_path.iterdir()] == ["mnist1d-n100-seed42"]  # no partial copy


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet")


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_rank_batches_tile_the_global_batch(size):
    n, b, seed = 103, 4, 9
    for epoch in (0, 1):
        per_rank = [rank_batches(n, b, r, size, epoch, seed) for r in range(size)]
        steps = n // (b * size)
        assert all(p.shape == (steps, b) for p in per_rank)
        glob = np.concatenate(per_rank, axis=1)              # step s: ranks side by side
        one = rank_batches(n, b * size, 0, 1, epoch, seed)   # one process, batch P*b
        np.testing.assert_array_equal(glob, one)
        flat = glob.ravel()
        assert len(np.unique(flat)) == flat.size             # no sample twice in an epoch
    assert not np.array_equal(rank_batches(n, b, 0, size, 0, seed), rank_batches(n, b, 0, size, 1, seed))


def test_steps_per_epoch_drops_the_partial_batch():
    assert steps_per_epoch(100, 32) == 3
    with pytest.raises(ValueError, match="larger than the training set"):
        steps_per_epoch(10, 32)


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_eval_shards_cover_the_test_set_once(size):
    got = np.concatenate([eval_shard(10, r, size) for r in range(size)])
    np.testing.assert_array_equal(got, np.arange(10))


def test_rows_takes_across_parts():
    a, b = np.arange(6).reshape(3, 2), np.arange(6, 10).reshape(2, 2)
    rows = Rows(a, b)
    assert len(rows) == 5
    np.testing.assert_array_equal(rows.take([4, 0, 3]), [[8, 9], [0, 1], [6, 7]])
    with pytest.raises(IndexError):
        rows.take([5])


def test_text_is_bytes_and_the_next_byte_at_every_position(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(200)))
    (tmp_path / "b.txt").write_bytes(b"xyz" * 100)
    ds = load_dataset("text", data_dir=tmp_path, seq_len=10)
    assert ds.tokens and ds.num_classes == 256 and ds.input_shape == (10,)
    corpus = bytes(range(200)) + b"\n\n" + b"xyz" * 100  # the files in path order, apart
    x, y = ds.batch(ds.train, np.arange(len(ds.train)))
    assert x.dtype == y.dtype == np.int64 and (x[:, 1:] == y[:, :-1]).all()
    assert bytes(x[3].astype(np.uint8)) == corpus[30:40] and bytes(y[3].astype(np.uint8)) == corpus[31:41]
    cut = int(0.9 * len(corpus))
    assert len(ds.train) == (cut - 1) // 10 and len(ds.test) == (len(corpus) - cut - 1) // 10
    xt, _ = ds.batch(ds.test, np.arange(1))
    assert bytes(xt[0].astype(np.uint8)) == corpus[cut:cut + 10]  # the test text follows the training text


def test_a_text_corpus_of_one_file_is_mapped_not_read(tmp_path):
    """One file is mapped (every rank of a node sharing its pages), with the
    windows, split and batches of the bytes read: a copy per rank of a
    large corpus was the memory of a node times its ranks."""
    from hpcjobs.training import text

    corpus = bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8))
    (tmp_path / "one.txt").write_bytes(corpus)
    data = text.corpus(tmp_path)
    assert isinstance(data, np.memmap) and not data.flags.writeable and bytes(data) == corpus
    ds = load_dataset("text", data_dir=tmp_path, seq_len=16)
    x, y = ds.batch(ds.train, np.array([0, 7, len(ds.train) - 1]))
    assert [bytes(r.astype(np.uint8)) for r in x] == [corpus[i * 16:i * 16 + 16] for i in (0, 7, len(ds.train) - 1)]
    assert (x[:, 1:] == y[:, :-1]).all() and len(ds.train) == (int(0.9 * 5000) - 1) // 16
    (tmp_path / "two.txt").write_bytes(b"more")  # several files: joined, as before
    assert not isinstance(text.corpus(tmp_path), np.memmap) and len(text.corpus(tmp_path)) == 5000 + 2 + 4


def test_text_defaults_to_the_projects_source_and_refuses_too_little(tmp_path):
    ds = load_dataset("text", seq_len=64, num_samples=100)
    x, _ = ds.batch(ds.train, np.arange(1))
    assert bytes(x[0].astype(np.uint8)).startswith(b'"""')  # a module docstring
    assert 80 <= len(ds.train) + len(ds.test) <= 100
    with pytest.raises(FileNotFoundError, match="no text to read"):
        load_dataset("text", data_dir=tmp_path)
    (tmp_path / "short.txt").write_bytes(b"x" * 50)
    with pytest.raises(ValueError, match="too few for a test split of sequences of 10"):
        load_dataset("text", data_dir=tmp_path, seq_len=10)
    (tmp_path / "short.txt").write_bytes(b"x")  # (a negative window count: numpy's "negative dimensions")
    with pytest.raises(ValueError, match="the text corpus has 1 bytes"):
        load_dataset("text", data_dir=tmp_path, seq_len=4)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_dataset("text", data_dir=tmp_path / "missing")
    # more sequences than the corpus holds were the whole corpus, and the experiment's table said the number asked
    (tmp_path / "short.txt").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match=re.escape("--num-samples 13 asks for more text than the corpus has (100 "
                                                   "bytes: 12 sequences of 8); leave it out for the whole corpus")):
        load_dataset("text", data_dir=tmp_path, seq_len=8, num_samples=13)
    ds = load_dataset("text", data_dir=tmp_path, seq_len=4, num_samples=24)  # 97 of its 100 bytes
    assert (len(ds.train), len(ds.test)) == (21, 2)
