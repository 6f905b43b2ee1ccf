"""hpcjobs.runtime's settings of a training process."""

import subprocess
import sys

from launch import clean_env

_SCRIPT = """
import torch
from mpi4py import MPI
from hpcjobs.runtime import set_threads
tiny = lambda: float(torch.tensor([1e-30], dtype=torch.float32) * 1e-10)  # 1e-40: a float32 denormal
before = tiny()
print(before, set_threads(1, MPI.COMM_SELF), tiny(), torch.get_num_threads())
"""


def test_set_threads_flushes_denormals_and_sets_the_threads():
    """A model whose weights decay towards zero computes with denormals, each
    many times slower on the CPU than a normal float: set_threads, which every
    CPU training command calls, flushes them to zero (and gives torch its
    threads). In a subprocess: the setting is the process's."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, threads, after, torch_threads = out.stdout.split()
    assert 0 < float(before) < 1.2e-38  # not flushed until set_threads: the test can tell
    assert float(after) == 0.0
    assert int(threads) == int(torch_threads) == 1
