# shellcheck shell=bash disable=SC2154  # names (and the other settings) come from the caller
# What local_cluster.sh and two_node_cluster.sh share (sourced, not run): process bookkeeping,
# the common slurm.conf, and start/stop/status. The caller sets STATE (the cluster's state dir,
# pid files in $STATE/run), CONF, MUNGE_SOCKET, START_TIMEOUT and names (the Slurm node names,
# each slurmd's pid file $STATE/run/slurmd-NAME.pid), and defines log(), write_config and
# start_slurmd I (starts the slurmd of ${names[I]}).

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

# Exits naming the command and `hint` (how to install it) unless every command is found. The
# daemons live in /usr/sbin, which a non-root PATH may lack.
require_commands() {
  local hint=$1 cmd
  shift
  for cmd in "$@"; do
    command -v "$cmd" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin
    command -v "$cmd" >/dev/null 2>&1 || { log "error: $cmd not found$hint"; exit 1; }
  done
}

node_states() {
  timeout 10 sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ' || true
}

# Whether a daemon started from this state dir has exited: its pid file names no live daemon. A
# daemon writes the file after it forks, so a file not there yet is a daemon still starting (on a
# busy machine that takes a while), not one gone.
daemon_exited() {
  [ -s "$1" ] && ! daemon_pid "$1" "$2" >/dev/null
}

# Waits until sinfo shows every node idle; fails at once when a daemon has exited.
wait_until_idle() {
  local deadline=$((SECONDS + START_TIMEOUT)) states="" want="" n
  for n in "${names[@]}"; do want+="$n=idle "; done
  want=$(tr ' ' '\n' <<<"$want" | sed '/^$/d' | sort -u | tr '\n' ' ')
  while [ $SECONDS -lt $deadline ]; do
    states=$(node_states)
    [ "$states" = "$want" ] && return
    ! daemon_exited "$STATE/run/slurmctld.pid" slurmctld || fail "slurmctld exited (see its log below)"
    for n in "${names[@]}"; do
      ! daemon_exited "$STATE/run/slurmd-$n.pid" slurmd || fail "slurmd of $n exited (see its log below)"
    done
    sleep 1
  done
  fail "nodes not idle after ${START_TIMEOUT}s (sinfo: '${states:-no answer}', want '$want')"
}

# munged, slurmctld and every node's slurmd on a fresh config; logs `up_message` once all nodes
# are idle. A cluster already running from this state dir is left as it is.
start_cluster() {
  local up_message=$1 i
  if daemon_pid "$STATE/run/slurmctld.pid" slurmctld >/dev/null; then
    log "already running (state dir $STATE); 'stop' first to restart"
    status || exit  # a daemon down: an error, as set -e would make it
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
  for i in "${!names[@]}"; do
    start_slurmd "$i" || fail "slurmd -N ${names[$i]} did not start"
  done
  wait_until_idle
  log "$up_message"
}

# "LABEL: running (pid P)" or "LABEL: stopped" (status 1) for the daemon `name` of `pidfile`.
report_daemon() {
  local pidfile=$1 name=$2 label=$3 pid
  if pid=$(daemon_pid "$pidfile" "$name"); then
    echo "$label: running (pid $pid)"
  else
    echo "$label: stopped"
    return 1
  fi
}

status() {
  local name rc=0
  for name in munged slurmctld; do
    report_daemon "$STATE/run/$name.pid" "$name" "$name" || rc=1
  done
  for name in "${names[@]}"; do
    report_daemon "$STATE/run/slurmd-$name.pid" slurmd "slurmd $name" || rc=1
  done
  [ $rc = 0 ] && timeout 10 sinfo -N -l
  return $rc
}

# The script's command line: start (the caller's start), stop or status.
dispatch() {
  case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 {start|stop|status}" >&2; exit 2 ;;
  esac
}
