"""The allreduce benchmark: its crafted inputs, its records and its #wrong count."""

import json

import numpy as np
import pytest
from mpi4py import MPI

from conftest import DTYPES, OPS
from hpcjobs.bench.baselines import mpi_supports
from hpcjobs.bench.sweep import Record, expected_output, implementations, make_input, run
from hpcjobs.comm import install


def _values(arr, dtype):
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16).double().numpy()
    return arr.astype(np.float64)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 40])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_expected_output_is_the_reduction_of_every_rank_input(dtype, op, size):
    pytest.importorskip("torch") if dtype == "bfloat16" else None
    count = 13
    inputs = np.stack([_values(make_input(count, dtype, op, r), dtype) for r in range(size)])
    want = {"sum": inputs.sum(0), "avg": inputs.sum(0), "min": inputs.min(0),
            "max": inputs.max(0), "prod": inputs.prod(0)}[op]
    if op == "avg":
        want = np.floor(want / size) if dtype.startswith("int") else want / size
    got = _values(expected_output(count, dtype, op, size), dtype)
    if dtype.startswith("int") and op == "prod":
        want = np.array([int(v) for v in want], dtype=object)
        width = np.iinfo(dtype).bits
        want = np.array([((int(v) + (1 << (width - 1))) % (1 << width)) - (1 << (width - 1)) for v in want])
    if dtype.startswith("float"):
        with np.errstate(over="ignore"):  # 2**40 is inf in float16, as the collectives compute it
            want = want.astype(dtype).astype(np.float64)
    # exact where representable; a rounded avg (e.g. 1/3) within half an ulp
    np.testing.assert_allclose(got, want, rtol=2.0 ** -8 if dtype in ("float16", "bfloat16") else 1e-6)


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="unknown implementation 'nccl-ish'"):
        implementations(["ring", "nccl-ish"], [])


def test_several_segment_sizes_give_one_labelled_row_each():
    assert list(implementations(["ring", "ring_pipelined", "mpi"], [65536, 1 << 20])) == [
        "ring", "ring_pipelined/64K", "ring_pipelined/1M", "mpi"]


def test_a_check_row_runs_at_the_segment_sizes_asked_for():
    """ring_pipelined+check took the default segments while ring_pipelined
    took 64K: the difference was read as the check's cost."""
    impls = implementations(["ring_pipelined", "ring_pipelined+check", "hierarchical+check"], [65536])
    assert list(impls) == ["ring_pipelined", "ring_pipelined+check", "hierarchical/64K+check"]
    assert [i.checks for i in impls.values()] == [False, True, True]
    assert impls["ring_pipelined+check"].fn.keywords == {"segment_bytes": 65536}
    assert impls["hierarchical/64K+check"].fn.keywords == {"segment_bytes": 65536}
    two = implementations(["ring_pipelined+check"], [65536, 1 << 20])
    assert list(two) == ["ring_pipelined/64K+check", "ring_pipelined/1M+check"]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "int64", "float16", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_bench_records_zero_wrong_for_every_implementation(dtype, op):
    comm = MPI.COMM_WORLD
    impls = implementations(["ring", "ring_pipelined", "mpi"], [64])
    records = run(comm, [8, 1000, 65536], impls, dtype, op, iters=2, warmup=1)
    # MPI_Allreduce has no bfloat16 anywhere, and float16 only in Open MPI
    expected_impls = {"ring", "ring_pipelined"} | ({"mpi"} if mpi_supports(dtype) else set())
    assert {r.impl for r in records} == expected_impls
    assert all(r.wrong == 0 for r in records)
    assert all(r.time_us > 0 and r.busbw_gbps >= 0 for r in records)
    P = comm.Get_size()
    for r in records:
        assert r.busbw_gbps == pytest.approx(r.algbw_gbps * (2 * (P - 1) / P if P > 1 else 1))


