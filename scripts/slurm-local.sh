#!/usr/bin/env bash
# A local Slurm cluster on this machine, for Troupe's Slurm launcher tests and for trying
# `scheduler.type: slurm` without a real cluster. Debian/Ubuntu, as root, no systemd needed.
#
#   bash scripts/slurm-local.sh install                     # apt: slurmctld slurmd slurm-client munge
#   bash scripts/slurm-local.sh start [--nodes 3] [--gpus 8] # slurmctld + one slurmd per node
#   bash scripts/slurm-local.sh status                      # exit 0 when up, 3 when not
#   bash scripts/slurm-local.sh stop
#
# Every subcommand is idempotent: `start` on a running cluster of the same shape succeeds and
# changes nothing, `stop` on a stopped cluster succeeds.
#
# How it works (slurm-wlm 22.05): nodes n1..nN all live on 127.0.0.1, each slurmd on its own
# port with its own copy of slurm.conf (Debian's slurmd is not built with multiple-slurmd
# support, so per-node pid/spool/log paths need per-node config files). GPUs are fake: GRES
# needs a character device per GPU, so each is a clone of /dev/null (`mknod c 1 3`) named
# nvidiaK; Slurm then sets CUDA_VISIBLE_DEVICES from the K of the devices a job was given.
# No cgroups (proctrack/linuxproc, task/none) and no accounting database.
#
# State, logs, pid files and fake devices live under $TROUPE_SLURM_DIR (default
# /tmp/troupe-slurm). Daemons are stopped only through the pid files this script wrote.
# /etc/slurm/slurm.conf is written (clients read it) unless it exists and is not ours.
set -euo pipefail

DIR=${TROUPE_SLURM_DIR:-/tmp/troupe-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# managed by troupe scripts/slurm-local.sh"

die() { echo "slurm-local: $*" >&2; exit 1; }
say() { echo "slurm-local: $*"; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Polls `cmd` until it succeeds or `secs` pass.
wait_for() {
  local secs=$1; shift
  local end=$((SECONDS + secs))
  until "$@"; do
    [ $SECONDS -lt $end ] || return 1
    sleep 0.2
  done
}

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    say "slurm and munge already installed ($(slurmctld -V 2>/dev/null || echo unknown))"
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "install needs root (apt-get)"
  command -v apt-get >/dev/null || die "install knows only apt-get; install slurmctld slurmd slurm-client munge yourself"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then return 0; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --force
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  /usr/sbin/munged --force 2>>"$DIR/log/munged.log"
  cp /run/munge/munged.pid "$DIR/munged.pid"   # ours: `stop` may stop it
  wait_for 10 munge_ok || die "munged started but munge -n | unmunge fails (see $DIR/log/munged.log)"
}

# Node count recorded by the running cluster, or empty.
running_nodes() { [ -s "$DIR/nodes" ] && alive "$DIR/slurmctld.pid" && cat "$DIR/nodes" || true; }

write_conf() {   # $1 nodes, $2 gpus
  local n=$1 g=$2 mem cpus
  mem=$(awk -v n="$n" '/MemTotal/{m=int($2/1024*0.8/n); print (m < 1024 ? 1024 : m)}' /proc/meminfo)
  cpus=$(nproc)
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; move it away to use the local cluster"
  fi
  mkdir -p /etc/slurm
  cat > "$CONF" <<EOF
$MARK (state in $DIR)
ClusterName=troupe-local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job takes a whole node's memory and jobs run one at a time.
DefMemPerCPU=512
ReturnToService=2
# scancel: SIGTERM, then SIGKILL after KillWait seconds (troupe hosts stop their actors on SIGTERM).
KillWait=10
GresTypes=gpu
NodeName=n[1-$n] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-$((17000 + n))] CPUs=$cpus RealMemory=$mem Gres=gpu:$g State=UNKNOWN
PartitionName=debug Nodes=n[1-$n] Default=YES MaxTime=INFINITE State=UP
EOF
  # gres.conf File= must be a character device; the trailing number is the CUDA index.
  printf 'AutoDetect=off\nNodeName=n[1-%d] Name=gpu File=%s/dev/nvidia[0-%d]\n' "$n" "$DIR" $((g - 1)) \
    > /etc/slurm/gres.conf
}

