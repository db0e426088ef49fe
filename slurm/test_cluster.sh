#!/usr/bin/env bash
# A real two-node SLURM (Debian's slurm 22.05) on this one machine, for tests/slurm.
#
#   slurm/test_cluster.sh start   install if missing, configure, start; idempotent (~2 s warm)
#   slurm/test_cluster.sh stop    stop the daemons this script started (by their pid files)
#   slurm/test_cluster.sh status
#
# Two slurmd (-N n1, -N n2) on one host, because SLURM places a multi-node job only on
# distinct nodes; each node declares 8 CPUs (oversubscribing the real cores is fine for
# tests) and 4 fake GPUs: gres needs character devices, so they are mknod'ed copies of
# /dev/null. No systemd here: munged, slurmctld and slurmd are started by hand, as root.
set -euo pipefail

CONF_DIR=/etc/slurm
RUN_DIR=/run/areal-slurm          # pid files of what this script started
LOG_DIR=/var/log/slurm
HOST=$(hostname -s)
NODES=(n1 n2)

need_root() {
    if [ "$(id -u)" != 0 ]; then
        echo "test_cluster.sh must run as root (it installs packages and starts daemons)" >&2
        exit 1
    fi
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install() {
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sinfo >/dev/null || ! command -v munged >/dev/null; then
        echo "test_cluster: installing Debian's slurm packages"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client munge >/dev/null
    fi
}

configure() {
    mkdir -p "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
    for i in 0 1 2 3; do
        [ -c /dev/areal-fake-gpu$i ] || mknod /dev/areal-fake-gpu$i c 1 3
    done
    cat >"$CONF_DIR/slurm.conf.new" <<CONF
# Written by slurm/test_cluster.sh: a test cluster of two nodes on one host.
ClusterName=areal-test
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Without a short backfill interval a job can wait ~30 s for a scheduling pass.
SchedulerParameters=bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
# Declared CPUs exceed the real cores on purpose; take the config's word for it.
SlurmdParameters=config_overrides
# scancel: SIGTERM, then SIGKILL after this many seconds.
KillWait=5
GresTypes=gpu
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=6818 CPUs=8 Gres=gpu:4 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=6819 CPUs=8 Gres=gpu:4 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
    cat >"$CONF_DIR/gres.conf.new" <<CONF
NodeName=n1 Name=gpu File=/dev/areal-fake-gpu[0-3]
NodeName=n2 Name=gpu File=/dev/areal-fake-gpu[0-3]
CONF
    CHANGED=0
    for f in slurm.conf gres.conf; do
        if ! cmp -s "$CONF_DIR/$f.new" "$CONF_DIR/$f"; then
            mv "$CONF_DIR/$f.new" "$CONF_DIR/$f"
            CHANGED=1
        else
            rm "$CONF_DIR/$f.new"
        fi
    done
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    [ -f /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    su -s /bin/sh munge -c "munged --pid-file=/run/munge/munged.pid"
    cp /run/munge/munged.pid "$RUN_DIR/munged.pid"
}

start() {
    need_root
    install
    configure
    start_munge
    if [ "$CHANGED" = 1 ]; then
        stop_daemons  # a new configuration needs fresh daemons
    fi
    alive "$RUN_DIR/slurmctld.pid" || slurmctld -i
    for n in "${NODES[@]}"; do
        alive "$RUN_DIR/slurmd-$n.pid" || slurmd -N "$n"
    done
    # Ready when both nodes answer as idle (or busy with leftover test jobs).
    for _ in $(seq 100); do
        if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)$')" = 2 ]; then
            sinfo -N
            return
        fi
        sleep 0.1
    done
    echo "test_cluster: nodes not ready after 10 s:" >&2
    sinfo -N >&2 || true
    exit 1
}

stop_daemons() {
    for f in "$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmctld.pid"; do
        if alive "$f"; then
            pid=$(cat "$f")
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$f"
    done
}

stop() {
    need_root
    stop_daemons
    if alive "$RUN_DIR/munged.pid"; then
        kill "$(cat "$RUN_DIR/munged.pid")"
    fi
    rm -f "$RUN_DIR/munged.pid"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) sinfo -N ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
