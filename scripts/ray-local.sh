#!/usr/bin/env bash
# A local Ray cluster on this machine, for Troupe's Ray launcher tests and for trying
# `scheduler.type: ray` without a real cluster: a head and N-1 worker nodes, each a `ray start`
# of its own (its own raylet), with fake GPUs (`--num-gpus`; Ray sets CUDA_VISIBLE_DEVICES from
# them as on real cards). No root needed.
#
#   bash scripts/ray-local.sh install                       # ray (pinned) into target/ray-venv
#   bash scripts/ray-local.sh start [--nodes 3] [--gpus 2]  # head + workers (2 CPUs each)
#   bash scripts/ray-local.sh status                        # exit 0 when up (prints the address), 3 when not
#   bash scripts/ray-local.sh address                       # the GCS address (ip:port) of the running cluster
#   bash scripts/ray-local.sh stop
#
# Every subcommand is idempotent. Two clusters on one machine do not collide: every port is
# picked free at start (none of Ray's fixed defaults), and state lives under $TROUPE_RAY_DIR
# (default /tmp/troupe-ray; keep it short: Ray's unix sockets live below it). Daemons are found
# for `stop` by a marker in their environment (TROUPE_RAY_CLUSTER=$TROUPE_RAY_DIR), never by
# name, and are stopped by pid. Memory is kept small: 100 MB of object store per node.
#
# RAY_VENV (default target/ray-venv) is the virtual environment with ray; its python is also
# what `scheduler.python` should name (tests read it from `$TROUPE_RAY_DIR/python`).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

# The pinned Ray version (PyPI's `ray`, the minimal install: no dashboard, no Ray Client).
RAY_VERSION=2.60.0
DIR=${TROUPE_RAY_DIR:-/tmp/troupe-ray}
VENV=${RAY_VENV:-$ROOT/target/ray-venv}
OBJECT_STORE=100000000

die() { echo "ray-local: $*" >&2; exit 1; }
say() { echo "ray-local: $*"; }

ray_ok() { [ -x "$VENV/bin/ray" ] && "$VENV/bin/python" -c "import ray, sys; sys.exit(ray.__version__ != '$RAY_VERSION')" 2>/dev/null; }

install() {
  if ray_ok; then
    say "ray $RAY_VERSION already installed in $VENV"
    return 0
  fi
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "ray==$RAY_VERSION"
  ray_ok || die "ray $RAY_VERSION did not install into $VENV"
  say "installed ray $RAY_VERSION into $VENV"
}

