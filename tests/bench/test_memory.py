"""A benchmark whose largest message cannot fit in its hosts' memory is
refused on every rank before anything runs; it used to run until the
out-of-memory killer ended a rank (``bench allreduce -e 100G`` here took 17
of 24 GiB at 1 GiB, on one rank). And a sweep lets each size's copies go
before the next size's are made."""

import tracemalloc

import pytest
from mpi4py import MPI

from hpcjobs.bench.inputs import VARIANTS
from hpcjobs.bench.memory import available_bytes, cgroup_room, check_fits
from fake_proc import fake_proc
from launch import hpcjobs
from launch import mpirun as _mpirun


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo, free = tmp_path / "meminfo", str(tmp_path / "no-cgroup")
    meminfo.write_text("MemTotal:       24683492 kB\nMemFree:        16000000 kB\nMemAvailable:   22000000 kB\n")
    assert available_bytes(str(meminfo), free) == 22000000 * 1024
    meminfo.write_text("MemTotal:       24683492 kB\n")  # a kernel before 3.14: cannot tell
    assert available_bytes(str(meminfo), free) is None
    assert available_bytes(str(tmp_path / "absent"), free) is None
    assert available_bytes() > 0  # this machine's


def _group(folder, limit_file, limit, usage_file, used, stat):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / limit_file).write_text(f"{limit}\n")
    (folder / usage_file).write_text(f"{used}\n")
    (folder / "memory.stat").write_text(stat)


def test_a_memory_cgroup_limit_is_what_a_job_may_take(tmp_path):
    """A Slurm job's --mem (or a container's limit) stops a rank long before
    the host's memory runs out: the tightest limit on the group and its
    ancestors, less what the group holds but its page cache, is the room."""
    gib = 1 << 30
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    _group(v2 / "slurm/job_7", "memory.max", 4 * gib, "memory.current", 3 * gib, f"anon 1\nfile {2 * gib}\n")
    _group(v2 / "slurm", "memory.max", "max", "memory.current", 5 * gib, "file 0\n")
    cg2 = fake_proc(tmp_path / "cg2", ["0::/slurm/job_7"], [("/", v2, "cgroup2", "nsdelegate")])
    assert cgroup_room(cg2) == 3 * gib  # 4 GiB less 1 GiB held, the 2 GiB cache not
    _group(v1 / "memory/slurm/job_7", "memory.limit_in_bytes", 9223372036854771712, "memory.usage_in_bytes", gib,
           "cache 0\ntotal_cache 0\n")
    _group(v1 / "memory/slurm", "memory.limit_in_bytes", 2 * gib, "memory.usage_in_bytes", gib // 2,
           f"total_cache {gib // 4}\n")
    v1_mounts = [("/", v1 / "memory", "cgroup", "memory"), ("/", v1 / "cpu", "cgroup", "cpu,cpuacct")]
    cg1 = fake_proc(tmp_path / "cg1", ["9:name=systemd:/", "4:memory:/slurm/job_7", "1:cpu,cpuacct:/"], v1_mounts)
    assert cgroup_room(cg1) == 2 * gib - gib // 4  # the parent's limit, not "none"
    cg0 = fake_proc(tmp_path / "cg0", ["0::/", "4:memory:/"], v1_mounts)  # no limit anywhere
    assert cgroup_room(cg0) is None
    (v1 / "memory/slurm/job_7/memory.use_hierarchy").write_text("0\n")  # the parent's limit does not bind it
    assert cgroup_room(cg1) is None
    # tmpfs and shared memory are in the page cache but cannot be reclaimed; a stat that cannot be read leaves
    # the limit itself, an upper bound on the room (never a refusal it did not earn)
    (v2 / "slurm/job_7/memory.stat").write_text(f"file {2 * gib}\nshmem {gib}\n")
    assert cgroup_room(cg2) == 2 * gib
    (v2 / "slurm/job_7/memory.stat").unlink()
    assert cgroup_room(cg2) == 4 * gib
    (v2 / "slurm/job_7/memory.stat").write_text(f"anon 1\nfile {2 * gib}\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {20 * gib // 1024} kB\n")
    assert available_bytes(str(meminfo), cg2) == 3 * gib


