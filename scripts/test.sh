#!/usr/bin/env bash
# The test suite: pytest serially (one process, MPI as a singleton), then
# under real MPI with 2, 3, 4 and 5 ranks. Creates .venv and installs everything
# on first use. Each MPI run is killed after HPCJOBS_TEST_TIMEOUT seconds
# (default 900), the serial run after HPCJOBS_SERIAL_TIMEOUT (default three
# times that: it brings up the emulated cluster and runs every Slurm job, about
# 25 minutes on 2 cores), so a hang fails instead of stalling.
#
#   scripts/test.sh                 # everything
#   scripts/test.sh -k ring         # extra args go to every pytest run
#   scripts/test.sh tests/test_planner.py   # paths: those, not all of tests/
#   HPCJOBS_TEST_SIZES="2 5" scripts/test.sh
#
# With extra args, a stage they leave no test in (pytest's exit 5: an MPI
# stage for serial tests only, say) is not a failure.
#
# The serial run includes tests/cluster and tests/slurm, which bring up an
# emulated cluster of 3 hosts (scripts/emulated_cluster.sh: network
# namespaces, as root) and a real Slurm across it (installed with apt-get),
# run the suite across hosts and submit every template; where that cannot be
# done they skip with the reason, unless HPCJOBS_REQUIRE_CLUSTER=1 and
# HPCJOBS_REQUIRE_SLURM=1 (CI sets both).
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
source "$(dirname "$0")/lib.sh"
ensure_venv || exit 1
setup_mpi_env
cd "$ROOT"

logs=$ROOT/.test-logs
rm -rf "$logs"; mkdir -p "$logs"

# The Horovod baseline: built once (about 5 minutes on 2 cores), then a cached wheel.
# Without it its tests skip with the reason, unless HPCJOBS_REQUIRE_HOROVOD=1.
say "Horovod 0.28.1: installing (a first build takes about 5 minutes; log: .test-logs/horovod-build.log)"
if ! scripts/install_horovod.sh >"$logs/horovod-build.log" 2>&1; then
    export HPCJOBS_HOROVOD_UNAVAILABLE="scripts/install_horovod.sh failed: $(grep -a '\[hpcjobs\]' "$logs/horovod-build.log" | tail -n 1)"
    say "Horovod unavailable: $HPCJOBS_HOROVOD_UNAVAILABLE (log: .test-logs/horovod-build.log)"
    if [ "${HPCJOBS_REQUIRE_HOROVOD:-0}" = 1 ]; then
        tail -n 30 "$logs/horovod-build.log" >&2
        say "HPCJOBS_REQUIRE_HOROVOD=1: failing"
        exit 1
    fi
else
    say "Horovod: $(grep -a 'ready' "$logs/horovod-build.log" | tail -n 1)"
fi
timeout_s=${HPCJOBS_TEST_TIMEOUT:-900}
serial_timeout_s=${HPCJOBS_SERIAL_TIMEOUT:-$((3 * timeout_s))}  # twice was 30 min: a busy machine's serial run hit it
pytest_args=(-p no:cacheprovider -q -rfE --color=no "$@")
# what to collect: tests/, unless a path is given (tests/x.py, tests/x.py::test_y)
targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then targets=(); break; fi
done
# pytest's "no tests collected": a failure without extra args, a stage they select nothing in with them
no_tests_ok() { [ "$1" = 5 ] && [ "$2" -gt 0 ]; }
status=0
summaries=()

# The last pytest summary line of a log, e.g. "1208 passed, 176 skipped in 34.3s".
summary_of() { grep -aE '^[=]* *[0-9]+ (passed|failed|error|skipped)' "$1" | tail -n 1 | sed 's/=//g; s/^ *//'; }

# Each run goes to the background and is waited for: `timeout` puts itself in a process group of its own,
# so Ctrl-C (or CI's SIGTERM) reached only this script and tee, and the script waited on, for the run it
# could not stop. The trap stops the run, and as root takes down what its fixtures brought up.
running="" fifo="" serial=""
# The emulated cluster, taken down after the serial stage was stopped or timed out (its fixtures may not have):
# only where no live session holds its lock (tests/emulated.py), so never under another session's tests, and
# never after an mpirun stage, which does not use it (a cluster brought up by hand stays).
cluster_down() {
    if [ "$(id -u)" = 0 ] && [ -n "$serial" ]; then
        scripts/emulated_cluster.sh down >/dev/null 2>&1  # refused where a session holds the cluster's lock
    else
        return 1
    fi
}
stop_run() {
    say "interrupted: stopping the run and what it started"
    if [ -n "$running" ]; then
        kill -TERM "$running" 2>/dev/null  # timeout passes it on to pytest (which tears down) or mpirun
        wait 2>/dev/null
    fi
    [ -z "$fifo" ] || rm -f "$fifo"
    cluster_down || true
    exit "$1"
}
trap 'stop_run 130' INT
trap 'stop_run 143' TERM

