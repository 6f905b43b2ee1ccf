"""The command line as a user runs it: real mpirun, real exit codes."""

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from launch import (_mpirun_prefix, clean_env, hpcjobs as _hpcjobs, hpcjobs_here, launch_env, mpirun as _mpirun,
                    mpirun_script, run)
from hpcjobs.collectives import ALGORITHMS
from hpcjobs.collectives.auto import DEFAULT_TABLE
from hpcjobs.comm import SETTINGS, install


def test_help_lists_the_commands():
    out = _hpcjobs("--help")
    assert out.returncode == 0
    assert "bench" in out.stdout and "info" in out.stdout
    out = _hpcjobs("bench", "allreduce", "--help")
    assert out.returncode == 0 and "--segment-bytes" in out.stdout


@pytest.mark.parametrize("argv", [["bench", "allreduce", "--timeout", "60"], ["train", "--no-checks"]])
def test_a_global_flag_after_the_command_says_where_it_goes(argv):
    from hpcjobs.cli import parse_error

    assert "they go before the command, as in `hpcjobs --timeout 60 bench allreduce`" in parse_error(argv)
    assert parse_error([argv[-1], *argv[:-1]] if argv[-1] == "--no-checks" else ["--timeout", "60", *argv[:2]]) \
        is None


def test_the_venvs_activate_script_sets_what_open_mpi_needs():
    """The README's commands run after `. .venv/bin/activate`: as root Open
    MPI refused to start there, and the UCX component printed an error per
    shared window; only the scripts set them."""
    import os
    import subprocess
    import sys

    activate = os.path.join(sys.prefix, "bin", "activate")
    if not os.path.isfile(activate) or "hpcjobs: MPI settings" not in open(activate).read():
        pytest.skip("not the venv scripts/lib.sh made")
    if not os.path.isfile(os.path.join(sys.prefix, "bin", "prterun")):
        pytest.skip("a site's MPI (HPCJOBS_SITE_MPI=1): its settings are its own")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "OPAL_"))}
    out = subprocess.run(["bash", "-c", f". {activate} && env"], capture_output=True, text=True, env=env).stdout
    assert "OMPI_MCA_osc=^ucx" in out.splitlines()
    assert ("OMPI_ALLOW_RUN_AS_ROOT=1" in out.splitlines()) == (os.geteuid() == 0)


def test_bench_staging_refuses_no_chunk_sizes_before_anything_runs():
    out = _hpcjobs("bench", "staging", "--chunks", "")  # it failed in min() after measuring, on a GPU
    assert out.returncode == 2 and "--chunks: give one chunk size or more" in out.stderr, out.stderr


def test_a_group_without_a_command_prints_its_help_and_exits_2():
    out = _hpcjobs("bench")
    assert out.returncode == 2 and "allreduce" in out.stderr


BAD_BENCH_ARGS = [
    (["--min-bytes", "0"], "size must be positive"),
    (["--min-bytes", "1K", "--max-bytes", "8"], "--min-bytes 1024 is larger than --max-bytes 8"),
    (["--min-bytes", "1", "--max-bytes", "3"], "holds one float32 element (4 bytes)"),  # was an empty table, "OK"
    (["--impl", "ring,butterfly"], "unknown implementation 'butterfly'"),
    (["--segment-bytes", "64Q"], "not a size"),
    (["--iters", "-3"], "must be positive"),
    (["--dtype", "complex64"], "invalid choice"),
    (["--impl", "ring,auto", "--segment-bytes", "64K"], "--impl has neither: it would be ignored"),
    (["--device", "cuda", "--framework", "torch"], "--framework picks the host buffers' type"),
]


@pytest.fixture(scope="module")
def bench_refusals():
    """Every case of BAD_BENCH_ARGS through ``main`` on 2 ranks, in one launch."""
    from launch import main_in_one_launch

    return main_in_one_launch(2, [["bench", "allreduce", *args] for args, _ in BAD_BENCH_ARGS])