free_port() {
  "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# Pids of the processes of this cluster (their environment carries the marker).
pids() {
  local needle="TROUPE_RAY_CLUSTER=$DIR" p
  for p in /proc/[0-9]*; do
    if { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "$needle"; then
      echo "${p#/proc/}"
    fi
  done
}

address() { [ -s "$DIR/address" ] && cat "$DIR/address"; }

up() {
  local a; a=$(address) || return 1
  [ -n "$(pids)" ] || return 1
  RAY_ADDRESS="$a" timeout 30 "$VENV/bin/python" - "$@" <<'EOF' >/dev/null 2>&1
import ray, sys
ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
want = int(sys.argv[1]) if len(sys.argv) > 1 else 1
alive = [n for n in ray.nodes() if n["Alive"]]
sys.exit(0 if len(alive) >= want else 1)
EOF
}

# One `ray start`: $1 = head|worker, then more flags.
ray_start() {
  local role=$1; shift
  local args=(--num-cpus "$CPUS" --num-gpus "$GPUS" --object-store-memory "$OBJECT_STORE"
    --disable-usage-stats --temp-dir "$DIR/ray"
    --node-manager-port "$(free_port)" --object-manager-port "$(free_port)"
    --min-worker-port 0 --max-worker-port 0
    --dashboard-agent-listen-port "$(free_port)" --dashboard-agent-grpc-port "$(free_port)"
    --runtime-env-agent-port "$(free_port)" --metrics-export-port "$(free_port)")
  if [ "$role" = head ]; then
    args+=(--head --port "$(free_port)" --include-dashboard false)
  fi
  TROUPE_RAY_CLUSTER="$DIR" RAY_num_prestart_python_workers=0 \
    "$VENV/bin/ray" start "${args[@]}" "$@" >>"$DIR/start.log" 2>&1
}

start() {
  local n=3
  GPUS=2
  CPUS=2
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) n=${2:?--nodes needs a number}; shift 2 ;;
      --gpus) GPUS=${2:?--gpus needs a number}; shift 2 ;;
      --cpus) CPUS=${2:?--cpus needs a number}; shift 2 ;;
      *) die "unknown start flag $1 (use --nodes N --gpus G --cpus C)" ;;
    esac
  done
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got $n"
  [[ "$GPUS" =~ ^[0-9]+$ ]] || die "--gpus must be a non-negative integer, got $GPUS"
  [[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "--cpus must be a positive integer, got $CPUS"
  ray_ok || die "ray $RAY_VERSION is not installed in $VENV: run \`$0 install\` first"
  if [ -s "$DIR/shape" ] && [ -n "$(pids)" ]; then
    if [ "$(cat "$DIR/shape")" = "$n $GPUS $CPUS" ] && up "$n"; then
      say "already running at $(address) ($n nodes, $GPUS GPUs and $CPUS CPUs each)"
      return 0
    fi
    die "already running with nodes/gpus/cpus $(cat "$DIR/shape"); run \`$0 stop\` first"
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR"
  ray_start head --resources "{\"troupe_node_0\": 1}" || { tail -n 20 "$DIR/start.log" >&2; stop; die "the head did not start"; }
  local port; port=$(grep -o "ray start --address='[^']*'" "$DIR/start.log" | head -1 | sed "s/.*='\(.*\)'/\1/")
  [ -n "$port" ] || { tail -n 20 "$DIR/start.log" >&2; stop; die "cannot read the head's address from $DIR/start.log"; }
  echo "$port" >"$DIR/address"
  local i
  for i in $(seq 1 $((n - 1))); do
    ray_start worker --address "$port" --resources "{\"troupe_node_$i\": 1}" \
      || { tail -n 20 "$DIR/start.log" >&2; stop; die "worker node $i did not start"; }
  done
  echo "$n $GPUS $CPUS" >"$DIR/shape"
  echo "$VENV/bin/python" >"$DIR/python"
  local end=$((SECONDS + 60))
  until up "$n"; do
    [ $SECONDS -lt $end ] || { stop; die "the cluster did not show $n live nodes within 60 s (see $DIR/start.log)"; }
    sleep 0.5
  done
  say "running at $(address): $n nodes, $GPUS fake GPUs and $CPUS CPUs each (state in $DIR)"
}

stop() {
  local p left
  p=$(pids)
  if [ -z "$p" ]; then
    rm -rf "$DIR"
    say "not running"
    return 0
  fi
  # SIGTERM first (raylets stop their workers), then SIGKILL what is left after 15 s.
  kill $p 2>/dev/null || true
  local end=$((SECONDS + 15))
  while [ $SECONDS -lt $end ]; do
    left=$(pids)
    [ -z "$left" ] && break
    sleep 0.5
  done
  left=$(pids)
  [ -z "$left" ] || kill -9 $left 2>/dev/null || true
  rm -rf "$DIR"
  say "stopped"
}

status() {
  if up 1; then
    say "running at $(address) ($(cat "$DIR/shape" 2>/dev/null) nodes/gpus/cpus; state in $DIR)"
    return 0
  fi
  say "not running"
  return 3
}

case "${1:-}" in
  install) install ;;
  start) shift; start "$@" ;;
  stop) stop ;;
  status) status ;;
  address) address || exit 3 ;;
  *) die "usage: $0 install | start [--nodes N] [--gpus G] [--cpus C] | status | address | stop" ;;
esac
