"""hpcjobs/_reaper.py as a guardian, with real processes: a stand-in
launcher named ``prterun`` (its comm set with prctl, which is what the
guardian reads), a stand-in rank (a sleep), and the guardian reading the
rank's pipe. The watchdog's wiring (the guardian started in a launch across
hosts, its clean word at exit) runs in tests/cluster."""

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REAPER = Path(__file__).resolve().parents[1] / "hpcjobs" / "_reaper.py"
LAUNCHER = (
    "import ctypes, sys, time\n"
    "ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n"  # PR_SET_NAME: /proc/PID/comm
    "print('ready', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


@pytest.fixture
def launch(tmp_path):
    started = []

    def start(name="prterun", lives=120):
        err = open(tmp_path / f"{name}.err", "w+")
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, name, str(lives)], stdout=subprocess.PIPE,
                                stderr=err, text=True)
        assert proc.stdout.readline() == "ready\n"
        rank = subprocess.Popen(["sleep", "120"])
        guardian = subprocess.Popen([sys.executable, "-I", "-S", str(REAPER), str(rank.pid), str(proc.pid), "3",
                                     "eof", "1"], stdin=subprocess.PIPE)
        started.extend([proc, rank, guardian])
        proc.err = err
        return proc, rank, guardian

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_rank_gone_without_a_word_gets_the_stuck_launcher_killed(launch):
    launcher, rank, guardian = launch()
    guardian.stdin.close()  # the rank's end: killed, or aborted in C
    assert guardian.wait(timeout=60) == 0
    assert launcher.wait(timeout=10) == -signal.SIGKILL
    assert rank.wait(timeout=10) == -signal.SIGKILL  # the guardian ends what is left of the rank too
    launcher.err.seek(0)
    said = launcher.err.read()
    assert said.startswith(f"hpcjobs: a rank (pid {rank.pid}) on {os.uname().nodename} ended without MPI_Finalize")
    assert f"prterun (pid {launcher.pid}) had not ended the job 1 s later" in said


def test_a_clean_end_stands_the_guardian_down(launch):
    launcher, rank, guardian = launch()
    guardian.stdin.write(b"clean\n")
    guardian.stdin.close()
    assert guardian.wait(timeout=60) == 0
    time.sleep(1.5)  # past the unclean grace: nothing is killed
    assert launcher.poll() is None and rank.poll() is None


def test_a_launcher_that_ends_the_job_in_time_is_left_alone(launch):
    launcher, rank, guardian = launch(lives=0)  # exits at once: the job ended as Open MPI ends it
    assert launcher.wait(timeout=30) == 0
    guardian.stdin.close()
    assert guardian.wait(timeout=60) == 0
    assert rank.poll() is None  # not the guardian's to kill once the launcher is gone


def test_the_watchdogs_headline_is_relayed_with_the_shorter_grace(launch):
    launcher, rank, guardian = launch()
    guardian.stdin.write(b"hpcjobs: rank 0: ring_allreduce (call #3) did not complete within 5 s; ranks not in "
                         b"ring_allreduce: 2; aborting the job\n")
    guardian.stdin.close()
    assert guardian.wait(timeout=60) == 0
    assert launcher.wait(timeout=10) == -signal.SIGKILL
    launcher.err.seek(0)
    said = launcher.err.read().splitlines()
    assert said[0].endswith("ranks not in ring_allreduce: 2; aborting the job")
    assert said[1].startswith(f"hpcjobs: prterun (pid {launcher.pid}) on ")
    assert "had not ended the job 3 s after MPI_Abort" in said[1]


def test_only_open_mpis_launchers_are_guarded(launch):
    launcher, rank, guardian = launch(name="slurmstepd")
    assert guardian.wait(timeout=60) == 0  # at once, without waiting for the rank
    assert launcher.poll() is None and rank.poll() is None
