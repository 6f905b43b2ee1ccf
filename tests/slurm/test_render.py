"""`hpcjobs slurm render` against golden files (as submitit tests its
scripts), its validation and quoting, and `launch`'s command line."""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcjobs.cli import UsageError
from hpcjobs.cli.slurm_render import check_job_args
from hpcjobs.runtime import bind_gpu
from hpcjobs.slurm import TEMPLATES, RenderOptions, launch_command, render, requeue_decision, template_path

GOLDEN = Path(__file__).parent / "golden"
OPTIONS = RenderOptions(nodes=4, ntasks_per_node=8, gpus_per_node=8, cpus_per_task=6, time="1-02:00:00",
                        job_name="golden", partition="gpu", account="proj.42",
                        job_args=("--max-bytes", "1G", "--json", "two words; $(not run).json"))
# Job arguments each template's command takes, with a path the shell must not split or run.
JOB_ARGS = {"allreduce": OPTIONS.job_args, "horovod": OPTIONS.job_args, "nccl": OPTIONS.job_args,
            "tune": ("--max-bytes", "1G", "--out", "two words; $(not run).json"),
            "train": ("--epochs", "2", "--metrics", "two words; $(not run).jsonl")}


@pytest.mark.parametrize("name", TEMPLATES)
def test_rendered_templates_match_their_golden_files(name):
    got = render(template_path(name).read_text(), dataclasses.replace(OPTIONS, job_args=JOB_ARGS[name]))
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPCJOBS_UPDATE_GOLDEN") == "1":
        path.write_text(got)
    assert got == path.read_text(), f"rendered {name} differs from {path} (HPCJOBS_UPDATE_GOLDEN=1 rewrites it)"


@pytest.mark.parametrize("name", TEMPLATES)
def test_cpu_mode_drops_the_gpu_request_and_defaults_to_cpu(name):
    text = render(template_path(name).read_text(), RenderOptions(cpu=True))
    assert "#SBATCH --gpus-per-node" not in text
    assert "export HPCJOBS_CPU=${HPCJOBS_CPU:-1}" in text
    default = template_path(name).read_text()
    assert "#SBATCH --gpus-per-node=" in default and "export HPCJOBS_CPU=${HPCJOBS_CPU:-0}" in default


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_documents_each_sbatch_default_and_is_valid_bash(name):
    text = template_path(name).read_text()
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            assert "# " in line.split("#SBATCH", 1)[1], f"undocumented: {line}"
    for key in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "job-name", "output"):
        assert f"#SBATCH --{key}=" in text
    assert "%j" in text and "/home" not in text and "ib0" not in text.split("NCCL_SOCKET_IFNAME=")[0]
    assert subprocess.run(["bash", "-n", str(template_path(name))]).returncode == 0


def test_job_args_survive_the_shell_exactly(tmp_path):
    text = render(template_path("allreduce").read_text(), OPTIONS)
    line = next(x for x in text.splitlines() if x.startswith("JOB_ARGS=("))
    script = tmp_path / "args.sh"
    script.write_text(line + '\nprintf "%s\\n" "${JOB_ARGS[@]}"\n')
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True).stdout.splitlines()
    assert out == list(OPTIONS.job_args)


