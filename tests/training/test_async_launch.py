"""``hpcjobs train --mode async`` launched as a user launches it: 10,000
pushes with none lost, a worker killed mid-run (the run completes and names
it), a server killed (every worker exits non-zero, saying why)."""

import json
import re
import subprocess
import time

import pytest

from launch import _mpirun_prefix, launch_env, run

SMALL = ["--model", "mlp", "--width", "4", "--num-samples", "1000", "--lr", "0.02", "--warmup", "none",
         "--no-progress"]


def _train(n, *args, fault=None, hold=None, slow_test=None, slow_checkpoint=None, timeout=120):
    exe, *rest = _mpirun_prefix(n)
    variables = {name: value for name, value in (("HPCJOBS_FAULT_KILL", fault), ("HPCJOBS_FAULT_HOLD", hold),
                                                 ("HPCJOBS_FAULT_SLOW_TEST", slow_test),
                                                 ("HPCJOBS_FAULT_SLOW_CHECKPOINT", slow_checkpoint)) if value}
    extra = ["--enable-recovery"] if fault else []
    for name in variables:
        extra += ["-x", name]
    with launch_env(variables or None) as env:
        t0 = time.monotonic()
        try:
            out = run([exe, *extra, *rest, "-m", "hpcjobs", "train", "--mode", "async", *args], timeout, env)
        except subprocess.TimeoutExpired as e:  # say where it stood
            pytest.fail(f"no end within {timeout} s; stdout:\n{(e.stdout or '')[-3000:]}\nstderr:\n"
                        f"{(e.stderr or '')[-3000:]}")
        return out, time.monotonic() - t0


