"""Buffer views, op table and chunk bounds: serial, no MPI ranks needed."""

import numpy as np
import pytest

from hpcjobs.collectives import chunk_bounds, ring_allreduce
from hpcjobs.collectives._buffers import as_flat, finish_avg, reducer


@pytest.mark.parametrize("count,parts", [(0, 1), (0, 3), (1, 4), (3, 4), (5, 4), (10, 3), (1_000_003, 7)])
def test_chunk_bounds_cover_the_buffer_in_near_equal_chunks(count, parts):
    b = chunk_bounds(count, parts)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == count and len(b) == parts + 1
    assert sizes.max() - sizes.min() <= 1
    assert list(sizes) == sorted(sizes, reverse=True)


def test_flat_views_share_memory_with_numpy_and_torch():
    torch = pytest.importorskip("torch")
    a = np.zeros((2, 3), dtype=np.float32)
    f = as_flat(a)
    f.wire[4] = np.float32(2.5).view(np.uint32)
    assert a[1, 1] == 2.5
    t = torch.zeros(5, dtype=torch.bfloat16)
    g = as_flat(t)
    g.data[2] = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)[0]
    assert t[2].item() == 1.5 and g.dtype == "bfloat16"


def test_bfloat16_reductions_use_torch_arithmetic():
    torch = pytest.importorskip("torch")
    a = torch.tensor([1.0, -2.0, 3.0, 256.0], dtype=torch.bfloat16)
    b = torch.tensor([2.0, 5.0, -1.0, 1.0], dtype=torch.bfloat16)
    for op, want in [("sum", [3.0, 3.0, 2.0, 256.0]), ("min", [1.0, -2.0, -1.0, 1.0]),
                     ("max", [2.0, 5.0, 3.0, 256.0]), ("prod", [2.0, -10.0, -3.0, 256.0])]:
        x = a.clone()
        reducer(op, "bfloat16")(as_flat(x).data, as_flat(b).data)
        assert x.tolist() == want, op
    x = torch.tensor([3.0, -3.0], dtype=torch.bfloat16)
    finish_avg(as_flat(x).data, "bfloat16", 2)
    assert x.tolist() == [1.5, -1.5]


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_float16_sums_are_numpys_to_the_bit(op):
    """float16 sums go through torch's vectorised add: the same bits as numpy's
    float16 add on every pattern, subnormals, infinities, NaNs and -0 among them."""
    bits = np.random.default_rng(7).integers(0, 1 << 16, size=(2, 1 << 22), dtype=np.uint16)
    special = np.array([0x0001, 0x8001, 0x03FF, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x8000, 0x0000, 0x3C00,
                        0x6800], dtype=np.uint16)
    bits[0, :special.size], bits[1, :special.size] = special, special[::-1]
    dst, src = bits[0].view(np.float16), bits[1].view(np.float16).copy()
    with np.errstate(all="ignore"):
        want = np.add(dst, src)
    reducer(op, "float16")(dst, src)
    same = (dst.view(np.uint16) == want.view(np.uint16)) | (np.isnan(dst) & np.isnan(want))
    assert same.all(), f"{int((~same).sum())} of {dst.size} differ"
    read_only = np.ones(4, np.float16)
    read_only.flags.writeable = False
    x = np.full(4, 0.5, np.float16)
    reducer(op, "float16")(x, read_only)
    assert x.tolist() == [1.5] * 4