@pytest.mark.parametrize("kwargs,words", [
    (dict(time="90 minutes"), "not a Slurm time"), (dict(time="1:2:3:4"), "not a Slurm time"),
    (dict(time="25:99"), "below 60"), (dict(time="1:60:00"), "below 60"), (dict(time="2-24"), "below 24"),
    (dict(job_name="x; rm -rf /"), "--job-name"), (dict(partition="-p"), "--partition"),
    (dict(account="a b"), "--account"), (dict(nodes=0), "--nodes must be a positive integer"),
    (dict(gpus_per_node=-1), "--gpus-per-node"),
    (dict(job_name="x\n"), "--job-name"), (dict(partition="gpu\n"), "--partition"), (dict(time="10\n"), "Slurm time"),
    (dict(partition="gpu,,long"), "--partition"),
    (dict(ntasks_per_node=8, gpus_per_node=4), "each rank drives one GPU, so give them equal"),
    (dict(cpu=True, gpus_per_node=4), "--cpu asks for no GPUs"),
    (dict(mem="10GB"), "--mem '10GB'"), (dict(mem="-1"), "--mem"), (dict(constraint="a100 ib"), "--constraint"),
    (dict(constraint="a100&&ib"), "--constraint"), (dict(constraint="[a|[b]]"), "--constraint"),
    (dict(constraint="a*0"), "--constraint"), (dict(constraint="(a&b"), "--constraint"),
    (dict(constraint="a#b"), "--constraint"), (dict(qos="hi gh"), "--qos"),
    (dict(gpu_type="a100:2"), "--gpu-type"),
    (dict(cpu=True, gpu_type="a100"), "CPU mode asks for no GPUs"),
])
def test_bad_values_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        render(template_path("train").read_text(), RenderOptions(**kwargs))


@pytest.mark.parametrize("kwargs,tasks,gpus", [
    (dict(ntasks_per_node=8), 8, 8), (dict(gpus_per_node=2), 2, 2), (dict(), 4, 4),  # the template's 4 and 4
])
def test_ranks_and_gpus_per_node_follow_each_other(kwargs, tasks, gpus):
    text = render(template_path("train").read_text(), RenderOptions(**kwargs))
    assert f"#SBATCH --ntasks-per-node={tasks} " in text and f"#SBATCH --gpus-per-node={gpus} " in text


@pytest.mark.parametrize("kwargs,gpus", [(dict(gpu_type="a100"), "a100:4"),
                                         (dict(gpu_type="h100", ntasks_per_node=8), "h100:8")])
def test_a_gpu_type_asks_for_typed_gpus(kwargs, gpus):
    text = render(template_path("train").read_text(), RenderOptions(**kwargs))
    assert f"#SBATCH --gpus-per-node={gpus} " in text


