"""The baselines give the exact result on the same buffers as our collectives.

Horovod tests need scripts/install_horovod.sh (scripts/test.sh runs it); they
skip with the reason where it could not be built, and fail instead when
HPCJOBS_REQUIRE_HOROVOD=1 (CI sets it).
"""

import os

import numpy as np
import pytest
from mpi4py import MPI

from conftest import assert_close, make_buffer, rank_input
from hpcjobs.bench import baselines
from hpcjobs.bench.baselines import available, gloo_allreduce, horovod_allreduce, horovod_supports, mpi_allreduce

OPS = ("sum", "avg", "min", "max", "prod")


def _require_horovod():
    reason = available("horovod", MPI.COMM_WORLD)
    if reason is None:
        return
    why = os.environ.get("HPCJOBS_HOROVOD_UNAVAILABLE") or reason
    if os.environ.get("HPCJOBS_REQUIRE_HOROVOD") == "1":
        pytest.fail(f"HPCJOBS_REQUIRE_HOROVOD=1 but Horovod is unavailable: {why}")
    pytest.skip(f"Horovod unavailable: {why}")


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
    with pytest.raises(baselines.BaselineUnavailable, match="horovod-gloo must come first"):
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


def test_horovod_does_not_claim_bfloat16():
    assert not horovod_supports("bfloat16")


@pytest.mark.mpi(min_size=1)
def test_mpi_baseline_refuses_a_dtype_it_lacks():
    import torch

    with pytest.raises(TypeError, match="no bfloat16"):
        mpi_allreduce(torch.zeros(4, dtype=torch.bfloat16))


@pytest.mark.mpi(min_size=1)
def test_nccl_is_reported_unavailable_with_a_reason_on_cpu_buffers():
    reason = available("nccl", MPI.COMM_WORLD)
    assert reason is not None and "CUDA" in reason


def test_unknown_baseline_is_refused():
    with pytest.raises(ValueError, match="unknown baseline 'mkl'"):
        available("mkl", MPI.COMM_WORLD)