# run_logged LOG SECONDS CMD...: CMD under timeout, its output on stdout and in LOG; CMD's exit code. Through
# a fifo, so that tee is this shell's child and waited for before the log is read.
run_logged() {
    local log=$1 limit=$2 tee_pid rc
    shift 2
    fifo=$(mktemp -u "${TMPDIR:-/tmp}/hpcjobs-test-fifo.XXXXXX")  # global: the trap removes it
    mkfifo "$fifo" || return 1
    tee "$log" <"$fifo" &
    tee_pid=$!
    timeout -k 60 "$limit" "$@" >"$fifo" 2>&1 &  # a minute for pytest's teardown (tests/conftest.py) after TERM
    running=$!
    wait "$running"
    rc=$?
    running=""
    wait "$tee_pid"
    rm -f "$fifo"
    return "$rc"
}

say "serial: pytest --with-mpi (1 process)"
serial=1
run_logged "$logs/serial.log" "$serial_timeout_s" python -m pytest --with-mpi "${pytest_args[@]}" \
    ${targets[@]+"${targets[@]}"}
rc=$?
if no_tests_ok "$rc" $#; then say "serial: no test selected"; rc=0; fi
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    say "serial pytest timed out after ${serial_timeout_s}s (HPCJOBS_SERIAL_TIMEOUT)"
    # killed, its fixtures may not have torn down: the emulated hosts, their Slurm daemons and /etc/hosts lines
    if cluster_down; then say "emulated cluster taken down"; fi
fi
serial=""
[ "$rc" = 0 ] || status=1
summaries+=("serial: $(summary_of "$logs/serial.log") (exit $rc)")

# Under mpirun only the MPI-marked tests run (-m mpi): the serial ones
# already ran above and would only run again P times. Rank 0 prints; the
# other ranks write .test-logs/np<P>-rank<r>.log, shown if they fail.
mpirun_cmd
for n in ${HPCJOBS_TEST_SIZES:-2 3 4 5}; do
    say "mpirun -n $n: pytest --with-mpi -m mpi"
    clean_stale_mpi_sessions  # any a killed launch of the run before left
    HPCJOBS_RANK_LOG="$logs/np$n" run_logged "$logs/np$n.log" "$timeout_s" \
        "${MPIRUN[@]}" -n "$n" scripts/rank_pytest.sh --with-mpi -m mpi "${pytest_args[@]}" \
        ${targets[@]+"${targets[@]}"}
    rc=$?
    selected=""
    if no_tests_ok "$rc" $#; then say "mpirun -n $n: no MPI test selected"; rc=0; selected="no MPI test selected"; fi
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        say "mpirun -n $n timed out after ${timeout_s}s"
    fi
    if [ "$rc" != 0 ]; then
        status=1
        for f in "$logs"/np$n-rank*.log; do
            [ -f "$f" ] || continue
            case "$(summary_of "$f")" in *failed*|*error*|"") say "---- $(basename "$f") ----"; tail -n 40 "$f" ;; esac
        done
    fi
    summaries+=("mpirun -n $n: $(summary_of "$logs/np$n.log")$selected (exit $rc)")
done

echo
if [ -f "$logs/slurm-jobs.txt" ]; then
    echo "==== Slurm template jobs (tests/slurm, emulated cluster: 2 hosts x 2 tasks) ===="
    cat "$logs/slurm-jobs.txt"
fi
echo "==== hpcjobs test summary ===="
printf '%s\n' "${summaries[@]}"
python - "$logs" <<'PY'
import re, sys, pathlib
logs = pathlib.Path(sys.argv[1])
totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
sizes = sorted(int(m.group(1)) for p in logs.glob("np*.log") if (m := re.fullmatch(r"np(\d+)\.log", p.name)))
for name in ["serial.log"] + [f"np{n}.log" for n in sizes]:  # np10.log too; not the np<P>-rank<r>.log files
    lines = [l for l in (logs / name).read_text(errors="replace").splitlines()
             if re.match(r"^=* *\d+ (passed|failed|error|skipped)", l)]
    if not lines:
        if re.search(r"^=* *(no tests ran|\d+ deselected)", (logs / name).read_text(errors="replace"), re.M):
            continue  # extra args left no test in this stage (pytest's exit 5)
        totals["error"] += 1  # a run that never reached its summary (crash, timeout)
        continue
    if re.search(r"^E?\s*KeyboardInterrupt|^!+ KeyboardInterrupt", (logs / name).read_text(errors="replace"), re.M):
        totals["error"] += 1  # stopped (a timeout's or Ctrl-C's SIGTERM, tests/conftest.py): its summary is partial
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1]):
        totals["error" if word.startswith("error") else word] += int(n)
failed = totals["failed"] + totals["error"]
print(f"total: {totals['passed']} passed, {failed} failed, {totals['skipped']} skipped")
if not totals["passed"] + failed + totals["skipped"]:  # every stage selected nothing (a -k typo, say)
    print("no test ran in any stage: that is a failure")
    sys.exit(1)
PY
[ $? = 0 ] || status=1
exit $status
