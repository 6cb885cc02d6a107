#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (Debian's slurmd, slurmctld, slurm-client and
# munge), for the tests that start Shardline jobs with `srun` (tests/tests/slurm.rs).
#
# Run as root. Idempotent: installs the packages only when missing, rewrites the
# configuration only when it changed (restarting the daemons then), starts only the daemons
# that are not running, and returns once the node accepts jobs (or fails, with the logs).
# Needs no systemd: the daemons are started directly (as in a container).
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
    echo "slurm-cluster.sh: must run as root" >&2
    exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # The packages' post-install scripts would start the daemons through systemd or
    # sysvinit; this script starts them itself.
    apt-get install -y -qq --no-install-recommends slurmd slurmctld slurm-client munge >/dev/null
fi

node=$(hostname -s)
cpus=$(nproc)
conf_dir=/etc/slurm
mkdir -p "$conf_dir" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge

# The node name must resolve: slurmd finds its node by it, and a job's first node (this
# one) is where Shardline's Slurm workers look for the store of rank 0.
if ! getent hosts "$node" >/dev/null; then
    echo "slurm-cluster.sh: host name $node does not resolve; adding it to /etc/hosts"
    echo "127.0.0.1 $node" >>/etc/hosts
fi

conf=$(cat <<CONF
ClusterName=shardline-ci
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
NodeName=$node CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 State=UNKNOWN
PartitionName=main Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
)
changed=0
if [ ! -f "$conf_dir/slurm.conf" ] || [ "$(cat "$conf_dir/slurm.conf")" != "$conf" ]; then
    printf '%s\n' "$conf" >"$conf_dir/slurm.conf"
    changed=1
fi

if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key

# Whether the daemon of pid file $1 runs (an exited one not yet reaped does not).
running() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ -r "/proc/$pid/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status"
}

if ! running /run/munge/munged.pid; then
    su -s /bin/sh munge -c /usr/sbin/munged
fi
if [ "$changed" -eq 1 ]; then
    for pid_file in /run/slurmd.pid /run/slurmctld.pid; do
        if running "$pid_file"; then
            kill "$(cat "$pid_file")"
            for _ in $(seq 1 100); do
                running "$pid_file" || break
                sleep 0.1
            done
            if running "$pid_file"; then kill -9 "$(cat "$pid_file")"; fi
        fi
    done
fi
running /run/slurmctld.pid || /usr/sbin/slurmctld
running /run/slurmd.pid || /usr/sbin/slurmd

# Wait until the node takes jobs.
for _ in $(seq 1 120); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
    case "$state" in
        idle* | mixed* | allocated*) break ;;
        drain* | down*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
done
case "$state" in
    idle* | mixed* | allocated*) ;;
    *)
        echo "slurm-cluster.sh: node $node is not ready (state: ${state:-unknown})" >&2
        tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
        exit 1
        ;;
esac
sinfo
