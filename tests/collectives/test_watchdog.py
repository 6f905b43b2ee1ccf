"""Hangs become timeouts, a dead or failing rank ends the job: real mpirun,
one rank misbehaving, the job must end non-zero in bounded time."""

import re
import subprocess
import sys
import textwrap
import time

import pytest
from launch import clean_env, hpcjobs, mpirun_script

TIMEOUT = 3  # seconds, the collective timeout these jobs run with
SLACK = 20   # the bar: every rank gone within timeout + 20 s (0.8-7.4 s seen; CI's 2 cores run other jobs too)


# Each script calls ready() once every rank is running. The bar is timed from
# there, not from mpirun's start: how long Python ranks take to start (1-2 s
# here, more on a loaded machine) is not the watchdog's doing.
READY = """
def ready():
    import time
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        print("ready at", repr(time.time()), flush=True)
"""


def _run(script, n=3, timeout=TIMEOUT, env=None):
    out = mpirun_script(n, READY + textwrap.dedent(script), timeout=120,
                        env={"HPCJOBS_TIMEOUT": str(timeout), "HPCJOBS_STALL_WARNING": "1"} | (env or {}))
    end = time.time()
    started = re.search(r"^ready at (\S+)$", out.stdout, re.M)
    assert started, f"the ranks never all started:\n{out.stdout}\n{out.stderr}"
    return out, end - float(started.group(1))


def test_a_rank_that_never_arrives_ends_the_job_after_the_timeout():
    out, elapsed = _run("""
        import time
        import numpy as np
        from mpi4py import MPI
        from hpcjobs.collectives import allreduce
        x = np.ones(1000)
        ready()
        allreduce(x)                      # everyone, once
        if MPI.COMM_WORLD.rank == 2:
            time.sleep(600)               # rank 2 never comes to the second
        allreduce(x)
    """)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed
    assert "did not complete within 3 s" in out.stderr and "aborting the job" in out.stderr
    assert "warning: rank 0 has waited" in out.stderr or "warning: rank 1 has waited" in out.stderr
    # The report names the rank that never arrived and where each rank is.
    assert "ranks not in allreduce_auto: 2;" in out.stderr
    assert re.search(r"rank 0: waiting \d+ s in allreduce_auto \(call #2\)", out.stderr)
    assert "rank 2: in no hpcjobs collective; the last it entered was allreduce_auto (call #1)" in out.stderr
    assert "rank 2: allreduce" not in out.stderr  # the missing rank itself never timed out


def test_a_rank_in_another_collective_or_holding_the_gil_is_named():
    out, elapsed = _run("""
        import ctypes
        import numpy as np
        from mpi4py import MPI
        from hpcjobs.collectives import allreduce
        x = np.ones(1000)
        ready()
        allreduce(x, algorithm="tree")
        if MPI.COMM_WORLD.rank == 1:
            ctypes.PyDLL(None).sleep(60)   # C code that keeps the GIL: its watchdog cannot answer
        if MPI.COMM_WORLD.rank == 3:
            allreduce(x, algorithm="recursive_doubling")  # control flow differs: a different collective
        else:
            allreduce(x, algorithm="ring")
    """, n=4)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed
    # Whichever rank times out first reports; all four ranks are accounted for.
    assert re.search(r"did not complete within 3 s; ranks not in "
                     r"(ring_allreduce: 1, 3|recursive_doubling_allreduce: 0, 1, 2);", out.stderr)
    assert "rank 1: no answer within 3 s (dead, exiting, or stuck in code that holds the GIL)" in out.stderr
    assert re.search(r"rank 3: waiting \d+ s in recursive_doubling_allreduce \(call #2\)", out.stderr)
    assert re.search(r"rank 2: waiting \d+ s in ring_allreduce \(call #2\)", out.stderr)



def test_on_a_communicator_of_some_ranks_the_others_are_not_called_missing():
    """Ranks 0 and 1 reduce on a communicator of their own, and rank 1 never
    comes; ranks 2 and 3, which wait after theirs, are outside it: the report names
    rank 1 alone as missing (it named 1, 2, 3) and marks 2 and 3 as outside."""
    out, elapsed = _run("""
        import time
        import numpy as np
        from mpi4py import MPI
        from hpcjobs.collectives import allreduce
        world = MPI.COMM_WORLD
        pair = world.Split(world.rank // 2)
        x = np.ones(1000)
        ready()
        allreduce(x, algorithm="ring")    # the first on COMM_WORLD attaches the watchdog's queries
        allreduce(x, algorithm="ring", comm=pair)
        if world.rank != 0:
            time.sleep(600)               # rank 1 never comes to its second; 2 and 3 wait outside the pair
        allreduce(x, algorithm="ring", comm=pair)
    """, n=4)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed
    assert re.search(r"rank 0: ring_allreduce \(call #\d+\) did not complete within 3 s \(its communicator: ranks 0, "
                     r"1\); ranks not in ring_allreduce: 1; aborting the job", out.stderr), out.stderr[-3000:]
    assert re.search(r"rank 0: waiting \d+ s in ring_allreduce \(call #\d+\)\n", out.stderr)
    for r in (2, 3):
        assert re.search(rf"rank {r}: in no hpcjobs collective; the last it entered was ring_allreduce \(call #\d+\) "
                         r"\(outside the communicator\)", out.stderr), out.stderr[-3000:]


