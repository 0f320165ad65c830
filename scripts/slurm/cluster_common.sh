# shellcheck shell=bash
# Process bookkeeping shared by local_cluster.sh and two_node_cluster.sh (sourced, not run).
# The caller sets STATE (the cluster's state dir, pid files in $STATE/run) and defines log().

# pid from a pid file, if that process is alive and was started by us: its command line names
# the daemon and this state dir (pids get reused; a system Slurm is not ours to stop).
daemon_pid() {
  local pidfile=$1 name=$2 pid cmdline
  [ -s "$pidfile" ] || return 1
  pid=$(cat "$pidfile")
  cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  case $cmdline in *"$name"*"$STATE"*) echo "$pid" ;; *) return 1 ;; esac
}

show_logs() {
  local f
  for f in "$STATE"/log/*.log; do
    [ -f "$f" ] || continue
    echo "----- $f (last 40 lines) -----" >&2
    tail -n 40 "$f" >&2
  done
}

# Every daemon with a pid file under $STATE/run (slurmd-NAME.pid is a slurmd), all at once:
# each takes a second or two to shut down.
stop_daemons() {
  local f name pid pids=() alive
  for f in "$STATE"/run/*.pid; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .pid)
    pid=$(daemon_pid "$f" "${name%%-*}") && pids+=("$pid")
  done
  if [ ${#pids[@]} -gt 0 ]; then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
      alive=0
      for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ $alive = 0 ] && break
      sleep 0.2
    done
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null; done
  fi
  rm -f "$STATE"/run/*.pid
}

fail() {
  log "error: $*"
  show_logs
  stop_daemons
  exit 1
}

stop() {
  # Cancel jobs first: their slurmstepd processes outlive slurmd otherwise.
  if daemon_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null; then
    timeout 10 scancel --full --partition=debug 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while [ $SECONDS -lt $deadline ] && [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null || true)" ]; do
      sleep 1
    done
  fi
  stop_daemons
  log "stopped (logs kept in $STATE/log)"
}

# The state dir's layout, the munge key (0400; clients of any user reach the socket through the
# 0711 dir) and a cgroup.conf with every constraint off (not read with proctrack/linuxproc +
# task/none; there so the state dir holds a complete config should a plugin switch to cgroups).
prepare_state_dir() {
  mkdir -p "$STATE"/{etc,munge,ctld,spool,log,run}
  chmod 711 "$STATE/munge"
  if [ ! -s "$STATE/munge/munge.key" ]; then
    dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
  fi
  chmod 400 "$STATE/munge/munge.key"
  printf 'ConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n' >"$STATE/etc/cgroup.conf"
}

# Memory a node may claim: slurmd drains a node that reports less than configured, so leave a margin.
node_memory_mib() {
  local mem
  mem=$(free -m | awk '/^Mem:/ {print $2}')
  echo $((mem - mem / 10))
}

# slurm.conf lines both clusters share; each adds its controller, node-specific files and nodes.
common_slurm_conf() {
  local user
  user=$(id -un)
  cat <<EOF
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmctldDebug=info
SlurmdDebug=info
# linuxproc follows the process tree, so it still finds torchrun's ranks, which start their own
# sessions (proctrack/pgid would lose them); task/none: no binding and no cgroups needed.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Use the configured CPUs/memory even if slurmd detects a different topology (containers).
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
# sbatch --wait polls every 2 s while MinJobAge/2 <= 2, instead of backing off to 32 s (a test
# would wait up to half a minute for a finished job); 4 s still outlives one poll interval.
MinJobAge=4
EOF
}
