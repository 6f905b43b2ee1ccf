#!/usr/bin/env bash
# A real single-host Slurm cluster with N fake nodes, for the template tests.
#
#   scripts/local_slurm.sh start [N]   # install if needed (root, Debian), start munged, slurmctld, N slurmd
#   scripts/local_slurm.sh status      # sinfo
#   scripts/local_slurm.sh stop        # stop the daemons (by the PIDs in their pid files)
#   scripts/local_slurm.sh env         # print `export SLURM_CONF=...` for your shell
#
# Everything lives in $HPCJOBS_SLURM_DIR (default /tmp/hpcjobs-slurm): slurm.conf,
# logs, pid files, spool and tmp directories per node. Clients find the cluster
# through SLURM_CONF, so the host's /etc/slurm is never touched. Each fake node
# is one `slurmd -N nX` on its own port, all on 127.0.0.1; they share the host's
# name, which is why hpcjobs identifies nodes by SLURM_NODEID, not hostname.
set -euo pipefail

DIR=${HPCJOBS_SLURM_DIR:-/tmp/hpcjobs-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=${HPCJOBS_SLURM_PORT:-16817}
NODE_PORT0=$((CTLD_PORT + 100))
SLURM_CPUS=${HPCJOBS_SLURM_CPUS:-4}
PMIX_LIB=/usr/lib/x86_64-linux-gnu/pmix2/lib

say() { printf '[local_slurm] %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

install_slurm() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "Slurm is not installed and installing it needs root (apt-get)"
    command -v apt-get >/dev/null || die "Slurm is not installed and this is not a Debian/Ubuntu system"
    say "installing slurmctld, slurmd, slurm-client, munge, libpmix2 (apt-get --no-install-recommends)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge libpmix2 >/dev/null
}

fix_pmix() {
    # Slurm's mpi/pmix plugin dlopens libpmix.so, which only libpmix-dev ships.
    if [ -e "$PMIX_LIB/libpmix.so.2" ] && [ ! -e "$PMIX_LIB/libpmix.so" ]; then
        if [ -w "$PMIX_LIB" ]; then
            ln -s libpmix.so.2 "$PMIX_LIB/libpmix.so"
        else
            say "warning: no $PMIX_LIB/libpmix.so and no permission to link it; srun --mpi=pmix will fail"
        fi
    fi
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    [ -s /etc/munge/munge.key ] || { say "creating /etc/munge/munge.key"; mungekey --create --force 2>/dev/null \
        || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged did not come up"
}

# The slurm.conf lines both test clusters share (this one and
# emulated_cluster.sh's): slurm_common_conf DIR CTLD_HOST CTLD_PORT [CTLD_ADDR].
slurm_common_conf() {
    local dir=$1 host=$2 port=$3 addr=${4:-}
    cat <<EOF
# Written by scripts/$(basename "$0"): a test cluster; state, logs and pid files in $dir.
ClusterName=hpcjobs
SlurmctldHost=$host${addr:+($addr)}
SlurmctldPort=$port
SlurmUser=root
AuthType=auth/munge
# A requeued job runs again cred_expire seconds after it ended (sooner, Slurm kills it: "Job credential
# revoked"): 120 by default, 30 here, so a test's requeue does not wait two minutes. It is also how long a
# launch credential lasts: not lower, on a loaded 2-core machine.
AuthInfo=cred_expire=30
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
TmpFS=$dir/tmp/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
MailProg=/bin/true
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
EOF
}

write_conf() {
    local n=$1 i
    mkdir -p "$DIR/state"
    {
        slurm_common_conf "$DIR" localhost "$CTLD_PORT"
        for i in $(seq 1 "$n"); do
            echo "NodeName=n$i NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((NODE_PORT0 + i)) CPUs=$SLURM_CPUS RealMemory=2000 State=UNKNOWN"
            mkdir -p "$DIR/spool/n$i" "$DIR/tmp/n$i"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

cmd_start() {
    local n=${1:-2} i
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "node count must be a positive integer, got '$n'"
    if pid_alive "$DIR/slurmctld.pid"; then
        say "already running ($CONF)"; cmd_wait_idle "$n"; return 0
    fi
    install_slurm
    fix_pmix
    start_munge
    mkdir -p "$DIR"
    write_conf "$n"
    export SLURM_CONF=$CONF
    slurmctld -f "$CONF" -c   # -c: a clean start, no state from an earlier run
    for i in $(seq 1 "$n"); do
        slurmd -f "$CONF" -N "n$i"
    done
    cmd_wait_idle "$n"
    say "up: $n nodes; export SLURM_CONF=$CONF"
}

# wait_idle N LOGDIR [CLIENT...]: N nodes idle within 30 s, asking through
# CLIENT (e.g. the emulated cluster's "run inside h1"), with SLURM_CONF set.
wait_idle() {
    local n=$1 logs=$2 idle
    shift 2
    for _ in $(seq 150); do
        # slurmctld may not answer yet: under pipefail a failing sinfo must not end the script here
        idle=$("$@" sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle" {c++} END {print c + 0}') || idle=0
        [ "$idle" -ge "$n" ] && return 0
        sleep 0.2
    done
    "$@" sinfo -N >&2 || true
    die "the nodes did not come up idle in 30 s; see $logs/*.log"
}

cmd_wait_idle() {
    export SLURM_CONF=$CONF
    wait_idle "$1" "$DIR"
}

cmd_stop() {
    local f
    for f in "$DIR"/slurmd.*.pid "$DIR"/slurmctld.pid; do
        [ -e "$f" ] || continue
        if pid_alive "$f"; then kill "$(cat "$f")"; fi
    done
    for f in "$DIR"/slurmd.*.pid "$DIR"/slurmctld.pid; do
        [ -e "$f" ] || continue
        for _ in $(seq 50); do pid_alive "$f" || break; sleep 0.1; done
        rm -f "$f"
    done
    say "stopped"
}

# Sourced (by emulated_cluster.sh) for its functions only.
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0

case "${1:-}" in
    start) shift; cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) pid_alive "$DIR/slurmctld.pid" || die "not running"; SLURM_CONF=$CONF sinfo -N ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start [N] | stop | status | env" >&2; exit 2 ;;
esac