def test_ranks_deadlocked_across_communicators_are_named():
    """The classic cross-group deadlock: three pairs, each rank waiting in
    the same collective on another pair than its partner. Every rank was
    "waiting in ring_allreduce", so the report named none missing; the
    partner, waiting in it on another communicator, is named now, with
    that communicator's ranks."""
    out, elapsed = _run("""
        import numpy as np
        from mpi4py import MPI
        from hpcjobs.collectives import allreduce
        world = MPI.COMM_WORLD
        pairs = {p: world.Split(0 if world.rank in p else MPI.UNDEFINED) for p in ((0, 1), (1, 2), (0, 2))}
        x = np.ones(1000)
        ready()
        allreduce(x, algorithm="ring")    # the first on COMM_WORLD attaches the watchdog's queries
        first, then = {0: ((0, 1), (0, 2)), 1: ((1, 2), (0, 1)), 2: ((0, 2), (1, 2))}[world.rank]
        allreduce(x, algorithm="ring", comm=pairs[first])  # 0 waits for 1, 1 for 2, 2 for 0
        allreduce(x, algorithm="ring", comm=pairs[then])
    """)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed
    head = re.search(r"rank (\d): ring_allreduce \(call #\d+\) did not complete within 3 s \(its communicator: "
                     r"ranks (\d), (\d)\); ranks not in ring_allreduce: (\d); aborting the job", out.stderr)
    assert head, out.stderr[-3000:]
    me, pair, missing = int(head[1]), {int(head[2]), int(head[3])}, int(head[4])
    assert pair == {me, (me + 1) % 3} and missing == (me + 1) % 3, out.stderr[-3000:]
    waits_on = sorted({missing, (missing + 1) % 3})
    assert re.search(rf"rank {missing}: waiting \d+ s in ring_allreduce \(call #\d+\) on ranks "
                     rf"{waits_on[0]}, {waits_on[1]}\n", out.stderr), out.stderr[-3000:]


def test_a_rank_killed_mid_allreduce_ends_the_job():
    out, elapsed = _run("""
        import os, signal, threading
        import numpy as np
        from mpi4py import MPI
        from hpcjobs.collectives import allreduce
        x = np.ones(4 << 20, dtype=np.float32)
        ready()
        if MPI.COMM_WORLD.rank == 1:
            threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        for _ in range(100000):
            allreduce(x, op="avg", algorithm="ring")
    """)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed


def test_an_exception_on_one_rank_aborts_the_training_job():
    out, elapsed = _run("""
        from mpi4py import MPI
        from hpcjobs.training.loop import TrainConfig, train
        def fail(record):
            if MPI.COMM_WORLD.rank == 1:
                raise RuntimeError("injected failure on rank 1")
        ready()
        train(TrainConfig(dataset="synthetic", num_samples=512, epochs=5, quiet=True, progress=False), on_epoch=fail)
    """, n=2)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK + 20, elapsed  # + one epoch
    assert "injected failure on rank 1" in out.stderr and "rank 1 failed in training; aborting" in out.stderr


def test_a_rank_stalled_in_its_share_of_the_tests_ends_the_training_job():
    """The epoch's end (the test set's sums, the metrics, BatchNorm's statistics, the signals) used MPI directly,
    unwatched: a rank stalled in its test shard (a hung read) left the others there for good."""
    out, elapsed = _run("""
        import time
        from mpi4py import MPI
        import hpcjobs.training.stepping as stepping
        from hpcjobs.training.loop import TrainConfig, train
        if MPI.COMM_WORLD.rank == 1:
            stepping.evaluate_local = lambda *args, **kwargs: time.sleep(600)
        ready()
        train(TrainConfig(model="mlp", width=16, dataset="synthetic", num_samples=400, epochs=2, quiet=True,
                          progress=False))
    """, n=2)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed
    assert re.search(r"rank 0: evaluate \(call #\d+\) did not complete within 3 s", out.stderr), out.stderr[-3000:]
    assert "ranks not in evaluate: 1;" in out.stderr