def test_a_checkpoint_written_for_longer_than_the_peer_timeout_loses_no_rank(tmp_path):
    """Server 0 writes each epoch's checkpoint for 15 s (a slow file
    system), two and a half times --peer-timeout, while the workers wait
    for its go-on and server 1 for its word: it sends its heartbeats
    meanwhile, so none presumes it dead, it takes none of the paused workers
    for lost, and the run completes. Before, every other rank gave server 0
    up after the timeout and exited 3."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "c.pt"
    out, _ = _train(4, *SMALL, "--servers", "2", "--epochs", "2", "--peer-timeout", "6", "--metrics",
                    str(metrics), "--checkpoint", str(ckpt), slow_checkpoint="15")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("hpcjobs: fault: the checkpoint's write held 15 s") == 2, out.stderr[-3000:]
    assert "presumed lost" not in out.stderr + out.stdout and " lost (silent" not in out.stdout, out.stdout[-3000:]
    found = re.search(r"(\d+) pushes applied, (\d+) reported pushed", out.stdout)
    assert found and found[1] == found[2], out.stdout[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and not any(r.get("lost_workers") for r in records), records
    assert ckpt.exists()


def test_ten_thousand_pushes_and_none_is_lost(tmp_path):
    # 4,000 training samples / 4 per push x 10 epochs = 10,000 pushes from 2 workers
    metrics = tmp_path / "m.jsonl"
    out, _ = _train(3, *SMALL, "--num-samples", "5000", "-b", "4", "--epochs", "10", "--metrics", str(metrics))
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(metrics.read_text().splitlines()[-1])
    found = re.search(r"(\d+) pushes applied, (\d+) reported pushed by the workers that finished, largest "
                      r"difference (\S+);", out.stdout)
    assert found, out.stdout[-2000:]
    # the run's 10,000 and the one the other worker had in flight at the stop, if it had one
    assert last["epoch"] == 10 and 10000 <= last["step"] == int(found[1]) <= 10001
    # every gradient applied once: the float64 sums differ only by the order they were added in
    assert found[1] == found[2] and float(found[3]) < 1e-9


@pytest.mark.parametrize("width", ["4", "256"])
def test_a_killed_worker_is_named_and_the_run_completes_without_it(tmp_path, width):
    # Unbounded, the other two can push all 72 before a descheduled rank 2 reaches its 20th (CI saw it: the
    # run takes 0.1 s). A bound of 2 holds them to at most 3 pushes ahead of it until it is declared lost, so
    # it dies at its 20th with at most 19 + 2 x 22 = 63 < 72 applied: the kill always comes before the end.
    # 6 s of silence, not less: a live rank descheduled that long on a loaded 2-core machine would be lost too.
    # Width 256: 78,858 parameters, pushes of 315 KB, past the eager limit, so the dead worker's last push
    # can hold the server in a receive whose data never comes; it must go on heartbeating the others.
    metrics = tmp_path / "m.jsonl"
    out, _ = _train(4, *SMALL, "--width", width, "--epochs", "3", "--staleness-bound", "2", "--peer-timeout", "6",
                    "--metrics", str(metrics), fault="2:20")
    assert out.returncode == 0, out.stderr[-3000:]
    # killed after its 20th push was sent: that one may not have arrived
    assert re.search(r"worker rank 2 lost \(silent for 6 s after (19|20) pushes\); going on with the others",
                     out.stdout), out.stdout[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["lost_workers"] == "2" and records[-1]["workers"] == 2
    # 3 epochs of 800 samples / (3 x 32) x 3 pushes: the two others made up what the lost one did not push
    # (and at most one each was in flight at the stop)
    assert 3 * 24 <= sum(r["pushes"] for r in records) <= 3 * 24 + 2
    assert [r["epoch"] for r in records] == [1, 2, 3]


def test_a_run_whose_workers_are_lost_at_an_epochs_end_has_the_audit_in_its_metrics(tmp_path):
    """The only worker dies at its 25th push, the end of epoch 1, whose line
    is written then; the run ends with no pushes after it. The audit was
    printed but missing from --metrics, whose last line now carries it."""
    metrics = tmp_path / "m.jsonl"
    out, _ = _train(2, *SMALL, "--epochs", "2", "--peer-timeout", "2", "--metrics", str(metrics), fault="1:25")
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.search(r"worker rank 1 lost \(silent for 2 s after (24|25) pushes\)", out.stdout)
    assert found, out.stdout[-2000:]
    # the kill comes right after the 25th push's Isend: it arrived in every run here (shared memory takes it in
    # the call), which ends at the epoch's end; had it not, 24 pushes end a partial epoch, whose line is new
    applied = int(found[1])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == ([1] if applied == 25 else [0.96]) and records[-1]["step"] == applied
    assert {k: records[-1].get(k) for k in ("pushes_applied", "pushes_reported", "audit_max_diff",
                                             "pushes_by_worker", "lost_workers")} == {
        "pushes_applied": applied, "pushes_reported": 0, "audit_max_diff": None, "pushes_by_worker": [applied],
        "lost_workers": "1"}


def test_checkpoints_go_on_without_a_lost_worker_and_a_resumed_run_audits_it(tmp_path):
    """With --checkpoint the workers pause at each epoch's end: one killed at its 5th push must not hold the
    others' pause for good (it is lost after 6 s, and the checkpoint written without it). Resumed for a third
    epoch with every worker alive, every worker goes on from the live workers' count, the lost one too (from
    its own, 5, a staleness bound held the others at their next pause for good); the audit counts each
    worker's pushes since the resume (against the counts of the whole run it failed: 'lost update')."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "c.pt"
    common = [*SMALL, "--staleness-bound", "2", "--peer-timeout", "6", "--metrics", str(metrics), "--checkpoint",
              str(ckpt)]
    out, _ = _train(4, *common, "--epochs", "2", fault="2:5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"worker rank 2 lost \(silent for 6 s after [45] pushes\)", out.stdout), out.stdout[-2000:]
    out, _ = _train(4, *common, "--epochs", "3", "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "# train: resumed from" in out.stdout, out.stdout[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3] and "lost_workers" not in records[-1], records
    last = records[-1]
    assert last["pushes_applied"] == last["pushes_reported"] == sum(last["pushes_by_worker"]) >= 3 * 24
    assert last["audit_max_diff"] < 1e-9


def test_an_easgd_worker_lost_before_a_checkpoint_resumes_from_the_center(tmp_path):
    """Asynchronous EASGD's checkpoint keeps each worker's own parameters; one killed at its 5th move (after
    the pause at its 4th) has none to send at the next: the checkpoint written without it gives it the
    center, and the others paused their own. Resumed with every worker alive, every move is applied and audited."""
    import torch

    from hpcjobs.training.checkpoint import load_checkpoint

    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "c.pt"
    common = [*SMALL, "--mode", "easgd", "--easgd-form", "async", "--local-steps", "2", "--peer-timeout", "6",
              "--metrics", str(metrics), "--checkpoint", str(ckpt)]
    out, _ = _train(4, *common, "--epochs", "2", fault="2:5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"worker rank 2 lost \(silent for 6 s after [45] pushes\)", out.stdout), out.stdout[-2000:]
    state = load_checkpoint(ckpt)
    center = torch.cat([v.reshape(-1) for v in state["model"].values()])
    # 8 x 2 steps, an epoch's end, where both paused; 12 where one worker made the last 4 moves alone (the
    # other, done, had no state to send either: the center)
    pushes = [r["pushes"] for r in state["ranks"][1:]]
    assert pushes in ([8] * 3, [12] * 3)
    assert torch.equal(state["ranks"][2]["params"], center) and state["ranks"][2]["optimizer"] is None
    own = [not torch.equal(state["ranks"][r]["params"], center) for r in (1, 3)]
    assert sum(own) == (2 if pushes[0] == 8 else 1), own
    out, _ = _train(4, *common, "--epochs", "3", "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3] and "lost_workers" not in records[-1], records
    last = records[-1]
    assert last["pushes_applied"] == last["pushes_reported"] == sum(last["pushes_by_worker"]) >= 3 * 8 * 3 // 2
    assert last["audit_max_diff"] < 1e-9


def test_an_easgd_worker_killed_sending_its_state_is_lost_alone(tmp_path):
    """Killed at the pause after its 4th move, its state (width 256: 630 KB, past the eager limit) half sent:
    server 0's receive of it never ends. The server gives it up after the peer timeout and loses that worker,
    and not the others, whose markers and heartbeats waited unread meanwhile (they were all found lost); the
    run goes on without it, whose entry in the checkpoint is the center."""
    import torch

    from hpcjobs.training.checkpoint import load_checkpoint

    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "c.pt"
    out, _ = _train(4, *SMALL, "--width", "256", "--mode", "easgd", "--easgd-form", "async", "--local-steps", "2",
                    "--epochs", "2", "--peer-timeout", "6", "--metrics", str(metrics), "--checkpoint", str(ckpt),
                    fault="2:state4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"worker rank 2 lost \(silent for 6 s after 4 pushes\)", out.stdout), out.stdout[-2000:]
    assert "worker rank 1 lost" not in out.stdout and "worker rank 3 lost" not in out.stdout, out.stdout[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and records[-1]["lost_workers"] == "2", records
    state = load_checkpoint(ckpt)
    assert torch.equal(state["ranks"][2]["params"], torch.cat([v.reshape(-1) for v in state["model"].values()]))


def test_a_worker_waiting_on_one_server_is_not_lost_to_another(tmp_path):
    """Server rank 1 holds every pull for 30 s at its 10th push (as it would
    behind a lost worker with a staleness bound); server 0 has answered. The
    workers waiting on rank 1 were silent to rank 0, which found them lost
    after the timeout -- both, and the run failed its audit. They heartbeat
    every server while they wait now. (10 s of silence: a live rank is not
    descheduled that long on a loaded 2-core machine.)"""
    metrics = tmp_path / "m.jsonl"
    out, seconds = _train(4, *SMALL, "--servers", "2", "--epochs", "2", "--peer-timeout", "10",
                          "--metrics", str(metrics), hold="1:10:30")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lost" not in out.stdout, out.stdout[-2000:]
    assert seconds >= 30  # the hold happened
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and "lost_workers" not in records[-1]
    found = re.search(r"(\d+) pushes applied, (\d+) reported pushed by the workers that finished", out.stdout)
    assert found and found[1] == found[2], out.stdout[-2000:]


def test_a_test_longer_than_the_peer_timeout_is_not_a_dead_server(tmp_path):
    """Server 0 tests the model at every epoch: here 3 batches of 4 s more
    each, 12 s against a 10 s peer timeout, while server 1 and the workers
    wait on it. It sent nothing meanwhile, and server 1 presumed it lost;
    it heartbeats between the batches now."""
    metrics = tmp_path / "m.jsonl"
    out, seconds = _train(4, *SMALL, "--num-samples", "3000", "--servers", "2", "--epochs", "2",
                          "--peer-timeout", "10", "--metrics", str(metrics), slow_test="4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lost" not in out.stdout + out.stderr, out.stdout[-2000:]
    assert seconds >= 2 * 12  # both tests were slow
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2] and "lost_workers" not in records[-1]
    found = re.search(r"(\d+) pushes applied, (\d+) reported pushed by the workers that finished", out.stdout)
    assert found and found[1] == found[2], out.stdout[-2000:]


def test_a_workers_own_setup_error_ends_every_rank_saying_why():
    """Asynchronous EASGD builds an optimizer on the workers only: torch
    refuses nesterov without momentum there, and the servers waited in the
    start's barrier for good. Every rank now exits 2; rank 0 names it."""
    out, seconds = _train(3, *SMALL, "--mode", "easgd", "--easgd-form", "async", "--local-steps", "2",
                          "--optimizer", "nesterov", "--momentum", "0", "--epochs", "1", timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "rank 1: Nesterov momentum requires a momentum" in out.stderr, out.stderr[-3000:]


def test_a_killed_server_ends_every_worker_with_an_error():
    """Every worker waits on server 0 and exits 3 when it has heard nothing
    for 2 s, naming it. Not every worker's words are sure to come: Open MPI
    5's mpirun, under --enable-recovery, kills the job's other ranks once
    half of them have exited non-zero (measured here at 3 to 8 ranks; in this
    job at the second worker's exit), so a worker descheduled past the
    others' timeout ends without a word (CI saw it once: ranks 1 and 2 spoke,
    rank 3 did not). What is sure: the job fails, soon; the first worker to
    notice says why; no rank says anything else."""
    out, seconds = _train(4, *SMALL, "--epochs", "20", "--peer-timeout", "2", fault="0:30")
    assert out.returncode != 0
    said = re.findall(r"^hpcjobs train: error: rank (\d+): (.*)$", out.stderr, re.M)
    why = "server rank 0 sent nothing for 2 s: presumed lost"
    assert said and all(r in {"1", "2", "3"} and text == why for r, text in said), out.stderr[-3000:]
    assert len(said) == len(set(said)) and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert seconds < 60


def test_every_worker_lost_before_a_push_ends_the_job_saying_so():
    out, seconds = _train(2, *SMALL, "--epochs", "2", "--peer-timeout", "2", fault="1:0")
    assert out.returncode != 0
    assert "every worker was lost before a push was applied (workers lost: 1): nothing trained" in out.stderr, \
        out.stderr[-3000:]
    assert "IndexError" not in out.stderr and seconds < 60
