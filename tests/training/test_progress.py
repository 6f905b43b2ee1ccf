"""The progress bar: on rank 0's terminal, in every mode that steps on its
own (sync, local, easgd, hogwild), and nothing with --no-progress."""

import os
import pty
import subprocess
import sys
import threading

import pytest

from launch import clean_env

ARGS = ["train", "--dataset", "synthetic", "--num-samples", "2048", "--width", "16", "-b", "16", "--epochs", "2",
        "--seed", "1"]


def on_a_terminal(*extra):
    """``hpcjobs train`` (one rank, an MPI singleton) with stderr on a
    pseudo-terminal; (exit status, stdout, what reached the terminal)."""
    leader, follower = pty.openpty()
    got = bytearray()

    def drain():  # read as it comes: a full terminal buffer would stop the run
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # EIO: the run closed its end
                return
            if not data:
                return
            got.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "hpcjobs", *ARGS, *extra], stdout=subprocess.PIPE,
                              stderr=follower, text=True, timeout=120, env=clean_env())
    finally:
        os.close(follower)  # the run's end and ours: the reader gets EIO once it has read everything
        reader.join(30)
        done = not reader.is_alive()
        os.close(leader)
    assert done, "the terminal was still open 30 s after the run ended"
    return proc.returncode, proc.stdout, got.decode(errors="replace")


@pytest.mark.parametrize("mode", ["sync", "local", "easgd", "hogwild"])
def test_rank_0_draws_the_bar_on_a_terminal_in_every_stepping_mode(mode):
    extra = ["--mode", mode] + (["--local-steps", "4"] if mode in ("local", "easgd") else [])
    code, out, tty = on_a_terminal(*extra)
    assert code == 0, tty
    steps = 2048 * 4 // 5 // 16  # the training split, 16 samples a step
    assert "epoch 1/2 [" in tty and f"epoch 2/2 [{'#' * 30}] {steps}/{steps} loss " in tty, tty
    assert "epoch 1/2 [" not in out  # the bar is the terminal's, the epochs' lines stdout's
    if mode == "local":  # the same flag in every mode
        code, out, tty = on_a_terminal(*extra, "--no-progress")
        assert code == 0 and "epoch 1/2 [" not in tty, tty