def test_a_watchdog_whose_stderr_cannot_be_written_still_ends_the_job():
    """Its warning's print raised, which ended the watchdog's thread: no timeout came, ever."""
    out, elapsed = _run("""
        import sys, time
        import numpy as np
        from mpi4py import MPI
        from hpcjobs.collectives import allreduce
        x = np.ones(1000)
        allreduce(x)                      # attaches the watchdog
        ready()
        if MPI.COMM_WORLD.rank == 1:
            time.sleep(600)
        sys.stderr = open("/dev/full", "w")  # every write fails: no space left on device
        allreduce(x)
    """, n=2)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed


def test_a_rank_that_leaves_a_torch_distributed_script_ends_the_job():
    """The torch.distributed backend's calls, their agreement check included,
    are watched like our collectives: a rank that leaves before DDP's first
    collective (here by an exception, which does not end an MPI job) must
    not leave the others blocked in MPI."""
    out, elapsed = _run("""
        import torch
        import torch.distributed as dist
        from mpi4py import MPI
        import hpcjobs.torch_backend  # noqa: F401
        dist.init_process_group("hpcjobs")
        ready()
        if MPI.COMM_WORLD.rank == 1:
            raise RuntimeError("rank 1 leaves")
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    """, n=2)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed
    assert "rank 0: torch.distributed allgather (hpcjobs backend) (call #1) did not complete within 3 s" \
        in out.stderr, out.stderr[-3000:]
    assert "ranks not in torch.distributed allgather (hpcjobs backend): 1;" in out.stderr


@pytest.mark.parametrize("args,words", [(["--timeout", "-1", "info"], "must be >= 0"),
                                        (["--timeout", "soon", "info"], "not a number")])
def test_a_bad_timeout_is_a_usage_error(args, words):
    out = hpcjobs(*args)
    assert out.returncode == 2 and words in out.stderr


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "-inf"])
def test_a_time_that_never_comes_or_has_passed_is_refused(monkeypatch, text):
    """--timeout refused nan and inf, HPCJOBS_TIMEOUT took them (0 is never);
    HPCJOBS_STALL_WARNING=nan never warned."""
    from hpcjobs.collectives.watchdog import env_number

    monkeypatch.setenv("HPCJOBS_STALL_WARNING", text)
    with pytest.raises(ValueError, match=f"HPCJOBS_STALL_WARNING must be >= 0 seconds, got {text}"):
        env_number("HPCJOBS_STALL_WARNING", 60.0)
    monkeypatch.setenv("HPCJOBS_STALL_WARNING", "0")
    assert env_number("HPCJOBS_STALL_WARNING", 60.0) == 0.0


@pytest.mark.parametrize("env,args,want", [
    ({"HPCJOBS_TIMEOUT": "30"}, None, (30.0, 15.0)),            # below 2 minutes: the warning at half
    ({"HPCJOBS_TIMEOUT": "600"}, None, (600.0, 60.0)),
    ({"HPCJOBS_TIMEOUT": "30", "HPCJOBS_STALL_WARNING": "5"}, None, (30.0, 5.0)),
    ({"HPCJOBS_STALL_WARNING": "5"}, 20, (20.0, 5.0)),          # --timeout keeps the variable's warning
    ({}, 20, (20.0, 10.0)),
])
def test_the_warning_comes_before_the_abort(env, args, want):
    """A warning first, then the abort: with a timeout under 2 minutes the
    default warning (60 s) came after it or never."""
    script = ("from hpcjobs.collectives import watchdog as w\n"
              + (f"w.set_timeout({args})\n" if args is not None else "")
              + "print(w._timeout, w._warning)")
    base = {k: v for k, v in clean_env().items() if k not in ("HPCJOBS_TIMEOUT", "HPCJOBS_STALL_WARNING")}
    out = subprocess.run([sys.executable, "-c", script], env=base | env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert tuple(map(float, out.stdout.split())) == want


def test_a_rank_that_never_frees_a_symmetric_buffer_is_a_timeout():
    """symmetric_free is collective: a rank whose buffer it refuses frees
    nothing, and the others waited in MPI_Win_free with no watchdog (a
    review, 2026-12-01); now they time out naming it."""
    out, elapsed = _run("""
        import time
        from mpi4py import MPI
        from hpcjobs.collectives import symmetric_empty, symmetric_free
        buf = symmetric_empty(1000)
        ready()
        try:
            symmetric_free(buf.copy() if MPI.COMM_WORLD.rank == 1 else buf)
        except ValueError:
            time.sleep(600)
    """)
    assert out.returncode != 0
    assert elapsed < TIMEOUT + SLACK, elapsed
    assert "did not complete within 3 s" in out.stderr and "ranks not in symmetric_free: 1;" in out.stderr
