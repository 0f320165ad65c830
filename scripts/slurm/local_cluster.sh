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
names=("$NODE")
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
    echo "SlurmdPidFile=$STATE/run/slurmd-$NODE.pid"
    echo "SlurmdLogFile=$STATE/log/slurmd.log"
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$(node_memory_mib) State=UNKNOWN"
    echo "PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF"
}

start_slurmd() {
  slurmd -f "$CONF"
}

start() {
  require_commands "; run .ci/setup_slurm.sh" munged slurmctld slurmd sinfo
  start_cluster "up: node $NODE idle, $(nproc) CPUs; export SLURM_CONF=$CONF"
}

dispatch "$@"
