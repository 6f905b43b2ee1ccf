"""``hpcjobs soak``: random allreduces at 3 ranks, none wrong, memory flat;
and the soak itself notices a wrong result."""

import json

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


def test_the_soak_counts_a_wrong_result(monkeypatch):
    def off_by_one(buf, op="sum", algorithm="auto", comm=None):
        buf += 1
        return buf

    monkeypatch.setattr(hpcjobs.soak, "allreduce", off_by_one)
    result = hpcjobs.soak.soak(private(), ops=20, max_count=100, seed=1)
    assert 0 < result.wrong_ops <= 20 and result.wrong_elements > 0


def test_a_wrong_result_makes_the_soak_command_fail(monkeypatch, capsys):
    import argparse

    from hpcjobs.cli import soak as command

    monkeypatch.setattr(hpcjobs.soak, "allreduce", lambda buf, op="sum", algorithm="auto", comm=None: buf.__iadd__(1))
    args = argparse.Namespace(ops=20, max_count=100, seed=1, max_rss_growth=10.0, json=None, progress=False)
    assert command.run(args) == 1
    assert "wrong results: 0 operations" not in capsys.readouterr().out
