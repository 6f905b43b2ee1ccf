"""hpcjobs.runtime's settings of a training process."""

import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from hpcjobs import runtime
from fake_proc import fake_proc
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


def test_cpu_limit_reads_the_smallest_quota_of_the_cgroup_and_its_parents_in_either_hierarchy(tmp_path):
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for folder, quota in ((v1, "-1"), (v1 / "docker", "300000"), (v1 / "docker" / "abc", "150000")):
        folder.mkdir()
        (folder / "cpu.cfs_quota_us").write_text(quota + "\n")
        (folder / "cpu.cfs_period_us").write_text("100000\n")
    for folder, limit in ((v2, None), (v2 / "a", "200000 100000"), (v2 / "a" / "b", "max 100000")):
        folder.mkdir()
        if limit:
            (folder / "cpu.max").write_text(limit + "\n")
    v1_only = fake_proc(tmp_path / "1", ["4:cpu,cpuacct:/docker/abc", "0::/"],
                         [("/", str(v1), "cgroup", "cpu,cpuacct")])
    key, cpus = runtime.cpu_limit(v1_only)
    assert cpus == 1.5 and key[1] == os.stat(v1 / "docker" / "abc").st_ino
    v2_only = fake_proc(tmp_path / "2", ["0::/a/b"], [("/", str(v2), "cgroup2", "nsdelegate")])
    key, cpus = runtime.cpu_limit(v2_only)
    assert cpus == 2.0 and key[1] == os.stat(v2 / "a").st_ino  # b is unlimited: its parent's limit holds
    # in a container that mounts only its own cgroup: the mount's root is that cgroup
    inside = fake_proc(tmp_path / "3", ["4:cpu,cpuacct:/docker/abc"], [("/docker/abc", str(v1 / "docker" / "abc"),
                                                                         "cgroup", "cpu,cpuacct")])
    assert runtime.cpu_limit(inside)[1] == 1.5
    unlimited = fake_proc(tmp_path / "4", ["4:cpu,cpuacct:/", "0::/"], [("/", str(v1), "cgroup", "cpu,cpuacct")])
    assert runtime.cpu_limit(unlimited) is None
    assert runtime.cpu_limit(str(tmp_path / "nowhere")) is None


_LIMITED = """
from mpi4py import MPI
from hpcjobs.runtime import cores_per_rank, set_threads
print(cores_per_rank(MPI.COMM_SELF), set_threads(None, None))
"""


def test_a_cgroups_cpu_limit_caps_the_threads_a_process_takes(tmp_path):
    """A container's --cpus is a CFS quota its affinity does not show: with
    every CPU in its affinity and a quota of one, a process took a thread
    per CPU, throttled to one CPU's time. A real cgroup (v1's cpu
    controller, as root), the process started inside it."""
    cpu = "/sys/fs/cgroup/cpu"
    if len(os.sched_getaffinity(0)) < 2 or not os.access(cpu, os.W_OK) or \
            not os.path.exists(f"{cpu}/cpu.cfs_quota_us"):
        pytest.skip("needs 2 CPUs and a writable cgroup v1 cpu controller (root)")
    group = f"{cpu}/hpcjobs-test-{os.getpid()}"
    os.mkdir(group)
    try:
        with open(f"{group}/cpu.cfs_period_us", "w") as f:
            f.write("100000")
        with open(f"{group}/cpu.cfs_quota_us", "w") as f:
            f.write("100000")  # one CPU
        out = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"', sys.executable,
                              _LIMITED], env=clean_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1", "1"]
        free = subprocess.run([sys.executable, "-c", _LIMITED], env=clean_env(), capture_output=True, text=True,
                              timeout=120)
        assert free.stdout.split() == [str(len(os.sched_getaffinity(0)))] * 2, free.stderr  # the test can tell
    finally:
        os.rmdir(group)