def test_float16_averages_are_numpys_to_the_bit():
    """The division of a float16 avg goes through torch too: the same bits as
    numpy's float16 divide, for every float16 and every group size 2-64."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    for size in range(2, 65):
        with np.errstate(all="ignore"):
            want = np.true_divide(every, np.float16(size))
        got = every.copy()
        finish_avg(got, "float16", size)
        same = (got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), f"size {size}: {int((~same).sum())} of {got.size} differ"


def test_integer_avg_is_floor_division():
    x = np.array([7, -7, 6], dtype=np.int32)
    finish_avg(x, "int32", 2)
    assert x.tolist() == [3, -4, 3]


@pytest.mark.parametrize("bad,exc,words", [
    (np.zeros(10)[::2], ValueError, "contiguous"),
    (np.zeros(4, dtype=np.complex64), TypeError, "unsupported dtype"),
    (np.zeros(4, dtype=">f4"), TypeError, "unsupported dtype"),
    ([1.0, 2.0], TypeError, "numpy.ndarray or torch.Tensor"),
])
def test_bad_buffers_are_refused_with_a_clear_error(bad, exc, words):
    with pytest.raises(exc, match=words):
        ring_allreduce(bad)


def _unaligned(count: int) -> np.ndarray:
    return np.frombuffer(bytearray(4 * count + 1), dtype=np.float32, offset=1, count=count)


def test_an_unaligned_buffer_is_refused():
    """np.frombuffer at an odd offset (a file's header, a memmap): mpi4py
    maps no MPI type to its memory, and ring's first send raised KeyError on
    that rank while the others waited."""
    torch = pytest.importorskip("torch")
    for bad in (_unaligned(5), torch.frombuffer(bytearray(21), dtype=torch.float32, offset=1),
                torch.frombuffer(bytearray(11), dtype=torch.bfloat16, offset=1)):
        with pytest.raises(ValueError, match="not aligned to its element size"):
            ring_allreduce(bad)
    ring_allreduce(np.require(_unaligned(5), requirements="A"))  # the copy the message names


def test_read_only_buffer_is_refused():
    a = np.zeros(4)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ring_allreduce(a)


def test_bad_torch_tensors_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="contiguous"):
        ring_allreduce(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="sparse"):
        ring_allreduce(torch.zeros(4).to_sparse())
    with pytest.raises(TypeError, match="unsupported dtype"):
        ring_allreduce(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="on meta"):
        ring_allreduce(torch.zeros(4, device="meta"))


@pytest.mark.parametrize("kwargs,words", [({"op": "mean"}, "unknown op"),
                                          ({"pipeline": True, "segment_bytes": 0}, "segment_bytes"),
                                          ({"pipeline": True, "segment_bytes": 1.5}, "segment_bytes")])
def test_bad_arguments_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ring_allreduce(np.zeros(4), **kwargs)


@pytest.mark.parametrize("dtype,size", [("int8", 128), ("int8", 1000), ("uint8", 256), ("int16", 40000),
                                        ("int8", 127)])
def test_an_integer_average_over_more_ranks_than_the_dtype_counts_to(dtype, size):
    """avg divides the integer sum by the ranks with floor division; from 128
    ranks int8 cannot hold the divisor (numpy raised OverflowError, on the
    ranks that divide: under the tree and the parameter server, only the
    root, and the others waited for it)."""
    info = np.iinfo(dtype)
    data = np.array(sorted({info.min, -1 if info.min else 0, 0, 1, info.max}), dtype=dtype)
    want = [int(v) // size for v in data]
    finish_avg(data, dtype, size)
    assert data.tolist() == want and data.dtype == np.dtype(dtype)
    finish_avg(np.zeros(0, dtype), dtype, size)  # an empty chunk too


@pytest.mark.parametrize("size", [3, 2049, 70000])
def test_float16_avg_divides_alike_with_and_without_torch(monkeypatch, size):
    """Without torch (an optional extra) numpy divided by the rank count as
    float16: 2049 ranks became 2048, and from 65520 inf (every average 0).
    Ranks with and without torch must end with the same bits."""
    torch = pytest.importorskip("torch")
    from hpcjobs.collectives import _buffers

    x = (np.arange(-3000, 3000, dtype=np.float32) * 7.3).astype(np.float16)
    with_torch = x.copy()
    finish_avg(with_torch, "float16", size)
    monkeypatch.setattr(_buffers, "_optional_torch", lambda: None)
    without = x.copy()
    finish_avg(without, "float16", size)
    assert np.array_equal(without.view(np.uint16), with_torch.view(np.uint16))
    assert np.array_equal(with_torch, torch.from_numpy(x.copy()).div_(size).numpy())
