#!/usr/bin/env bash
# A real multi-node Slurm cluster on one machine: slurmctld in the root network namespace, one
# slurmd per node, each inside its own network namespace ("host") with its own address, so that
# multi-node jobs talk over a real (virtual) network. tests/netns.py makes the hosts:
#
#   python tests/netns.py --hosts 2 --names node0,node1 -- bash -c '
#     scripts/slurm/two_node_cluster.sh start &&
#     SLURM_CONF=/tmp/megalite-slurm-nodes/etc/slurm.conf GLOO_SOCKET_IFNAME=$MEGALITE_NETNS_IFNAME \
#       MEGALITE_NPROC_PER_NODE=2 sbatch --wait -N 2 scripts/slurm/pretrain_gpt.sbatch --mock-data --tp 2 --pp 2
#     scripts/slurm/two_node_cluster.sh stop'
#
# Nodes, controller address (environment):
#   MEGALITE_SLURM_NODES     "name:netns:addr ..." one per node (default: $MEGALITE_NETNS_HOSTS, which
#                            tests/netns.py sets); netns "-" runs that slurmd in the root namespace
#   MEGALITE_SLURMCTLD_ADDR  slurmctld's address, reachable from every node (default:
#                            $MEGALITE_NETNS_GATEWAY, the bridge's address; else 127.0.0.1)
#   MEGALITE_SLURM_DIR       state dir (default /tmp/megalite-slurm-nodes): config, munge, spool, logs
#   MEGALITE_SLURMCTLD_PORT, MEGALITE_SLURMD_PORT  (node i listens on MEGALITE_SLURMD_PORT + i)
#
# Node names must resolve to their addresses inside the nodes (the sbatch scripts rendezvous at
# the first node's name): tests/netns.py writes /etc/netns/<netns>/hosts, which `ip netns exec`
# mounts over /etc/hosts. One munged in the root namespace serves every node: its socket is a file,
# and Unix sockets bound to a path are reachable from every network namespace.
# Like local_cluster.sh: proctrack/linuxproc, task/none, no cgroups, no accounting. Needs root
# (ip netns exec) and slurm-wlm + munge (.ci/setup_slurm.sh).
set -euo pipefail

STATE=${MEGALITE_SLURM_DIR:-/tmp/megalite-slurm-nodes}
CTLD_PORT=${MEGALITE_SLURMCTLD_PORT:-16827}
SLURMD_PORT=${MEGALITE_SLURMD_PORT:-16828}
START_TIMEOUT=${MEGALITE_SLURM_START_TIMEOUT:-60}
NODES=${MEGALITE_SLURM_NODES:-${MEGALITE_NETNS_HOSTS:-}}
CTLD_ADDR=${MEGALITE_SLURMCTLD_ADDR:-${MEGALITE_NETNS_GATEWAY:-127.0.0.1}}

CONF=$STATE/etc/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket
CTLD_NAME=$(hostname -s)
export SLURM_CONF=$CONF

log() { echo "two_node_cluster: $*" >&2; }

# "name:netns:addr" entries -> parallel arrays.
names=() netns=() addrs=()
for entry in $NODES; do
  IFS=: read -r n s a <<<"$entry"
  if [ -z "$n" ] || [ -z "$s" ] || [ -z "$a" ]; then
    log "error: bad node entry '$entry' (want name:netns:addr)"
    exit 2
  fi
  names+=("$n") netns+=("$s") addrs+=("$a")
done

. "$(dirname "${BASH_SOURCE[0]}")/cluster_common.sh"

# Start node i's slurmd, in its namespace ("-": the root namespace).
# `ip netns exec` gives what it runs a mount namespace of its own with a fresh /sys (so that /sys
# shows the namespace's network devices), which drops the cgroup mounts under /sys/fs/cgroup,
# and slurmd 22.05 will not start without them (even with task/none and proctrack/linuxproc:
# "No filesystem mounted on /sys/fs/cgroup ... slurmd initialization failed"). So mount the
# same cgroup filesystems again, with the root namespace's types and options, inside that
# private mount namespace (the host's mounts are not touched) before exec'ing slurmd.
start_slurmd() {
  local i=$1
  mkdir -p "$STATE/spool/${names[$i]}" || return
  if [ "${netns[$i]}" = - ]; then
    slurmd -f "$CONF" -N "${names[$i]}"
    return
  fi
  local mounts
  mounts=$(awk '$2 == "/sys/fs/cgroup" || $2 ~ "^/sys/fs/cgroup/" {print $3, $2, $4}' /proc/self/mounts)
  ip netns exec "${netns[$i]}" env MOUNTS="$mounts" bash -c '
    set -e
    while read -r type dir opts; do
      [ -n "$type" ] || continue
      mkdir -p "$dir"
      mount -t "$type" -o "$opts" "$type" "$dir"
    done <<<"$MOUNTS"
    unset MOUNTS
    exec slurmd -f "$0" -N "$1"' "$CONF" "${names[$i]}"
}

write_config() {
  local i cpus mem
  # The nodes share this machine: each claims all of it.
  cpus=$(nproc)
  mem=$(node_memory_mib)
  prepare_state_dir
  {
    echo "# Written by scripts/slurm/two_node_cluster.sh: ${#names[@]} nodes on one machine, one network"
    echo "# namespace each; no accounting, no cgroups."
    echo "ClusterName=megalite-nodes"
    echo "SlurmctldHost=$CTLD_NAME($CTLD_ADDR)"
    echo "SlurmctldPort=$CTLD_PORT"
    common_slurm_conf
    echo "# %n: the node name, so every slurmd has its own spool, pid file and log."
    echo "SlurmdSpoolDir=$STATE/spool/%n"
    echo "SlurmdPidFile=$STATE/run/slurmd-%n.pid"
    echo "SlurmdLogFile=$STATE/log/slurmd-%n.log"
    for i in "${!names[@]}"; do
      echo "NodeName=${names[$i]} NodeAddr=${addrs[$i]} Port=$((SLURMD_PORT + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF"
}

start() {
  if [ ${#names[@]} -eq 0 ]; then
    log "error: no nodes: set MEGALITE_SLURM_NODES='name:netns:addr ...' (or run under tests/netns.py)"
    exit 2
  fi
  require_commands " (.ci/setup_slurm.sh, .ci/setup_netns.sh)" munged slurmctld slurmd sinfo ip
  start_cluster "up: ${names[*]} idle, controller $CTLD_ADDR:$CTLD_PORT; export SLURM_CONF=$CONF"
}

dispatch "$@"
