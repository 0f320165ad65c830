#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for tests and for trying the sbatch scripts:
#
#   scripts/slurm/local_cluster.sh start     # munged + slurmctld + slurmd, waits until the node is idle
#   export SLURM_CONF=/tmp/megalite-slurm/etc/slurm.conf
#   sbatch --wait scripts/slurm/pretrain_gpt.sbatch --train-iters 5
#   scripts/slurm/local_cluster.sh stop      # cancels jobs, stops the daemons; safe to repeat
#
# Everything (config, munge key and socket, spool and state dirs, pid files, logs) lives in one
# state dir, MEGALITE_SLURM_DIR (default /tmp/megalite-slurm), so nothing under /etc or /run is
# touched and a system Slurm, if any, is left alone. Needs slurm-wlm and munge (.ci/setup_slurm.sh).
# Tested as root; as another user the daemons run as that user.
set -euo pipefail

STATE=${MEGALITE_SLURM_DIR:-/tmp/megalite-slurm}
# Not Slurm's default ports 6817/6818, so a system Slurm on the same machine does not clash.
CTLD_PORT=${MEGALITE_SLURMCTLD_PORT:-16817}
SLURMD_PORT=${MEGALITE_SLURMD_PORT:-16818}
START_TIMEOUT=${MEGALITE_SLURM_START_TIMEOUT:-60}

CONF=$STATE/etc/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket
NODE=$(hostname -s)
export SLURM_CONF=$CONF

log() { echo "local_cluster: $*" >&2; }

. "$(dirname "${BASH_SOURCE[0]}")/cluster_common.sh"

write_config() {
  prepare_state_dir
  {
    echo "# Written by scripts/slurm/local_cluster.sh: one node, no accounting, no cgroups."
    echo "ClusterName=megalite-local"
    echo "SlurmctldHost=$NODE(127.0.0.1)"
    echo "SlurmctldPort=$CTLD_PORT"
    echo "SlurmdPort=$SLURMD_PORT"
    common_slurm_conf
    echo "SlurmdSpoolDir=$STATE/spool"
    echo "SlurmdPidFile=$STATE/run/slurmd.pid"
    echo "SlurmdLogFile=$STATE/log/slurmd.log"
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$(node_memory_mib) State=UNKNOWN"
    echo "PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF"
}

start() {
  for cmd in munged slurmctld slurmd sinfo; do
    command -v "$cmd" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin
    command -v "$cmd" >/dev/null 2>&1 || { log "error: $cmd not found; run .ci/setup_slurm.sh"; exit 1; }
  done
  if daemon_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null; then
    log "already running (state dir $STATE); 'stop' first to restart"
    status
    return
  fi
  stop_daemons  # leftovers of a half-started cluster
  write_config
  rm -f "$STATE"/log/*.log

  munged --force --socket="$MUNGE_SOCKET" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/run/munged.pid" --log-file="$STATE/log/munged.log" \
    --seed-file="$STATE/munge/munged.seed" || fail "munged did not start"
  # -c: start from a clean state, not from jobs of an earlier run.
  slurmctld -c -f "$CONF" || fail "slurmctld did not start"
  slurmd -f "$CONF" || fail "slurmd did not start"

  local deadline=$((SECONDS + START_TIMEOUT)) state="" name
  while [ $SECONDS -lt $deadline ]; do
    state=$(timeout 10 sinfo -h -N -n "$NODE" -o %t 2>/dev/null || true)
    [ "$state" = idle ] && break
    for name in slurmctld slurmd; do
      daemon_pid "$STATE/run/$name.pid" "$name" >/dev/null || fail "$name exited (see its log below)"
    done
    sleep 1
  done
  [ "$state" = idle ] || fail "node $NODE not idle after ${START_TIMEOUT}s (sinfo state: '${state:-no answer}')"
  log "up: node $NODE idle, $(nproc) CPUs; export SLURM_CONF=$CONF"
}

status() {
  local name pid rc=0
  for name in munged slurmctld slurmd; do
    if pid=$(daemon_pid "$STATE/run/$name.pid" "$name"); then
      echo "$name: running (pid $pid)"
    else
      echo "$name: stopped"
      rc=1
    fi
  done
  [ $rc = 0 ] && timeout 10 sinfo -N -l
  return $rc
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 {start|stop|status}" >&2; exit 2 ;;
esac