@pytest.mark.parametrize("case", range(len(BAD_BENCH_ARGS)), ids=[" ".join(a) for a, _ in BAD_BENCH_ARGS])
def test_bad_bench_arguments_exit_2_on_every_rank_naming_the_problem(bench_refusals, case):
    (rc0, out0, err0), (rc1, out1, err1) = bench_refusals[case]
    assert (rc0, rc1) == (2, 2), (err0, err1)
    assert BAD_BENCH_ARGS[case][1] in err0
    assert "size(B)" not in out0 + out1  # nothing was measured


def test_a_refused_bench_ends_every_rank_process_with_exit_2():
    args, words = BAD_BENCH_ARGS[1]  # refused inside the command, with MPI started (not by argparse)
    out = _mpirun(2, "bench", "allreduce", *args)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_bench_under_mpirun_prints_the_table_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    out = _mpirun(3, "bench", "allreduce", "-b", "8", "-e", "4K", "-f", "8", "--iters", "3",
                  "--json", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(l for l in lines if "size(B)" in l)
    assert header.split() == ["#", "size(B)", "count", "type", "redop", "impl", "time(us)",
                              "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
    rows = [l.split() for l in lines if l and not l.startswith("#")]
    assert [(r[0], r[4]) for r in rows] == [(s, i) for s in ("8", "64", "512", "4096")
                                            for i in ("ring", "ring_pipelined", "mpi")]
    assert all(r[-1] == "0" for r in rows)
    assert "# Out of bounds values : 0 OK" in out.stdout
    data = json.loads(path.read_text())
    assert data["environment"]["ranks"] == 3 and len(data["records"]) == 12


def test_bench_passes_print_each_pass_then_each_rows_median(tmp_path):
    path = tmp_path / "bench.json"
    out = _mpirun(2, "bench", "allreduce", "-b", "8", "-e", "4K", "-f", "8", "--iters", "3", "--passes", "2",
                  "--impl", "auto,recursive_doubling,tree", "--json", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    starts = [i for i, l in enumerate(lines) if l in ("# pass 1 of 2", "# pass 2 of 2", "# median over 2 passes")]
    assert len(starts) == 3, out.stdout
    tables = [[l.split() for l in lines[a:b] if l and not l.startswith("#")]
              for a, b in zip(starts, [*starts[1:], len(lines)])]
    impls = ("auto", "recursive_doubling", "tree", "mpi")
    for table in tables:
        assert [(r[0], r[4]) for r in table] == [(s, i) for s in ("8", "64", "512", "4096") for i in impls]
    for first, second, median in zip(*tables):  # times are printed to 0.1 us
        assert float(median[5]) == pytest.approx((float(first[5]) + float(second[5])) / 2, abs=0.1)
    # Each pass says what auto kept and how it did; then the medians' verdict.
    assert sum(l.startswith("# auto kept: ") for l in lines) == 2
    assert sum(l.startswith("# auto vs the best of ours: within 10% at ") for l in lines) == 2
    assert re.search(r"^# auto vs the best of ours, medians over 2 passes: within 10% at [0-4] of 4 sizes",
                     out.stdout, re.M), out.stdout
    data = json.loads(path.read_text())
    assert data["environment"]["passes"] == 2
    assert [(str(r["size_bytes"]), r["impl"], f"{r['time_us']:.1f}") for r in data["records"]] == [
        (r[0], r[4], r[5]) for r in tables[2]]


@pytest.mark.parametrize("command,flag,directory", [
    (["tune", "-e", "64"], "--out", False),
    (["bench", "allreduce", "-e", "64"], "--json", False),
    (["bench", "allreduce", "-e", "64"], "--out", True),
    (["model", "-b", "1M", "-e", "1M"], "--out", True),
    (["soak", "--ops", "10"], "--json", False),
])
def test_an_output_that_cannot_be_written_is_refused_before_anything_is_measured(tmp_path, command, flag, directory):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = _mpirun(2, *command, flag, str(blocker / ("dir" if directory else "t.json")))
    assert out.returncode == 2, out.stderr
    assert f"{flag} {blocker}/" in out.stderr and "cannot create the directory" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "size(B)" not in out.stdout and "pass 1" not in out.stdout
    assert "alpha =" not in out.stdout and "wrong results" not in out.stdout  # nothing was measured


@pytest.mark.parametrize("command,flag,directory", [
    (["bench", "allreduce", "-e", "64"], "--json", False),
    (["bench", "allreduce", "-e", "64"], "--out", True),
])
def test_an_output_in_a_directory_no_file_can_be_made_in_is_refused_before_anything_is_measured(command, flag,
                                                                                               directory):
    """/proc: the directory exists, and root passes every permission check,
    but no file can be made there. The check asked os.access, which says
    yes to root, and the run failed with a traceback at its end."""
    out = _mpirun(2, *command, flag, "/proc/hpcjobs-out" + ("" if directory else ".json"))
    assert out.returncode == 2, out.stderr
    assert f"{flag} /proc/hpcjobs-out" in out.stderr and "cannot" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "size(B)" not in out.stdout


def test_an_output_file_that_is_a_directory_is_refused(tmp_path):
    out = _mpirun(2, "tune", "-e", "64", "--out", str(tmp_path))
    assert out.returncode == 2 and "is a directory; give a file name" in out.stderr, out.stderr


def test_outputs_in_new_directories_get_them(tmp_path):
    path = tmp_path / "new" / "deeper" / "bench.json"
    out = _mpirun(2, "bench", "allreduce", "-b", "8", "-e", "64", "-f", "8", "--iters", "2", "--json", str(path))
    assert out.returncode == 0, out.stderr
    assert json.loads(path.read_text())["environment"]["ranks"] == 2


@pytest.mark.parametrize("env,words", [
    ({"HPCJOBS_TIMEOUT": "soon"}, "hpcjobs bench allreduce: error: HPCJOBS_TIMEOUT='soon' is not a number of seconds"),
    ({"HPCJOBS_STALL_WARNING": "-1"}, "hpcjobs bench allreduce: error: HPCJOBS_STALL_WARNING must be >= 0 seconds"),
    ({"HPCJOBS_RANKS_PER_NODE": "0"}, "hpcjobs bench allreduce: error: HPCJOBS_RANKS_PER_NODE must be a positive"),
    ({"HPCJOBS_TUNING": "/no/such/tuning.json"},
     "hpcjobs bench allreduce: error: HPCJOBS_TUNING: cannot read tuning table /no/such/tuning.json"),
])
def test_a_bad_job_parameter_in_the_environment_is_a_usage_error_before_anything_runs(env, words):
    out = _mpirun(2, "bench", "allreduce", "-e", "64", env=env)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr and "Traceback" not in out.stderr
    assert "size(B)" not in out.stdout  # nothing was measured


@pytest.mark.parametrize("variable,value,message", [
    ("HPCJOBS_TUNING", "/no/such/tuning.json", "HPCJOBS_TUNING: cannot read tuning table /no/such/tuning.json: .* "
                                               r"\(on rank 1 of 2\)"),
    ("HPCJOBS_TIMEOUT", "soon", r"HPCJOBS_TIMEOUT='soon' is not a number of seconds \(on rank 1 of 2\)"),
    ("HPCJOBS_CHECKS", "maybe", r"HPCJOBS_CHECKS='maybe': choose one of 1, .*, no \(on rank 1 of 2\)"),
    # valid on each host, but a rank that checks its calls and one that does not, or two that split the ranks
    # into nodes differently, each waited for the other in a different collective (a 2-rank soak hung)
    ("HPCJOBS_CHECKS", "0", r"HPCJOBS_CHECKS differs across ranks \(rank 0: on; rank 1: off\): set it the same "
                            "on every host"),
    ("HPCJOBS_RANKS_PER_NODE", "1", r"HPCJOBS_RANKS_PER_NODE differs across ranks \(rank 0: unset; rank 1: 1\): set "
                                    "it the same on every host"),
    ("HPCJOBS_AGREE_VIA", "mpi", r"HPCJOBS_AGREE_VIA differs across ranks \(rank 0: oneshot; rank 1: mpi\): set it "
                                 "the same on every host"),
])
def test_a_job_parameter_set_on_one_host_only_stops_every_rank_naming_it(variable, value, message):
    # MPMD: rank 1 alone gets the variable, as when one node's environment differs. Before, with a bad value
    # that rank exited alone before MPI_Init and rank 0 waited in MPI for it until the test's 120 s ran out.
    with launch_env() as env:
        for name in (*SETTINGS, "HPCJOBS_TIMEOUT", "HPCJOBS_STALL_WARNING", "HPCJOBS_TUNING"):  # rank 0 as it comes
            env.pop(name, None)
        exe, *over, _, _, python = _mpirun_prefix(1)
        job = ["-m", "hpcjobs", "soak", "--ops", "50"]
        out = run([exe, *over, "-n", "1", python, *job, ":", "-n", "1", "-x", f"{variable}={value}", python, *job],
                  120, env)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if variable in line]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert re.fullmatch(f"hpcjobs soak: error: {message}", lines[0]), lines
    assert "allreduces" not in out.stdout  # nothing ran


def test_a_tuning_file_one_rank_cannot_read_stops_every_rank_naming_it(tmp_path):
    """MPMD: rank 1's --tuning path is missing (the file on rank 0's host
    only). It was refused on rank 1 alone, silently (only rank 0 prints a
    usage error), and rank 0 waited in its next collective."""
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"version": 1, "tables": [{"ranks": 2, "nodes": 1, "rows": [
        {"max_bytes": None, "algorithm": "ring"}]}]}))
    with launch_env() as env:
        env.pop("HPCJOBS_TUNING", None)
        exe, *over, _, _, python = _mpirun_prefix(1)
        job = ["-m", "hpcjobs", "bench", "allreduce", "--impl", "auto", "-e", "64", "--tuning"]
        out = run([exe, *over, "-n", "1", python, *job, str(table), ":", "-n", "1", python, *job,
                   str(tmp_path / "missing.json")], 120, env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: rank 1: cannot read tuning table {tmp_path / 'missing.json'}" in out.stderr, out.stderr[-2000:]
    assert "size(B)" not in out.stdout  # nothing was measured


def test_expected_world_size_mismatch_aborts_the_job():
    out = _mpirun(2, "info", env={"HPCJOBS_EXPECT_WORLD_SIZE": "5"}, timeout=60)
    assert out.returncode != 0
    assert "MPI world size is 2 but HPCJOBS_EXPECT_WORLD_SIZE=5" in out.stderr
    # given 2 on one rank and 3 on the other: the rank it fitted waited for the other in MPI, for good
    *mpirun, n, one, python = _mpirun_prefix(1)
    with launch_env({}) as e:
        split = run([*mpirun, n, one, "-x", "HPCJOBS_EXPECT_WORLD_SIZE=2", python, "-m", "hpcjobs", "info", ":",
                     n, one, "-x", "HPCJOBS_EXPECT_WORLD_SIZE=3", python, "-m", "hpcjobs", "info"], 60, e)
    assert split.returncode == 2 and "MPI world size is 2 but HPCJOBS_EXPECT_WORLD_SIZE=3" in split.stderr, \
        split.stderr[-2000:]


def test_info_names_every_rank(tmp_path):
    out = _mpirun(3, "info", "--all-ranks", env={"HPCJOBS_TUNING": ""})
    assert out.returncode == 0, out.stderr
    assert "ranks: 3" in out.stdout
    assert [l.split()[:4] for l in out.stdout.splitlines() if l.startswith("rank ")] == [
        ["rank", str(r), "of", "3"] for r in range(3)]
    # auto's tuning table, which must be the same on every rank: built in, or the file and what it holds
    assert [l.rsplit(", ", 1)[1] for l in out.stdout.splitlines() if l.startswith("rank ")] == ["tuning built in"] * 3
    alone = _mpirun(3, "info", env={"HPCJOBS_TUNING": ""})  # without --all-ranks: rank 0's line, as its help says
    assert [l.split()[:4] for l in alone.stdout.splitlines() if l.startswith("rank ")] == [["rank", "0", "of", "3"]]
    # the install, which every rank compares as MPI starts
    assert [l.rsplit(", ", 2)[1] for l in out.stdout.splitlines() if l.startswith("rank ")] == [
        f"hpcjobs {install()[0]}"] * 3
    table = tmp_path / "t.json"
    table.write_text(json.dumps(DEFAULT_TABLE))
    out = _mpirun(2, "info", "--all-ranks", env={"HPCJOBS_TUNING": str(table)})
    assert out.returncode == 0, out.stderr
    digest = hashlib.sha256(table.read_bytes()).hexdigest()[:12]
    assert [l.rsplit(", ", 1)[1] for l in out.stdout.splitlines() if l.startswith("rank ")] == [
        f"tuning {table} (sha256 {digest})"] * 2


def test_bench_report_with_gloo_and_bad_baselines(tmp_path):
    out = _mpirun(2, "bench", "allreduce", "-b", "8", "-e", "4K", "-f", "16", "--iters", "2",
                  "--impl", "ring,recursive_doubling", "--baselines", "mpi,gloo,nccl",
                  "--out", str(tmp_path / "rep"), "--csv", str(tmp_path / "r.csv"))
    assert out.returncode == 0, out.stderr
    assert "# nccl: skipped: " in out.stdout
    rows = [l.split() for l in out.stdout.splitlines() if l and not l.startswith("#")]
    assert {r[4] for r in rows} == {"ring", "recursive_doubling", "mpi", "gloo"}
    assert all(r[-1] == "0" for r in rows)
    for name in ("report.md", "busbw.png", "latency.png", "records.json", "records.csv"):
        assert (tmp_path / "rep" / name).stat().st_size > 0, name
    assert (tmp_path / "rep" / "busbw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "gloo" in report
    # what was asked for and not run, and the verdicts, are in the saved records too (they were printed only)
    env = json.loads((tmp_path / "rep" / "records.json").read_text())["environment"]
    assert env["skipped"].startswith("nccl: no CUDA GPU is visible here") and f"- skipped: {env['skipped']}" in report
    verdicts = [l[2:] for l in out.stdout.splitlines() if l.startswith("# our best vs ")]
    assert [v.split(" (")[0] for v in verdicts] == ["our best vs mpi", "our best vs gloo"], out.stdout
    assert env["verdicts"] == verdicts and "## Verdicts\n\n" + "\n".join(f"- {v}" for v in verdicts) in report
    assert (tmp_path / "r.csv").read_text().splitlines()[0].startswith("size_bytes,count,dtype,op,impl")
    bad = _mpirun(2, "bench", "allreduce", "--baselines", "mpi,mkl")
    assert bad.returncode == 2 and "unknown baseline 'mkl'" in bad.stderr


def test_without_matplotlib_the_reports_are_written_without_plots_and_say_so(tmp_path):
    # matplotlib is an optional extra: a run that measured for minutes must not end in a traceback at its plots
    stub = tmp_path / "stub" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = {"PYTHONPATH": f"{tmp_path / 'stub'}:{os.environ.get('PYTHONPATH', '')}"}
    out = _mpirun(2, "bench", "allreduce", "-b", "8", "-e", "64", "-f", "8", "--iters", "2", "--impl", "ring",
                  "--baselines", "mpi", "--out", str(tmp_path / "rep"), env=env)
    assert out.returncode == 0, out.stderr
    assert "no plots: matplotlib is not installed" in out.stdout
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["records.csv", "records.json", "report.md"]
    assert "No plots: matplotlib is not installed" in (tmp_path / "rep" / "report.md").read_text()
    with launch_env(env) as e:
        plan = run([sys.executable, "-m", "hpcjobs", "plan", "--params", "25.6M", "--throughput", "400",
                    "--batch-per-device", "64", "--devices-per-node", "8", "--intra-bw", "100",
                    "--devices", "1,2", "--plot", str(tmp_path / "p.png")], 60, e)
    assert plan.returncode == 0 and "plot: matplotlib is not installed" in plan.stderr, plan.stderr
    assert not (tmp_path / "p.png").exists()


def test_tune_writes_a_table_that_auto_then_reads(tmp_path):
    table = tmp_path / "tuning.json"
    out = _mpirun(2, "tune", "-b", "8", "-e", "64K", "-f", "8", "--iters", "3", "--out", str(table))
    assert out.returncode == 0, out.stderr
    data = json.loads(table.read_text())
    (t,) = data["tables"]
    assert (t["ranks"], t["nodes"]) == (2, 1) and t["rows"][-1]["max_bytes"] is None
    # On one node hierarchical is the ring: not timed, never a contender.
    assert "2 ranks on 1 node(s); 8 algorithms x 5 sizes x 3 passes" in out.stdout
    assert "# left out: hierarchical: on one node it is its intra-node stage, the ring" in out.stdout
    assert all("hierarchical" not in r["candidates"] for r in t["rows"]), t["rows"]
    used = _mpirun(2, "bench", "allreduce", "-b", "8", "-e", "64K", "-f", "8", "--iters", "2",
                   "--impl", "auto,recursive_doubling,tree", "--tuning", str(table))
    assert used.returncode == 0, used.stderr
    assert re.search(r"^# auto vs the best of ours: within 10% at [0-5] of 5 sizes; worst \d+\.\d\dx at \w+ "
                     r"\((recursive_doubling|tree)\)$", used.stdout, re.M), used.stdout
    # What auto ran, per run of sizes, covering the sweep: "8-512 recursive_doubling, 4K-32K shm".
    (summary,) = [l.removeprefix("# auto kept: ") for l in used.stdout.splitlines() if l.startswith("# auto kept: ")]
    spans = [part.split(" ") for part in summary.split(", ")]
    assert all(name in ALGORITHMS for _, name in spans), summary
    assert spans[0][0].startswith("8") and spans[-1][0].endswith("32K"), summary
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    bad = _mpirun(2, "bench", "allreduce", "--impl", "auto", "--tuning", str(broken))
    assert bad.returncode == 2 and "has no 'tables'" in bad.stderr


def test_model_fits_predicts_and_counts_bytes(tmp_path):
    out = _mpirun(2, "model", "-b", "1M", "-e", "4M", "-f", "4", "--iters", "3", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "alpha =" in out.stdout and "gamma =" in out.stdout
    assert out.stdout.count("(matches)") == 6
    data = json.loads((tmp_path / "model.json").read_text())
    assert {r["algorithm"] for r in data["rows"]} == {"ring", "recursive_doubling", "rabenseifner", "tree",
                                                       "parameter_server"}
    assert all(r["predicted_us"] > 0 for r in data["rows"])
    assert (tmp_path / "model.png").exists()
    one = _mpirun(1, "model")
    assert one.returncode == 2 and "at least 2 ranks" in one.stderr


def test_model_on_simulated_nodes_says_so_in_its_file_and_plan_warns(tmp_path):
    """--ranks-per-node simulates nodes on one machine: the model.json's link "between nodes" is shared memory,
    and plan took it for a network without a word."""
    out = _mpirun(2, "model", "-b", "64K", "-e", "64K", "--iters", "2", "--ranks-per-node", "1", "--out",
                  str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "no row of 1 MB or more to sum up" in out.stdout  # (a heading over an empty table before)
    assert json.loads((tmp_path / "model.json").read_text())["topology_source"] == "override"
    plan = _hpcjobs("plan", "--params", "1M", "--throughput", "100", "--batch-per-device", "8", "--devices", "1,2",
                    "--cost-model", str(tmp_path / "model.json"))
    assert plan.returncode == 0 and "measured with --ranks-per-node on one machine" in plan.stderr, plan.stderr
    uneven = _mpirun(3, "model", "--ranks-per-node", "2")
    assert uneven.returncode == 2 and "these have [2, 1]: give a --ranks-per-node that divides the 3 ranks" in \
        uneven.stderr, uneven.stderr


def test_topology_prints_the_simulated_layout():
    out = _mpirun(5, "topology", "--ranks-per-node", "2")
    assert out.returncode == 0, out.stderr
    assert "5 ranks on 3 node(s) [2, 2, 1], source: override" in out.stdout


def test_auto_alone_is_timed_at_once_not_after_settling():
    """One rank reduces nothing, so auto never settles there: the benchmarks
    waited for it forever (bench allreduce --impl auto alone spun until
    killed; bench compression too)."""
    out = _hpcjobs("bench", "allreduce", "--impl", "auto", "--max", "64")
    assert out.returncode == 0 and "#wrong" in out.stdout, out.stderr
    out = _hpcjobs("bench", "compression", "--elements", "1000", "--iters", "2", "--compressors", "fp16",
                  "--no-progress")
    assert out.returncode == 0 and "fp32 auto" in out.stdout, out.stderr


def test_a_refusal_made_on_one_rank_alone_aborts_the_job_saying_so():
    """The ranks meet after a refusal, so that none leaves before rank 0 said it. A refusal made on rank 1 only
    (a check of that process's own) while rank 0 went on into a collective must not wait for rank 0 for good:
    rank 1 says what it refused and aborts the job, after the meeting's bound (10 s)."""
    r = mpirun_script(2, """
import sys
from mpi4py import MPI
import hpcjobs.cli.info as info
from hpcjobs.cli import main
from hpcjobs.cli.args import UsageError

def run(args):
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise UsageError("refused on rank 1 alone (a test)")
    MPI.COMM_WORLD.Barrier()  # rank 0 went on: it waits here for rank 1
    return 0

info.run = run
sys.exit(main(["info"]))
""", timeout=90)
    assert r.returncode != 0, r.stdout + r.stderr
    assert ("hpcjobs: rank 1: hpcjobs info: error: refused on rank 1 alone (a test); some ranks did not refuse it: "
            "aborting the job") in r.stderr, r.stderr



@pytest.mark.parametrize("command,flag,words", [
    (["plan", "--params", "1M", "--throughput", "10"], "--json", "give a path, or /dev/stdout"),
    (["plan-check"], "--json", "give a path, or /dev/stdout"),
])
def test_a_dash_for_an_output_is_refused_not_made_a_file_named_dash(tmp_path, monkeypatch, command, flag, words):
    """`plan --json -` wrote a file named "-" in the working directory and printed the table (train's
    --metrics - is standard output; these outputs are files)."""
    monkeypatch.chdir(tmp_path)
    out = hpcjobs_here(*command, flag, "-")
    assert out.returncode == 2 and f"{flag} -: " in out.stderr and words in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == [] and "| devices |" not in out.stdout


def test_a_dash_for_an_output_directory_is_refused_before_anything_is_measured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = _mpirun(2, "bench", "allreduce", "-e", "64", "--out", "-")
    assert out.returncode == 2 and '--out -: would be a directory named "-" here' in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == [] and "size(B)" not in out.stdout


def test_a_command_run_without_mpirun_starts_mpi_with_no_shared_memory_file():
    """Open MPI 5 left a 16 MiB /dev/shm/sm_segment.* file behind every singleton start (open-mpi/ompi#13261):
    a command run without mpirun starts with the loopback transport alone (a launched rank keeps its own, as
    every mpirun test here shows). Asked of the process's own mappings: another job's files may come and go."""
    maps = "any('/sm_segment.' in line for line in open('/proc/self/maps'))"
    code = (f"import os, hpcjobs.cli as cli\ncli._start_mpi()\nprint({maps}, 'OMPI_MCA_btl' in os.environ)\n"
            f"from mpi4py import MPI\nprint(MPI.COMM_WORLD.Get_size())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env())
    assert out.returncode == 0 and out.stdout.split() == ["False", "False", "1"], out.stdout + out.stderr
