"""A Horovod script runs unchanged but for its import line: the same
script (horovod_script.py, the calls Horovod's examples make) under
mpirun with ``horovod.torch`` and with ``hpcjobs.horovod.torch``, in the
same test, ends with the same parameters. torchvision's CUDA wheels do not
import here, so the script gets a stand-in ``torchvision`` (a folder on its
PYTHONPATH, made by the test) serving hpcjobs' own ResNets."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from launch import _mpirun_prefix, launch_env, require, run

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _require_horovod():
    found = importlib.util.find_spec("horovod") is not None and \
        importlib.util.find_spec("horovod.torch.mpi_lib_v2") is not None
    require(None if found else "horovod.torch is not installed (scripts/install_horovod.sh)")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A ``torchvision`` whose ``models`` are hpcjobs' ResNets -- for the
    test only, never in the installed package."""
    root = tmp_path_factory.mktemp("stand-in")
    (root / "torchvision").mkdir()
    (root / "torchvision" / "__init__.py").write_text("from . import models  # noqa: F401\n")
    (root / "torchvision" / "models.py").write_text("from hpcjobs.training.resnet import resnet18, resnet50  "
                                                    "# noqa: F401\n")
    return root


def _script(n, api, out, stand_in, *args):
    env = {"PYTHONPATH": f"{stand_in}{os.pathsep}{ROOT}"}
    with launch_env(env) as e:
        proc = run([*_mpirun_prefix(n)[:-1], "-x", "PYTHONPATH", _mpirun_prefix(n)[-1], "-W", "ignore",
                    str(HERE / "horovod_script.py"), "--api", api, "--out", str(out), *args], 300, e)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "final loss" in proc.stdout
    return torch.load(out)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_the_script_ends_with_horovods_parameters(stand_in, tmp_path):
    """ResNet-18, 6 steps of SGD with momentum and weight decay, the
    ImageNet example's warmup, 2 backward passes per step, float64 (float32
    rounding, different between any two builds, grows over training)."""
    _require_horovod()
    args = ("--float64", "--batches-per-allreduce", "2")
    theirs = _script(2, "horovod", tmp_path / "horovod.pt", stand_in, *args)
    ours = _script(2, "hpcjobs", tmp_path / "ours.pt", stand_in, *args)
    assert _rel(ours, theirs) <= 1e-9, _rel(ours, theirs)


def test_fp16_compression_matches_horovods_to_fp16_rounding(stand_in, tmp_path):
    _require_horovod()
    args = ("--float64", "--fp16-allreduce", "--steps", "1")
    theirs = _script(3, "horovod", tmp_path / "horovod.pt", stand_in, *args)
    ours = _script(3, "hpcjobs", tmp_path / "ours.pt", stand_in, *args)
    assert _rel(ours, theirs) <= 1e-4, _rel(ours, theirs)


def test_sync_batch_norm_trains_on_the_cpu(stand_in, tmp_path):
    """The synthetic benchmark's norm_layer=hvd.SyncBatchNorm: Horovod's
    refuses CPU tensors in training; ours runs (the script checks that the
    ranks' parameters agree)."""
    _script(2, "hpcjobs", tmp_path / "ours.pt", stand_in, "--sync-bn", "--steps", "2")
