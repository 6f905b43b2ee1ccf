"""hpcjobs.runtime's settings of a training process."""

import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from hpcjobs import runtime
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


_ALONE = """
import os, torch
from hpcjobs.runtime import set_threads
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
print(set_threads(None, None), torch.get_num_threads(), float(torch.tensor([1e-30]) * 1e-10))
"""


def test_set_threads_alone_takes_the_process_cores_and_flushes():
    """``plan --measure`` runs alone, without a communicator: its default is
    the cores it may run on (here pinned to one, where torch alone would
    start as many threads as the machine has), and denormals are flushed as
    in training, so the step it times is the step train runs."""
    out = subprocess.run([sys.executable, "-c", _ALONE], env=clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    threads, torch_threads, tiny = out.stdout.split()
    assert int(threads) == int(torch_threads) == 1
    assert float(tiny) == 0.0


@pytest.mark.parametrize("mine,together,want", [
    ({0, 1}, [{0, 1}, {0, 1}, set(range(2, 8))], 1),   # two ranks on cores 0-1, one bound to the other 6
    (set(range(2, 8)), [{0, 1}, {0, 1}, set(range(2, 8))], 6),
    (set(range(8)), [set(range(8))] * 3, 2),           # unbound: 8/3, rounded down
    (set(range(8)), [set(range(8)), {0}, {1}], 7),      # 6 cores alone, 2 halves
    ({0}, [{0}] * 4, 1),                                # at least one
    ({3}, [{0}, {1}, {2}, {3}], 1),                    # bound one to a core: that core
])
def test_cpu_share_divides_each_cpu_among_the_ranks_allowed_on_it(mine, together, want):
    assert runtime.cpu_share(mine, together) == want


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("machine_by", ["boot id", "shared-memory node"])
def test_cores_per_rank_divides_the_machines_cpus_among_its_ranks(monkeypatch, machine_by):
    """The ranks of one machine share the CPUs they may run on (their
    affinities together), none getting more than its own: unbound ranks
    divide the job's CPUs, ranks pinned to one core get 1. The same where the
    kernel's boot id cannot be read and MPI's shared-memory node stands for
    the machine. (Across emulated hosts, which share one kernel:
    tests/cluster/test_across_hosts.py.)"""
    comm = MPI.COMM_WORLD
    if machine_by != "boot id":
        monkeypatch.setattr(runtime, "_kernel_id", lambda: None)
    saved = os.sched_getaffinity(0)
    every = sorted(set().union(*comm.allgather(sorted(saved))))
    try:
        os.sched_setaffinity(0, every)
        spread = runtime.cores_per_rank(comm)
        os.sched_setaffinity(0, every[:1])
        pinned = runtime.cores_per_rank(comm)
    finally:
        os.sched_setaffinity(0, saved)
    assert spread == max(1, len(every) // comm.Get_size())
    assert pinned == 1
