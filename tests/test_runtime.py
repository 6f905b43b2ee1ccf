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
threads = set_threads(2, MPI.COMM_SELF)
many = torch.full((4_000_000,), 1e-30) * 1e-10  # large enough for torch's threads to share it
print(before, threads, tiny(), torch.get_num_threads(), int((many != 0).sum()))
"""


def test_set_threads_flushes_denormals_and_sets_the_threads():
    """A model that has stopped learning can compute with denormals, each
    many times slower on the CPU than a normal float: set_threads, which every
    CPU training command calls, flushes them to zero (and gives torch its
    threads). In a subprocess: the setting is the process's."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, threads, after, torch_threads, nonzero = out.stdout.split()
    assert 0 < float(before) < 1.2e-38  # not flushed until set_threads: the test can tell
    assert float(after) == 0.0
    assert int(nonzero) == 0  # on every thread of torch's, not only this one
    assert int(threads) == int(torch_threads) == 2