@pytest.mark.mpi(min_size=1)
def test_a_result_left_from_an_earlier_call_counts_as_wrong():
    """A row whose output is its result of two calls before (a stale slot,
    a missed fence) was bit for bit right with the same input every call,
    and only the last call was checked: #wrong 0. Calls take turns among
    three inputs now, and every one is checked."""
    from hpcjobs.bench.sweep import Impl
    from hpcjobs.collectives import allreduce

    kept = []

    def stale(buf, op, comm):
        allreduce(buf, op, "ring", comm)
        kept.append(buf.copy())
        if len(kept) > 2:
            buf[:] = kept[-3]

    comm = MPI.COMM_WORLD
    records = run(comm, [4096], {**implementations(["ring"]), "stale": Impl(stale)}, "float32", "sum", iters=4,
                  warmup=1)
    wrong = {r.impl: r.wrong for r in records}
    assert wrong["ring"] == 0 and wrong["stale"] > 0, wrong


@pytest.mark.parametrize("variant", [1, 2])
def test_every_variant_of_the_inputs_has_its_exact_result(variant):
    from hpcjobs.bench.inputs import VARIANTS

    assert VARIANTS % 2  # two slots in turn never see the same variant twice running
    inputs = np.stack([make_input(1000, "int64", "sum", r, variant) for r in range(5)])
    assert (inputs.sum(axis=0) == expected_output(1000, "int64", "sum", 5, variant)).all()
    assert (expected_output(1000, "int64", "sum", 5, variant) != expected_output(1000, "int64", "sum", 5)).any()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_symmetric_buffers_run_every_row_and_shm_without_staging(dtype, monkeypatch):
    from hpcjobs.collectives import shm
    from hpcjobs.collectives.symmetric import _ALLOCATIONS

    calls = []
    real = shm._two_shot
    monkeypatch.setattr(shm, "_two_shot", lambda *a, **k: (calls.append(1), real(*a, **k)))
    comm = MPI.COMM_WORLD
    impls = implementations(["shm", "ring", "auto", "mpi"])
    records = run(comm, [4096, 1 << 20], impls, dtype, "sum", iters=2, warmup=1, buffers="symmetric")
    assert {r.impl for r in records} == {"shm", "ring", "auto"} | ({"mpi"} if mpi_supports(dtype) else set())
    assert all(r.wrong == 0 for r in records)
    assert len(calls) >= 2 * (2 + 1)  # shm's row: warmup + iters at both sizes, zero-copy every time
    assert _ALLOCATIONS == []  # each size's buffer freed after it


@pytest.mark.mpi(min_size=2)
def test_a_wrong_implementation_is_counted():
    comm = MPI.COMM_WORLD

    def broken(buf, op, comm):  # forgets the other ranks
        return buf

    records = run(comm, [64], {"broken": broken}, "float32", "sum", iters=1, warmup=0)
    assert records[0].wrong > 0


def _cpu_stage(host, comm):
    from hpcjobs.bench.baselines import DeviceStage

    return DeviceStage(host, "cpu")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_a_staged_implementation_is_fed_and_read_back_outside_the_timed_call(dtype, op):
    """The nccl row's path with a CPU copy in place of the GPU: the input
    reaches the copy before every call, the checked result is the copy's,
    and the host buffer the others share is left alone meanwhile."""
    from hpcjobs.bench.baselines import nccl_supports, tensor_allreduce
    from hpcjobs.bench.sweep import Impl

    comm = MPI.COMM_WORLD
    seen = []

    def staged(buf, op, comm):
        seen.append(buf)
        return tensor_allreduce(buf, op, comm)

    def forgets_the_copy(buf, op, comm):  # reduces nothing: the copy keeps the input
        return buf

    impls = {"staged": Impl(staged, nccl_supports, stage=_cpu_stage),
             "idle": Impl(forgets_the_copy, stage=_cpu_stage), "ring": implementations(["ring"])["ring"]}
    records = {r.impl: r for r in run(comm, [64, 4096], impls, dtype, op, iters=3, warmup=1)}
    assert records["staged"].wrong == 0 and records["ring"].wrong == 0
    assert records["idle"].wrong > 0  # the check reads the copy, not the host buffer
    host_types = {type(b).__name__ for b in seen}
    assert host_types == {"Tensor"} and len({id(b) for b in seen}) == 2  # one copy per size


