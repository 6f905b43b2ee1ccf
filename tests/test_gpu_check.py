"""scripts/gpu_check.sh refuses what it cannot run before it installs or
starts anything: an unknown phase, or a rank count that is not a positive
integer (checked here, on a machine without a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, **env):
    full = {**os.environ, "HPCJOBS_PYTHON": sys.executable, "HPCJOBS_GPU_OUT": str(tmp_path), **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=full, capture_output=True,
                          text=True, timeout=120)


def test_an_unknown_phase_is_refused(tmp_path):
    p = _run(tmp_path, HPCJOBS_GPU_PHASES="small trian")
    assert p.returncode == 2
    assert "unknown phase 'trian'" in p.stderr
    assert "unknown phase 'trian'" in (tmp_path / "summary.txt").read_text()


@pytest.mark.parametrize("var", ["HPCJOBS_GPU_TEST_RANKS", "HPCJOBS_GPU_BENCH_RANKS"])
@pytest.mark.parametrize("ranks", ["2 x", "0", "-4"])
def test_a_bad_rank_count_is_refused_before_any_run(tmp_path, var, ranks):
    p = _run(tmp_path, HPCJOBS_GPU_PHASES="small", **{var: ranks})
    assert p.returncode == 2, p.stderr
    assert "is not a positive integer" in p.stderr
    assert not list(tmp_path.glob("small-np*"))  # nothing ran