def test_a_memory_limit_is_read_where_its_hierarchy_is_mounted(tmp_path):
    """The hierarchies are found from the process's mountinfo, not at fixed
    places under /sys/fs/cgroup, which missed two common limits: a container
    without a cgroup namespace (Docker on cgroup v1) sees its own cgroup,
    /docker/abc, mounted as the root of /sys/fs/cgroup/memory, where
    /sys/fs/cgroup/memory/docker/abc does not exist; and a hybrid host
    (systemd's default before v2 alone) mounts v2 at /sys/fs/cgroup/unified,
    with a --mem limit there, beside v1's hierarchies. Each limit counts."""
    gib = 1 << 30
    inside = tmp_path / "container/memory"  # what the container sees at /sys/fs/cgroup/memory: its own cgroup
    _group(inside, "memory.limit_in_bytes", 3 * gib, "memory.usage_in_bytes", gib, "total_cache 0\n")
    docker = fake_proc(tmp_path / "docker", ["4:memory:/docker/abc", "0::/"],
                       [("/docker/abc", inside, "cgroup", "rw,memory")])
    assert cgroup_room(docker) == 2 * gib
    hybrid, unified = tmp_path / "hybrid/memory", tmp_path / "hybrid/unified"
    _group(hybrid / "user.slice", "memory.limit_in_bytes", 9223372036854771712, "memory.usage_in_bytes", gib,
           "total_cache 0\n")
    _group(unified / "user.slice/job", "memory.max", 5 * gib, "memory.current", gib, "file 0\n")
    both = fake_proc(tmp_path / "both", ["4:memory:/user.slice", "0::/user.slice/job"],
                     [("/", hybrid, "cgroup", "rw,memory"), ("/", unified, "cgroup2", "rw,nsdelegate")])
    assert cgroup_room(both) == 4 * gib
    spaced = tmp_path / "a dir/memory"  # mountinfo writes a space as \040
    _group(spaced, "memory.limit_in_bytes", gib, "memory.usage_in_bytes", 0, "total_cache 0\n")
    escaped = str(spaced).replace(" ", "\\040")
    assert cgroup_room(fake_proc(tmp_path / "sp", ["4:memory:/"], [("/", escaped, "cgroup", "rw,memory")])) == gib
    # a mount of another cgroup's subtree does not show this process's
    elsewhere = fake_proc(tmp_path / "else", ["4:memory:/slurm/job_8"], [("/docker/abc", inside, "cgroup", "memory")])
    assert cgroup_room(elsewhere) is None


def _ranks_here(comm):
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    n = local.Get_size()
    local.Free()
    return n


@pytest.mark.mpi(min_size=1)
def test_what_fits_passes_and_what_does_not_is_refused_on_every_rank():
    comm = MPI.COMM_WORLD
    here = _ranks_here(comm)
    check_fits(comm, 1 << 30, "--max-bytes 128M", available=here << 30)  # exactly full: fits
    with pytest.raises(ValueError) as e:
        check_fits(comm, (1 << 30) + 1, "--max-bytes 128M", available=here << 30)
    assert str(e.value).startswith("--max-bytes 128M does not fit in memory: ")
    assert f"{here} rank(s) here need about {here:.1f} GiB (1.0 GiB each), {here:.1f} GiB is available" in str(e.value)


@pytest.mark.mpi(min_size=2)
def test_one_host_short_of_memory_stops_every_rank_not_only_its_own():
    """Rank 0 alone is told its host is short (as one node of a job may be):
    every rank raises, and the message names which ranks fit."""
    comm = MPI.COMM_WORLD
    available = 0 if comm.Get_rank() == 0 else 1 << 40
    with pytest.raises(ValueError, match=r"does not fit in memory: rank 0: .*; ranks? 1.*: fits; lower it"):
        check_fits(comm, 1 << 20, "--elements 262,144", available=available)


def _peak_bytes(sizes):
    from hpcjobs.bench import sweep

    comm = MPI.COMM_SELF.Dup()
    tracemalloc.start()
    try:
        sweep.run(comm, sizes, sweep.implementations(["ring"]), iters=1, warmup=0)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        comm.Free()


def test_a_sweep_frees_each_sizes_copies_before_the_next_sizes():
    """Numpy's arrays are traced: a 4 MiB size then an 8 MiB one peak where
    the 8 MiB size alone does, at 7 copies of it (buffer, 3 inputs, 3
    results). The last size's buffer, inputs and expected results (7 x 4 MiB)
    stayed alive while the next were made, and the inputs were tiled in int64
    before they were typed (8 bytes an element more, for a moment)."""
    alone, after = _peak_bytes([8 << 20]), _peak_bytes([4 << 20, 8 << 20])
    assert (1 + 2 * VARIANTS) * (8 << 20) <= alone < (1 + 2 * VARIANTS + 1) * (8 << 20)  # no transient 8 B/element
    assert after - alone < (4 << 20) // 2, (alone, after)


def test_a_sweep_larger_than_memory_is_refused_at_once_on_every_rank():
    out = _mpirun(2, "bench", "allreduce", "-b", "512G", "-e", "512G")
    assert out.returncode == 2, out.stderr
    assert ("hpcjobs bench allreduce: error: --max-bytes 512G (a sweep holds about 8x its largest message, 512G, "
            "on each rank") in out.stderr
    assert "does not fit in memory: ranks 0,1: 2 rank(s) here need about 8192.0 GiB (4096.0 GiB each)" in out.stderr


def test_bench_compression_refuses_counts_that_are_not_finite_or_do_not_fit():
    for count in ("inf", "1e400"):  # int(inf) raised OverflowError, which argparse let through as a traceback
        out = hpcjobs("bench", "compression", "--elements", count)
        assert out.returncode == 2 and f"counts must be finite and >= 1, got '{count}'" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    out = hpcjobs("bench", "compression", "--elements", "1e20")
    assert out.returncode == 2 and "--elements 100,000,000,000,000,000,000 does not fit in memory" in out.stderr


def test_soak_refuses_a_count_that_does_not_fit():
    out = hpcjobs("soak", "--max-count", str(10 ** 15))
    assert out.returncode == 2, out.stderr
    assert "--max-count 1,000,000,000,000,000 does not fit in memory: rank 0: 1 rank(s) here need about" in out.stderr