@pytest.mark.mpi(min_size=1)
def test_json_report_holds_records_and_environment(tmp_path_factory):
    from hpcjobs.bench.report import environment, write_json

    comm = MPI.COMM_WORLD
    records = run(comm, [16], implementations(["ring"], []), iters=1, warmup=0)
    path = tmp_path_factory.mktemp(f"r{comm.Get_rank()}") / "out.json"
    write_json(str(path), records, environment(comm))
    data = json.loads(path.read_text())
    assert data["environment"]["ranks"] == comm.Get_size()
    assert data["environment"]["hpcjobs"] == install()[0]  # which code measured it
    assert data["records"][0]["impl"] == "ring" and data["records"][0]["size_bytes"] == 16


def test_median_records_take_each_rows_median_time_and_recompute_its_bandwidths():
    from hpcjobs.bench.sweep import median_records

    def rec(size, impl, t, wrong=0):
        return Record(size, size // 4, "float32", "sum", impl, 4, 10, t, 0.0, 0.0, wrong)

    passes = [[rec(1000, "ring", 10.0), rec(1000, "mpi", 4.0), rec(8000, "ring", 50.0, wrong=1)],
              [rec(1000, "ring", 30.0), rec(1000, "mpi", 5.0), rec(8000, "ring", 40.0)],
              [rec(1000, "ring", 20.0), rec(1000, "mpi", 90.0), rec(8000, "ring", 45.0, wrong=2)]]
    got = median_records(passes)
    assert [(r.size_bytes, r.impl, r.time_us, r.wrong) for r in got] == [
        (1000, "ring", 20.0, 0), (1000, "mpi", 5.0, 0), (8000, "ring", 45.0, 3)]
    ring = got[0]
    assert ring.algbw_gbps == pytest.approx(1000 / 20e-6 / 1e9)  # 0.05 GB/s
    assert ring.busbw_gbps == pytest.approx(ring.algbw_gbps * 2 * 3 / 4)
    assert median_records(passes[:2])[0].time_us == 20.0  # two passes: the mean of the middle two


@pytest.mark.parametrize("size", [3, 6, 12])
def test_the_inputs_tell_every_rank_and_position_apart(size):
    """With inputs that repeat every 3 elements and every 3 ranks, ranks r
    and r + 3 held the same input and the sum came out the same at every
    element: a dropped rank or a rotated chunk left #wrong at 0."""
    for op in ("sum", "prod", "min"):
        inputs = [make_input(251, "int64", op, r) for r in range(size)]
        assert len({a.tobytes() for a in inputs}) == size, op
    total = expected_output(502, "int64", "sum", size)
    assert len(set(total.tolist())) >= 4  # not one value everywhere: 0..size of 0/1 inputs
    dropped = sum(make_input(502, "int64", "sum", r) for r in range(size - 1))  # the last rank left out
    assert (dropped != total).mean() > 0.5
    rotated = np.roll(total, 4)  # a chunk shifted by a few elements
    assert (rotated != total).mean() > 0.5


@pytest.mark.mpi(min_size=1)
def test_a_late_row_carries_its_anchors_drift_into_its_records():
    """The anchor's drift was printed as a # line only: the JSON, the CSV and
    the verdicts could not tell a late row's pass from the others'."""
    from dataclasses import replace

    from hpcjobs.bench.sweep import late_passes, median_records
    from hpcjobs.bench.baselines import mpi_label

    comm = MPI.COMM_WORLD
    first = run(comm, [4096], implementations(["mpi"]), "float32", "sum", iters=3, warmup=1)
    fast_first = [replace(r, time_us=r.time_us / 1e6) for r in first]  # as if MPI had been 1e6x faster then
    late = late_passes(comm, [4096], {"horovod": implementations(["ring"])["ring"]}, fast_first,  # a stand-in
                       dtype="float32", op="sum", iters=3, warmup=1)
    (r,) = late
    assert r.impl == "horovod" and r.anchor_drift is not None and r.anchor_drift > 100  # (about 1e6)
    assert median_records([fast_first + late])[-1].anchor_drift == r.anchor_drift
    assert first[0].impl == mpi_label() and first[0].anchor_drift is None
