"""The baselines give the exact result on the same buffers as our collectives.

Horovod tests need scripts/install_horovod.sh (scripts/test.sh runs it); they
skip with the reason where it could not be built, and fail instead when
HPCJOBS_REQUIRE_HOROVOD=1 (CI sets it).
"""

import os

import numpy as np
import pytest
from mpi4py import MPI

from conftest import OPS, assert_close, make_buffer, rank_input
from hpcjobs.bench import baselines
from hpcjobs.bench.baselines import available, gloo_allreduce, horovod_allreduce, horovod_supports, mpi_allreduce
from launch import require


def _require_horovod():
    reason = available("horovod", MPI.COMM_WORLD)
    if reason is None:
        return
    require(f"Horovod is unavailable: {os.environ.get('HPCJOBS_HOROVOD_UNAVAILABLE') or reason}")


@pytest.fixture(scope="module", autouse=True)
def _tear_down_libraries():
    yield
    baselines.shutdown()  # Horovod's coordinator thread would tax every later test


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16", "bfloat16"])
def test_gloo_gives_the_exact_result_in_place(dtype, op):
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [rank_input(r, 1001, dtype, op) for r in range(size)]
    buf = make_buffer(inputs[rank], dtype, "torch" if dtype == "bfloat16" else "numpy")
    assert gloo_allreduce(buf, op) is buf
    assert_close(buf, inputs, op, dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16"])
def test_horovod_gives_the_exact_result_in_place(dtype, op):
    _require_horovod()
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [rank_input(r, 1001, dtype, op) for r in range(size)]
    buf = make_buffer(inputs[rank], dtype, "numpy")
    assert horovod_allreduce(buf, op) is buf
    assert_close(buf, inputs, op, dtype)


@pytest.mark.mpi(min_size=1)
def test_horovod_gloo_after_horovods_mpi_controller_is_refused_with_the_reason():
    _require_horovod()
    buf = np.ones(8, dtype=np.float32)
    horovod_allreduce(buf)  # the MPI controller runs in this process
    assert "must come first" in available("horovod-gloo", MPI.COMM_WORLD)
    with pytest.raises(baselines.Unavailable, match="horovod-gloo must come first"):
        horovod_allreduce(buf, controller="gloo")


@pytest.mark.parametrize("order", ["horovod,horovod-gloo", "horovod-gloo,mpi"])
def test_horovod_with_gloo_and_with_mpi_in_one_table_exact(order, tmp_path):
    """Both Horovod controllers, as `--baselines all` runs them: Gloo's pass
    first whatever the order asked, each exact on crafted inputs (#wrong)."""
    from launch import mpirun

    _require_horovod()
    out = mpirun(2, "bench", "allreduce", "-b", "8", "-e", "64K", "-f", "32", "--iters", "2", "--impl", "ring",
                 "--baselines", order, "--op", "avg", "--json", str(tmp_path / "r.json"), timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [l.split() for l in out.stdout.splitlines() if l and not l.startswith("#")]
    impls = [r[4] for r in rows]
    for name in order.split(","):
        assert impls.count(name) == 3, out.stdout  # 8, 256, 8K
    assert all(r[-1] == "0" for r in rows)
    if "horovod" in impls:
        assert impls.index("horovod-gloo") < impls.index("horovod")
    if "mpi" in impls:  # the anchor's drift is against the first pass's MPI rows
        assert "# anchor beside horovod-gloo: MPI_Allreduce took" in out.stdout


def test_horovod_in_several_passes_runs_once_after_the_last(tmp_path):
    """Started in pass 1, Horovod's MPI controller kept a thread busy beside
    pass 2's rows, and horovod-gloo could not start again there: the run
    died with a traceback. Its rows come once, after the last pass."""
    from launch import mpirun

    _require_horovod()
    out = mpirun(2, "bench", "allreduce", "-b", "8", "-e", "256", "-f", "32", "--iters", "2", "--impl", "ring",
                 "--baselines", "mpi,horovod-gloo,horovod", "--passes", "2", timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    second = lines.index("# pass 2 of 2")
    impls = [l.split()[4] for l in lines if l and not l.startswith("#")]
    before = [l.split()[4] for l in lines[:second] if l and not l.startswith("#")]
    assert "horovod" not in before and "horovod-gloo" not in before
    # the second pass's 2 sizes, then the medians' 2: each once per size in each
    assert impls.count("horovod") == impls.count("horovod-gloo") == 4, out.stdout


def test_horovods_late_pass_runs_without_our_doors_threads():
    """Horovod's pass comes after the others; hvd-hpcjobs' controller, started
    by its row, went on polling every millisecond on rank 0 beside it. The
    doors stop first now: the threads alive in each pass are recorded."""
    from launch import mpirun_script

    _require_horovod()
    out = mpirun_script(2, """
import threading
from mpi4py import MPI
import hpcjobs.bench.sweep as sweep
from hpcjobs.cli import main
seen = {}
real = sweep.run
def spy(comm, sizes, impls, **kw):
    seen[",".join(impls)] = {t.name for t in threading.enumerate() if t.name.startswith("hpcjobs-")} - {
        "hpcjobs-watchdog"}  # (every collective's, from the first call on)
    return real(comm, sizes, impls, **kw)
sweep.run = spy
assert main(["bench", "allreduce", "-b", "8", "-e", "256", "-f", "32", "--iters", "2", "--impl", "ring",
             "--baselines", "mpi,hvd-hpcjobs,horovod"]) == 0
first, late = seen
assert "hvd-hpcjobs" in first and late == "horovod,mpi (anchor)", seen
assert seen[late] == set(), seen
print("threads checked on rank", MPI.COMM_WORLD.Get_rank())
""", timeout=300)
    assert out.returncode == 0 and out.stdout.count("threads checked on rank") == 2, \
        out.stdout[-2000:] + out.stderr[-3000:]


def test_horovod_does_not_claim_bfloat16():
    assert not horovod_supports("bfloat16")


@pytest.mark.mpi(min_size=1)
def test_mpi_baseline_refuses_a_dtype_it_lacks():
    import torch

    with pytest.raises(TypeError, match="no bfloat16"):
        mpi_allreduce(torch.zeros(4, dtype=torch.bfloat16))


@pytest.mark.mpi(min_size=1)
def test_nccl_is_reported_unavailable_with_the_reason_where_there_is_no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert available("nccl", MPI.COMM_WORLD) == "no CUDA GPU is visible here (nccl reduces GPU memory)"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16", "bfloat16"])
def test_the_nccl_adapter_is_exact_on_a_device_copy(dtype, op):
    """tensor_allreduce on a DeviceStage, as the nccl row runs it; here the
    device is the CPU, so the process group's Gloo does the reduction (on a
    GPU it is NCCL). The host buffer only changes on download."""
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    inputs = [rank_input(r, 1001, dtype, op) for r in range(size)]
    buf = make_buffer(inputs[rank], dtype, "torch")
    untouched = buf.clone()
    stage = baselines.DeviceStage(buf, "cpu")
    stage.upload()
    assert baselines.tensor_allreduce(stage.buf, op) is stage.buf
    assert_close(stage.buf, inputs, op, dtype)
    assert bool((buf == untouched).all())
    stage.download()
    assert_close(buf, inputs, op, dtype)


def test_nccl_named_in_impl_is_checked_and_skipped_with_the_reason():
    """--impl nccl goes through the same availability check as --baselines:
    without a GPU the row is skipped with the reason, the rest still runs."""
    import torch
    from launch import mpirun

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = mpirun(2, "bench", "allreduce", "-b", "8", "-e", "8", "--iters", "2", "--impl", "ring,nccl",
                 "--baselines", "none", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "# nccl: skipped: no CUDA GPU is visible here (nccl reduces GPU memory)" in out.stdout
    rows = [l.split() for l in out.stdout.splitlines() if l and not l.startswith("#")]
    assert [r[4] for r in rows] == ["ring"] and rows[0][-1] == "0"


def test_the_nccl_adapter_wants_a_tensor():
    with pytest.raises(TypeError, match="expected a torch tensor, got ndarray"):
        baselines.tensor_allreduce(np.zeros(4, dtype=np.float32))


def test_unknown_baseline_is_refused():
    with pytest.raises(ValueError, match="unknown baseline 'mkl'"):
        available("mkl", MPI.COMM_WORLD)