all_idle() { [ "$(sinfo -h -t idle,mixed,alloc -o '%D' 2>/dev/null | awk '{s+=$1} END{print s+0}')" = "$1" ]; }

start() {
  local n=3 g=8
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) n=${2:?--nodes needs a number}; shift 2 ;;
      --gpus) g=${2:?--gpus needs a number}; shift 2 ;;
      *) die "unknown start flag $1 (use --nodes N --gpus G)" ;;
    esac
  done
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got $n"
  [[ "$g" =~ ^[1-9][0-9]*$ ]] || die "--gpus must be a positive integer, got $g"
  [ "$(id -u)" = 0 ] || die "start needs root (munge, /etc/slurm, mknod)"
  command -v slurmctld >/dev/null || die "slurm is not installed: run \`$0 install\` first"

  local have; have=$(running_nodes)
  if [ -n "$have" ]; then
    if [ "$have" = "$n $g" ]; then
      say "already running ($n nodes, $g GPUs each)"
      return 0
    fi
    die "already running with nodes/gpus $have; run \`$0 stop\` first to change its shape"
  fi

  mkdir -p "$DIR"/{state,spool,log,dev}
  for i in $(seq 0 $((g - 1))); do
    [ -c "$DIR/dev/nvidia$i" ] || mknod "$DIR/dev/nvidia$i" c 1 3
  done
  start_munge
  write_conf "$n" "$g"
  /usr/sbin/slurmctld -c -i
  wait_for 15 alive "$DIR/slurmctld.pid" || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
  for i in $(seq 1 "$n"); do
    local d="$DIR/n$i"
    mkdir -p "$d/spool"
    sed -e "s#^SlurmdPidFile=.*#SlurmdPidFile=$d/slurmd.pid#" \
        -e "s#^SlurmdSpoolDir=.*#SlurmdSpoolDir=$d/spool#" \
        -e "s#^SlurmdLogFile=.*#SlurmdLogFile=$d/slurmd.log#" "$CONF" > "$d/slurm.conf"
    cp /etc/slurm/gres.conf "$d/gres.conf"   # read from the directory of the -f file
    alive "$d/slurmd.pid" || /usr/sbin/slurmd -f "$d/slurm.conf" -N "n$i"
  done
  echo "$n $g" > "$DIR/nodes"
  if ! wait_for 30 all_idle "$n"; then
    sinfo -N -o '%N %t %E' >&2 || true
    die "nodes did not become idle within 30 s (logs in $DIR/log and $DIR/n*/slurmd.log)"
  fi
  sinfo -N -o '%N %c %m %G %t'
  say "up: $n nodes, $g GPUs each (state in $DIR)"
}

stop() {
  local f pid stopped=0
  for f in "$DIR"/n*/slurmd.pid "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    if kill "$pid" 2>/dev/null; then
      wait_for 15 bash -c "! kill -0 $pid 2>/dev/null" || kill -9 "$pid" 2>/dev/null || true
      say "stopped pid $pid ($f)"
      stopped=1
    fi
    rm -f "$f"
  done
  rm -f "$DIR/nodes"
  [ $stopped = 1 ] || say "not running"
}

status() {
  local have; have=$(running_nodes)
  if [ -z "$have" ]; then
    say "not running"
    return 3
  fi
  say "running (nodes/gpus: $have)"
  sinfo -N -o '%N %c %m %G %t'
  squeue
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  install) install ;;
  start) start "$@" ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 install | start [--nodes N] [--gpus G] | stop | status" >&2; exit 2 ;;
esac