def test_the_sites_choices_are_rendered_after_the_job_name():
    text = render(template_path("allreduce").read_text(),
                  RenderOptions(partition="gpu", qos="high", constraint="[a100*2&h100*2]", mem="0", exclusive=True))
    lines = [line.split()[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    at = lines.index("--job-name=hpcjobs-allreduce")
    assert lines[at + 1:at + 6] == ["--partition=gpu", "--qos=high", "--constraint=[a100*2&h100*2]", "--mem=0",
                                    "--exclusive"]
    plain = render(template_path("allreduce").read_text(), RenderOptions())
    assert not any(f"--{k}" in plain for k in ("partition", "qos", "constraint", "mem", "exclusive"))


def test_a_list_of_partitions_is_passed_on():
    assert "#SBATCH --partition=gpu,gpu-long" in render(template_path("train").read_text(),
                                                        RenderOptions(partition="gpu,gpu-long"))


def test_an_empty_job_args_array_is_not_unbound_in_an_old_bash(tmp_path):
    """bash before 4.4 under set -u calls an empty "${A[@]}" unbound, and
    every template ended there when given no job arguments: the templates
    expand ${JOB_ARGS[@]+"${JOB_ARGS[@]}"}, which no bash calls unbound."""
    for name in TEMPLATES:
        text = template_path(name).read_text()
        assert '"${JOB_ARGS[@]}"' not in text.replace('${JOB_ARGS[@]+"${JOB_ARGS[@]}"}', ""), name
    script = tmp_path / "empty.sh"
    script.write_text('set -u\nJOB_ARGS=()\nprintf "[%s]" ${JOB_ARGS[@]+"${JOB_ARGS[@]}"} end\n')
    assert subprocess.run(["bash", str(script)], capture_output=True, text=True).stdout == "[end]"


@pytest.mark.parametrize("job_args,words", [
    (("--algorithm", "bogus"), "hpcjobs train: error: argument --algorithm: invalid choice"),
    (("--epochs", "0"), "hpcjobs train: error: argument --epochs: must be positive"),
    (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
])
def test_job_arguments_the_templates_commands_refuse_are_refused(job_args, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        check_job_args(template_path("train").read_text(), job_args)


@pytest.mark.parametrize("time", ["30", "30:00", "01:30:00", "2-12", "2-12:30", "2-12:30:00", "59:59", "0",
                                  "UNLIMITED"])
def test_slurm_time_formats_are_accepted(time):
    assert f"#SBATCH --time={time} " in render(template_path("tune").read_text(), RenderOptions(time=time))


def test_a_time_limit_too_short_for_the_train_templates_signal_is_warned_about():
    """The train template asks for SIGUSR1 120 s before the limit, which Slurm
    may send up to 60 s earlier: at --time 3 or less it comes as the job
    starts, and the run stops at its second step and requeues, again and again."""
    from hpcjobs.slurm import signal_too_early, time_seconds

    assert [time_seconds(t) for t in ("30", "30:00", "01:30:00", "2-12", "2-12:30", "2-12:30:15", "3", "0",
                                      "UNLIMITED")] == [1800, 1800, 5400, 216000, 217800, 217815, 180, None, None]
    train = template_path("train").read_text()
    assert "comes as the job starts" in signal_too_early(render(train, RenderOptions(time="3")))
    for fine in ("4", "0:03:01", "0", "UNLIMITED"):
        assert signal_too_early(render(train, RenderOptions(time=fine))) is None, fine
    assert signal_too_early(render(template_path("allreduce").read_text(), RenderOptions(time="2"))) is None
    out = _hpcjobs("slurm", "render", "train", "-t", "2")
    assert out.returncode == 0 and "warning: --time 2 (120 s): the script asks for a signal 120 s" in out.stderr


@pytest.mark.parametrize("template,args", [
    ("train", ("--epochs", "2")),             # hpcjobs train
    ("train", ("--min-batch", "64")),         # experiment large-batch, the template's other job
    ("allreduce", ("--max-bytes", "1M")), ("tune", ("--factor", "4")), ("nccl", ("--iters", "5")),
])
def test_job_arguments_that_a_templates_command_takes_are_accepted(template, args):
    check_job_args(template_path(template).read_text(), args)  # raises if refused
    assert "JOB_ARGS=(" + " ".join(args) + ")" in render(template_path(template).read_text(),
                                                         RenderOptions(job_args=args))


@pytest.mark.parametrize("job_args,chosen,warned", [
    (("--min-batch", "64"), None, "are for experiment large-batch; the job runs train unless the template is told "
                                  "otherwise (HPCJOBS_TRAIN_JOB=large-batch when it is submitted)"),
    (("--min-batch", "64"), "large-batch", None),
    (("--min-batch", "64"), "train", "the job runs train"),
    (("--epochs", "2"), None, None),
    (("--epochs", "2"), "large-batch", None),  # both take it
    (("--amp", "fp16"), None, "--amp fp16 is for GPUs"),  # on CPUs train refuses it, large-batch takes it
])
def test_job_arguments_only_the_templates_other_command_takes_are_warned_about(job_args, chosen, warned,
                                                                                 monkeypatch, capsys):
    """train.sbatch runs train unless HPCJOBS_TRAIN_JOB picks large-batch as
    the job is submitted: arguments only large-batch takes rendered without
    a word and the job failed once it started."""
    monkeypatch.delenv("HPCJOBS_TRAIN_JOB", raising=False)
    if chosen:
        monkeypatch.setenv("HPCJOBS_TRAIN_JOB", chosen)
    check_job_args(template_path("train").read_text(), job_args, ranks=2, cpu=True)
    err = capsys.readouterr().err
    assert (warned in err) if warned else err == "", err


def test_each_template_runs_a_command_with_the_job_arguments():
    from hpcjobs.slurm import job_commands

    assert {t: job_commands(template_path(t).read_text()) for t in TEMPLATES} == {
        "allreduce": [("bench", "allreduce")], "train": [("train",), ("experiment", "large-batch")],
        "tune": [("tune",)], "horovod": [("bench", "allreduce")], "nccl": [("bench", "allreduce")]}


def test_unknown_template_is_refused():
    with pytest.raises(ValueError, match="no template 'resnet'"):
        template_path("resnet")


def _hpcjobs(*args, env=None):
    from launch import clean_env

    return subprocess.run([sys.executable, "-m", "hpcjobs", *args], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in clean_env().items() if not k.startswith("SLURM_")} | (env or {}))


def test_render_command_prints_the_script_and_refuses_bad_input():
    out = _hpcjobs("slurm", "render", "train", "-N", "3", "--cpu", "--", "--epochs", "2")
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --nodes=3" in out.stdout and "JOB_ARGS=(--epochs 2)" in out.stdout
    out = _hpcjobs("slurm", "render", "train", "--time", "soon")
    assert out.returncode == 2 and "not a Slurm time" in out.stderr
    # what train refuses at the job's size, before the job waits in the queue: it was rendered, then every rank
    # exited 2 (3 nodes x the template's 4 ranks; its 2 nodes in CPU mode x 4)
    for flags, words in ((["-N", "3", "--gpu-type", "a100", "--", "--global-batch", "4096"],
                          "--global-batch 4096 does not divide by 12 ranks x 1 passes (at the job's 12 ranks)"),
                         (["--cpu", "--", "--servers", "2"], "--servers is for --mode async")):
        out = _hpcjobs("slurm", "render", "train", *flags)
        assert out.returncode == 2 and "would fail in the job: hpcjobs train: error: " + words in out.stderr, out.stderr
    assert _hpcjobs("slurm", "render", "train", "--cpu", "--", "--global-batch", "64").returncode == 0


def test_submit_gives_sbatch_the_flags_it_was_given_which_its_environment_would_override(tmp_path, monkeypatch):
    """sbatch takes SBATCH_* variables over a script's #SBATCH lines: with
    SBATCH_PARTITION=gpu exported, `submit -p debug` went to gpu. submit now
    passes each flag given on sbatch's command line (as rendered), render
    warns, and the default script name is one past the highest there."""
    import argparse

    from hpcjobs.cli import slurm_render, slurm_submit

    p = argparse.ArgumentParser()
    slurm_submit.configure(p)
    p.add_argument("passthrough", nargs="*")
    args = p.parse_args(["train", "-p", "debug", "-t", "10", "-N", "2", "--gpu-type", "a100", "--exclusive"])
    assert slurm_submit.sbatch_command(args, slurm_render.script(args), "x.sbatch") == [
        "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=a100:4", "--time=10", "--partition=debug",
        "--exclusive", "x.sbatch"]
    cpu = p.parse_args(["allreduce", "--cpu", "--ntasks-per-node", "3", "--wait"])
    assert slurm_submit.sbatch_command(cpu, slurm_render.script(cpu), "y") == [
        "sbatch", "--parsable", "--wait", "--ntasks-per-node=3", "y"]  # no GPUs asked for in CPU mode
    monkeypatch.setenv("SBATCH_PARTITION", "gpu")
    monkeypatch.delenv("SBATCH_TIMELIMIT", raising=False)
    assert slurm_render.overridden(args) == ["SBATCH_PARTITION=gpu (--partition)"]
    # CPU mode asks for no GPUs: sbatch runs without the variables that would ask for some (0 is a count given)
    monkeypatch.setenv("SBATCH_GPUS_PER_NODE", "4")
    zero = p.parse_args(["allreduce", "--gpus-per-node", "0"])
    assert "SBATCH_GPUS_PER_NODE" not in slurm_submit.sbatch_env(cpu) | slurm_submit.sbatch_env(zero)
    assert slurm_submit.sbatch_env(args)["SBATCH_GPUS_PER_NODE"] == "4"
    assert slurm_render.overridden(cpu) == ["SBATCH_GPUS_PER_NODE=4 (--cpu)"]
    assert slurm_render.overridden(zero) == ["SBATCH_GPUS_PER_NODE=4 (--gpus-per-node)"]
    monkeypatch.delenv("SBATCH_GPUS_PER_NODE")
    out = _hpcjobs("slurm", "render", "train", "-p", "debug", env={"SBATCH_PARTITION": "gpu"})
    assert out.returncode == 0 and "warning: SBATCH_PARTITION=gpu (--partition)" in out.stderr, out.stderr
    for name in ("train-1.sbatch", "train-3.sbatch", "train-x.sbatch", "tune-7.sbatch"):
        (tmp_path / name).write_text("")
    assert slurm_submit.default_script("train", tmp_path) == tmp_path / "train-4.sbatch"  # was train-3: overwritten
    assert slurm_submit.default_script("nccl", tmp_path) == tmp_path / "nccl-1.sbatch"


def test_templates_and_launch_refuse_to_run_outside_slurm():
    out = subprocess.run(["bash", str(template_path("allreduce"))], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert out.returncode == 2 and "submit it with sbatch" in out.stderr
    out = _hpcjobs("slurm", "launch", "--", "info")
    assert out.returncode == 2 and "not inside a Slurm job" in out.stderr
    out = _hpcjobs("slurm", "launch", "--", "bench", "allreduce", "--iters", "0", env={"SLURM_JOB_ID": "1"})
    assert out.returncode == 2 and "the ranks' command would fail: hpcjobs bench allreduce: error: argument " \
        "--iters/-n: must be positive" in out.stderr, out.stderr


def test_other_commands_refuse_arguments_after_double_dash():
    out = _hpcjobs("info", "--", "x")
    assert out.returncode == 2 and "unexpected arguments after --" in out.stderr


JOB = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "8", "SLURM_JOB_NAME": "hpcjobs-train", "SLURM_NTASKS_PER_NODE": "4",
       "SLURM_SUBMIT_DIR": "/scratch/me", "HPCJOBS_SRUN_MPI": "pmi2", "HPCJOBS_SRUN_FLAGS": "--cpu-bind=cores"}


def test_launch_with_srun():
    cmd, env = launch_command(dict(JOB), ["train", "--metrics", "{job_dir}/m.jsonl"])
    # a rank that exits non-zero ends the step (before MPI starts the others would wait in MPI_Init)
    # --export=ALL: under sbatch --export=NONE srun would pass the ranks only SLURM_* (MPI_Init failed)
    assert cmd[:5] == ["srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--export=ALL", "--cpu-bind=cores"]
    assert cmd[-4:] == ["hpcjobs", "train", "--metrics", "/scratch/me/results/hpcjobs-train-77/m.jsonl"]
    # Slurm 22.05's srun does not inherit the job's --cpus-per-task: passed on, or each task gets one core
    cmd, _ = launch_command(dict(JOB, SLURM_CPUS_PER_TASK="4"), ["tune"])
    assert cmd[:6] == ["srun", "--mpi=pmi2", "--kill-on-bad-exit=1", "--export=ALL", "--cpus-per-task=4",
                       "--cpu-bind=cores"]
    assert env["HPCJOBS_EXPECT_WORLD_SIZE"] == "8" and env["HPCJOBS_BIND_GPU"] == "1"
    assert env["HPCJOBS_JOB_DIR"] == "/scratch/me/results/hpcjobs-train-77"
    assert env["MASTER_PORT"] == str(20077)


def test_the_rendezvous_is_the_jobs_whatever_the_submit_shell_had():
    _, env = launch_command(dict(JOB, MASTER_ADDR="localhost", MASTER_PORT="29500"), ["tune"])
    assert "MASTER_ADDR" not in env and env["MASTER_PORT"] == "20077"  # the address: the first node (scontrol)
    _, env = launch_command(dict(JOB, SLURM_JOB_ID="31999", HPCJOBS_MASTER_ADDR="n7", MASTER_ADDR="localhost"),
                            ["tune"])
    assert env["MASTER_ADDR"] == "n7" and env["MASTER_PORT"] == str(20000 + 31999 % 12000) < "32768"
    _, env = launch_command(dict(JOB, HPCJOBS_MASTER_PORT="29501"), ["tune"])
    assert env["MASTER_PORT"] == "29501"


def test_launch_with_mpirun_in_cpu_mode():
    cmd, env = launch_command(dict(JOB, HPCJOBS_LAUNCHER="mpirun", HPCJOBS_CPU="1", HPCJOBS_MPIRUN_FLAGS="-x FOO",
                                   SLURM_NTASKS_PER_NODE="4(x2)"), ["tune"])
    assert cmd[:8] == ["mpirun", "-n", "8", "--map-by", "ppr:4:node", "-x", "FOO", cmd[7]]
    assert "HPCJOBS_BIND_GPU" not in env
    with pytest.raises(ValueError, match="srun or mpirun"):
        launch_command(dict(JOB, HPCJOBS_LAUNCHER="pdsh"), ["tune"])


@pytest.mark.parametrize("env,want", [
    ({"SLURM_LOCALID": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "6"),
    ({"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, "3"),   # under mpirun SLURM_LOCALID is 0
    ({"MPI_LOCALRANKID": "1"}, "1"),
])
def test_bind_gpu_picks_the_local_ranks_gpu(monkeypatch, env, want):
    for k in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HPCJOBS_BIND_GPU", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bind_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == want


def test_the_templates_are_package_data_and_the_checkouts_slurm_folder_links_to_them():
    """A non-editable install (pip install .) has them too: before they sat
    outside the package, and render said "no template 'allreduce'" there."""
    import hpcjobs
    from hpcjobs.slurm import template_dir

    package = Path(hpcjobs.__file__).resolve().parent
    assert template_dir() == package / "slurm_templates"
    assert '"slurm_templates/*.sbatch"' in (package.parent / "pyproject.toml").read_text()
    checkout = package.parent / "slurm"
    if checkout.exists():  # the checkout's slurm/, where the docs say sbatch slurm/X.sbatch
        assert checkout.resolve() == template_dir()


USR1 = {"signal": "SIGUSR1", "epoch": 1, "step": 7, "checkpoint": "/r/ckpt.pt", "written": True}


@pytest.mark.parametrize("record,restarts,limit,requeue,says", [
    (None, 0, 10, False, ""),  # ended on its own, or failed: launch says nothing and passes the status on
    (USR1, 0, 10, True, "SIGUSR1 stopped the run at step 7 of epoch 2: requeueing the job (1 of at most 10); "
                        "it resumes from /r/ckpt.pt"),
    (dict(USR1, step=0), 9, 10, True, "after epoch 1: requeueing the job (10 of at most 10)"),
    (USR1, 10, 10, False, "not requeued, the job was requeued 10 time(s) and --requeue allows 10"),
    (USR1, 0, 0, False, "--requeue allows 0"),
    (dict(USR1, signal="SIGTERM"), 0, 10, False, "SIGTERM stopped the run at step 7 of epoch 2: not requeued"),
    (dict(USR1, written=False), 0, 10, False, "not finite: not requeued"),  # it would end the same again
])
def test_launch_requeues_a_job_only_after_a_sigusr1_stop_with_a_checkpoint(record, restarts, limit, requeue, says):
    go, why = requeue_decision(record, restarts, limit)
    assert go is requeue and says in why and (why == "") == (says == ""), why


@pytest.mark.parametrize("record,child_rc,rc,says", [
    (None, 0, 0, None),  # ended on its own: nothing said, and the last run's stale file was not read
    ({"signal": "SIGTERM", "written": True}, 143, 143, "SIGTERM stopped the run after epoch 1: not requeued"),
    ({"signal": "SIGUSR1", "written": True}, 138, 138, "after epoch 1: not requeued, the job was requeued 3 "
                                                       "time(s) and --requeue allows 3"),
    (None, -9, 137, None),  # the launcher killed: the status a shell gives it
])
def test_launch_requeue_reads_the_runs_stop_file_and_starts_no_mpi(tmp_path, record, child_rc, rc, says):
    """launch --requeue N runs the launcher as a child, and reads the stop
    file the run wrote (its stale one from the run before removed first);
    these cases do not requeue, so no scontrol runs (tests/slurm/
    test_cluster.py requeues on the emulated Slurm). On the batch host it
    starts no MPI: importing training.preempt for the variable's name did."""
    stop = tmp_path / "stopped.json"
    stop.write_text('{"signal": "SIGUSR1", "written": true, "epoch": 9}')  # the run before's
    child = ("import json, os, signal, sys\n"
             f"record = {record!r}\n"
             "if record: open(os.environ['HPCJOBS_STOP_FILE'], 'w').write(json.dumps(dict(record, epoch=1, step=0, "
             "checkpoint='c.pt')))\n"
             f"os.kill(os.getpid(), {-child_rc}) if {child_rc} < 0 else sys.exit({child_rc})\n")
    code = ("import sys\nfrom hpcjobs.cli.slurm_launch import _run_and_requeue\n"
            f"rc = _run_and_requeue([sys.executable, '-c', {child!r}], {{'HPCJOBS_JOB_DIR': {str(tmp_path)!r}}}, 3)\n"
            "print('rc', rc, 'mpi', 'mpi4py.MPI' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(env, SLURM_JOB_ID="77", SLURM_RESTART_COUNT="3"))
    assert (proc.stdout.splitlines() or [""])[-1] == f"rc {rc} mpi False", proc.stdout + proc.stderr
    said = [line for line in proc.stdout.splitlines() if line.startswith("# hpcjobs slurm launch: job 77: ")]
    assert (said == []) if says is None else (len(said) == 1 and says in said[0]), proc.stdout
    assert stop.exists() == bool(record)


def test_launch_requeue_hands_a_sigusr1_it_gets_to_the_launcher(tmp_path):
    """The train template execs launch, and sbatch --signal=B:USR1@120 signals
    the batch step's shell alone: launch --requeue hands the signal to its
    launcher (srun and mpirun hand it to every rank). Here the launcher is a
    child that writes the stop file when the signal comes, as a rank does;
    without the handing on, launch itself died of the signal (status -10).
    The launcher starts with the signal ignored until it sets its own (one
    too early is dropped, not its end), and a second signal after it ended
    does not end launch before it requeues."""
    child = ("import json, os, signal, sys, time\n"
             "got, at_start = [], signal.getsignal(signal.SIGUSR1)\n"
             "signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\n"
             f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
             "deadline = time.monotonic() + 30\n"
             "while not got and time.monotonic() < deadline:\n"
             "    time.sleep(0.01)\n"
             "open(os.environ['HPCJOBS_STOP_FILE'], 'w').write(json.dumps(dict(signal='SIGUSR1', written=False, "
             "epoch=1, step=5, checkpoint='c.pt')))\n"
             "sys.exit((138 if got else 3) if at_start == signal.SIG_IGN else 4)\n")
    code = ("import os, signal, sys, time\nfrom hpcjobs.cli.slurm_launch import _run_and_requeue\n"
            f"rc = _run_and_requeue([sys.executable, '-c', {child!r}], {{'HPCJOBS_JOB_DIR': {str(tmp_path)!r}}}, 3)\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\ntime.sleep(0.2)\n"
            "print('rc', rc)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(env, SLURM_JOB_ID="77", SLURM_RESTART_COUNT="0"))
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.splitlines()[-1] == "rc 138", (proc.returncode, out, err)
    assert ("# hpcjobs slurm launch: job 77: SIGUSR1 stopped the run at step 5 of epoch 2 with parameters that are "
            "not finite: not requeued") in out, out
