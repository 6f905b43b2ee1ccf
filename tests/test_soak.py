"""``hpcjobs soak``: random allreduces at 3 ranks, none wrong, memory flat;
and the soak itself notices a wrong result."""

import json

import numpy as np
import pytest

import hpcjobs.soak
from launch import mpirun
from hpcjobs.comm import private


def test_soak_at_3_ranks_has_no_wrong_results_and_flat_memory(tmp_path):
    out = mpirun(3, "soak", "--ops", "2000", "--json", str(tmp_path / "soak.json"), "--no-progress", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.load(open(tmp_path / "soak.json"))
    assert data["ranks"] == 3 and data["ops"] == 2000 and data["wrong_ops"] == 0
    assert data["max_rss_growth_percent"] < 10 and all(r["start"] > 0 for r in data["rss"])
    assert sum(data["per_algorithm"].values()) == 2000 and min(data["per_algorithm"].values()) > 100


def test_few_large_operations_are_not_read_as_growth(tmp_path):
    """The baseline was read after the first 1% of operations alone: 150
    operations up to 20M elements read the scratch kept for the first large
    message, and the allocator's free pages, as 65% growth. Each algorithm
    now runs once at --max-count first, and free pages go back before a read."""
    out = mpirun(2, "soak", "--ops", "100", "--max-count", "8000000", "--json", str(tmp_path / "soak.json"),
                 "--no-progress", timeout=300)
    data = json.load(open(tmp_path / "soak.json"))
    assert out.returncode == 0 and data["wrong_ops"] == 0, out.stdout + out.stderr
    assert data["warmup_ops"] == len(hpcjobs.soak.algorithms(private())) and data["max_rss_growth_percent"] < 10


def test_a_leak_is_read_as_growth(monkeypatch):
    real, kept = hpcjobs.soak.allreduce, []

    def leaking(buf, **kw):
        kept.append(np.ones(1 << 18))  # 2 MiB, resident, never freed
        return real(buf, **kw)

    monkeypatch.setattr(hpcjobs.soak, "allreduce", leaking)
    result = hpcjobs.soak.soak(private(), ops=200, max_count=100, seed=1)
    (_, start, end), = result.rss
    assert result.wrong_ops == 0 and end - start > 300 * 2**20, result.rss  # 396 MiB kept after the first 1%


def test_the_soak_counts_a_wrong_result(monkeypatch):
    def off_by_one(buf, op="sum", algorithm="auto", comm=None):
        buf += 1
        return buf

    monkeypatch.setattr(hpcjobs.soak, "allreduce", off_by_one)
    result = hpcjobs.soak.soak(private(), ops=20, max_count=100, seed=1)
    assert 0 < result.wrong_ops <= 20 + result.warmup and result.wrong_elements >= 100 * result.warmup


@pytest.mark.mpi(min_size=2)
def test_a_wrong_operation_counts_once_and_is_named(monkeypatch):
    """Wrong operations were summed over ranks (one bad allreduce at 3 ranks
    counted 3) and nothing said which draw it was; the seed was not in the
    JSON. Each counts once now, and the first are named."""
    # 7 more, wrong at any rank count (1 more was right in the warm-up's ones at 2 ranks)
    monkeypatch.setattr(hpcjobs.soak, "allreduce", lambda buf, op="sum", algorithm="auto", comm=None: buf.__iadd__(7))
    seen, real = [], hpcjobs.soak._buffer
    monkeypatch.setattr(hpcjobs.soak, "_buffer", lambda values, *a: (seen.append(values.size), real(values, *a))[1])
    result = hpcjobs.soak.soak(private(), ops=20, max_count=100, seed=1)
    assert result.wrong_ops == result.warmup + sum(n > 0 for n in seen)  # every non-empty one, once
    assert result.wrong[0] == {"op_index": "warm-up", "algorithm": hpcjobs.soak.algorithms(private())[0],
                               "dtype": "float64", "op": "sum", "count": 100, "torch": False}
    assert len(result.wrong) == hpcjobs.soak.WRONG_KEPT
    assert {k: result.to_dict()[k] for k in ("seed", "max_count")} == {"seed": 1, "max_count": 100}


def test_counts_reach_max_count():
    """The draw gave 0..max_count - 1: --max-count 1 soaked empty buffers only."""
    seen = []
    real = hpcjobs.soak._buffer

    def recording(values, dtype, torch_buffer):
        seen.append(values.size)
        return real(values, dtype, torch_buffer)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(hpcjobs.soak, "_buffer", recording)
        assert hpcjobs.soak.soak(private(), ops=200, max_count=1, seed=2).wrong_ops == 0
        assert set(seen) == {0, 1}
        seen.clear()
        hpcjobs.soak.soak(private(), ops=300, max_count=3, seed=2)
        assert set(seen) == {0, 1, 2, 3}


def test_a_wrong_result_makes_the_soak_command_fail(monkeypatch, capsys):
    import argparse

    from hpcjobs.cli import soak as command

    monkeypatch.setattr(hpcjobs.soak, "allreduce", lambda buf, op="sum", algorithm="auto", comm=None: buf.__iadd__(1))
    args = argparse.Namespace(ops=20, max_count=100, seed=1, max_rss_growth=10.0, json=None, progress=False)
    assert command.run(args) == 1
    out = capsys.readouterr().out
    assert "wrong results: 0 operations" not in out
    assert "# wrong: operation warm-up: " in out and "more (--seed 1)" in out


def test_half_precision_sums_are_exact_in_any_order_at_many_ranks():
    """The soak knows the exact answer only where every partial sum is an
    integer the format holds (bfloat16 to 256, float16 to 2048): at 6 ranks
    values up to 64 rounded bfloat16's partial sums, and it counted a sum
    taken in another order as wrong. The values shrink with the ranks."""
    import torch

    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        for size in (2, 6, 8, 16, 40):
            vals = [hpcjobs.soak._values(np.random.default_rng([1, r]), 4096, dtype, "sum", size) for r in range(size)]
            exact = torch.tensor(np.sum(vals, axis=0).astype(np.float32)).to(torch_dtype)
            for order in (vals, vals[::-1]):
                acc = torch.tensor(order[0], dtype=torch.float32).to(torch_dtype)
                for v in order[1:]:
                    acc = acc + torch.tensor(v, dtype=torch.float32).to(torch_dtype)
                assert torch.equal(acc, exact), (dtype, size)


@pytest.mark.mpi(min_size=2)
def test_shared_memory_algorithms_are_soaked_where_memory_is_shared(monkeypatch):
    """Nodes simulated on one host (HPCJOBS_RANKS_PER_NODE) still share its
    memory: shm and oneshot run there and are soaked; the topology's node
    count had left them out."""
    from mpi4py import MPI

    from hpcjobs.collectives.names import SHARED_MEMORY

    monkeypatch.setenv("HPCJOBS_RANKS_PER_NODE", "1")
    comm = MPI.COMM_WORLD.Dup()  # a communicator of its own (private() is the suite's cached one: never freed)
    assert set(SHARED_MEMORY) <= set(hpcjobs.soak.algorithms(comm))
    comm.Free()
