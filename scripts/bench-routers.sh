#!/usr/bin/env bash
# Side-by-side throughput of Troupe's gateway and SGLang's router (sglang-router), each a separate
# process fronting the same kind of fixed-latency backends, driven by `troupe bench gateway`.
#
#   bash scripts/bench-routers.sh                 # both routers share the machine with the load
#   QUOTA=0.25 bash scripts/bench-routers.sh      # each router limited to a quarter core (root)
#
# On a small machine the load generator and backends need most of the CPU, so without a quota
# both routers run as fast as the load allows and tie. QUOTA gives each router the same CPU
# budget (a cgroup CPU quota), so the router is the bottleneck and requests/s measures the router
# (on 2 cores Troupe's gateway nearly keeps up with the load generator at QUOTA=0.5; use 0.25).
# Each router starts inside its cgroup, as in a container with that CPU limit, so it sizes its
# threads for the quota (both ask the kernel: Rust's available_parallelism reads the cgroup's
# quota). QUOTA_AFTER_START=1 moves each into its cgroup after it started instead, so each keeps
# the threads it chose for the whole machine (how this script measured before).
# Either way each run prints `gateway.target.cpu_us_per_req`: the router process's own CPU time per
# request, which does not depend on what else shares the machine.
#
# Needs: a release build (`cargo build --release -p troupe-controller`), `pip install
# sglang-router`, and for QUOTA root with cgroup v1 (/sys/fs/cgroup/cpu) or v2 (cpu.max).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TROUPE_BIN:-target/release/troupe}
C=${CONCURRENCY:-64}
N=${REQUESTS:-20000}
QUOTA=${QUOTA:-}

# Two ports nothing listens on now (the kernel's picks, both held until both are chosen, so
# they differ), so two runs, or a run beside a deployment, never share one.
read -r FREE_T FREE_S < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
PORT_T=${PORT_TROUPE:-$FREE_T}
PORT_S=${PORT_SGLANG:-$FREE_S}

[ -x "$BIN" ] || { echo "no $BIN: run cargo build --release -p troupe-controller" >&2; exit 2; }
command -v sglang-router >/dev/null || { echo "no sglang-router: pip install sglang-router" >&2; exit 2; }

PIDS=()
CGROUPS=()
# Stops both routers (and anything they started inside their cgroups), then removes the cgroups:
# a cgroup stays busy until its last task is reaped, so each removal is retried for a while.
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  for d in "${CGROUPS[@]}"; do
    for t in $(cat "$d/tasks" "$d/cgroup.procs" 2>/dev/null); do kill -9 "$t" 2>/dev/null || true; done
  done
  wait 2>/dev/null || true
  for d in "${CGROUPS[@]}"; do
    for _ in $(seq 1 50); do rmdir "$d" 2>/dev/null && break; sleep 0.1; done
    [ -d "$d" ] && echo "# could not remove cgroup $d" >&2
  done
  return 0
}
trap cleanup EXIT

# cgroup NAME: makes a cgroup capped at QUOTA cores; sets JOIN to the file a process writes its
# pid (v2) or each of its threads' ids (v1) into to join it.
cgroup() {
  local name=$1 us d
  us=$(awk -v q="$QUOTA" 'BEGIN { printf "%d", q * 100000 }')
  if [ -d /sys/fs/cgroup/cpu ] && [ ! -f /sys/fs/cgroup/cgroup.controllers ]; then
    d=/sys/fs/cgroup/cpu/$name
    mkdir -p "$d"; CGROUPS+=("$d")
    echo 100000 > "$d/cpu.cfs_period_us"; echo "$us" > "$d/cpu.cfs_quota_us"
    JOIN=$d/tasks
  else
    d=/sys/fs/cgroup/$name
    mkdir -p "$d"; CGROUPS+=("$d")
    echo "$us 100000" > "$d/cpu.max"
    JOIN=$d/cgroup.procs
  fi
}

# launch NAME CMD...: runs CMD in the background (its pid in LAUNCHED), inside cgroup NAME from
# its first instruction when QUOTA is set (before it starts any thread, so all of them inherit).
launch() {
  local name=$1; shift
  if [ -n "$QUOTA" ] && [ -z "${QUOTA_AFTER_START:-}" ]; then
    cgroup "$name"
    bash -c 'echo $$ > "$0" && exec "$@"' "$JOIN" "$@" &
  else
    "$@" &
  fi
  LAUNCHED=$!
}

# limit PID NAME: moves every thread of a running PID into a new cgroup capped at QUOTA cores.
limit() {
  local pid=$1 name=$2
  cgroup "$name"
  if [ "${JOIN##*/}" = tasks ]; then
    for t in /proc/"$pid"/task/*; do basename "$t" > "$JOIN"; done
  else
    echo "$pid" > "$JOIN"
  fi
}

wait_port() {
  for _ in $(seq 1 100); do
    (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on port $1" >&2; exit 1
}

# TROUPE_GATEWAY_ARGS: extra flags for Troupe's gateway, e.g. --io-threads 1 to match a quota of
# at most one core (it serves on one thread per core by default).
# shellcheck disable=SC2086
launch "troupe-bench-gateway-$$" "$BIN" gateway --listen "127.0.0.1:$PORT_T" --policy round_robin \
  --health-interval-s 0 ${TROUPE_GATEWAY_ARGS:-} >/dev/null
TG=$LAUNCHED; PIDS+=("$TG")
# The launcher is the router (it renames itself `sglang::router`).
launch "troupe-bench-sglang-$$" sglang-router launch --host 127.0.0.1 --port "$PORT_S" \
  --policy round_robin --log-level warn >/dev/null 2>&1
SG=$LAUNCHED; PIDS+=("$SG")
wait_port "$PORT_T"; wait_port "$PORT_S"
if [ -n "$QUOTA" ]; then
  if [ -n "${QUOTA_AFTER_START:-}" ]; then
    limit "$TG" "troupe-bench-gateway-$$"
    limit "$SG" "troupe-bench-sglang-$$"
    echo "# each router limited to $QUOTA core(s), moved into its cgroup after it started"
  else
    echo "# each router limited to $QUOTA core(s), started inside its cgroup"
  fi
fi
if [ -n "$TG" ]; then
  echo "# threads: troupe gateway $(ls /proc/"$TG"/task | wc -l), sglang-router $(ls /proc/"$SG"/task | wc -l)"
fi
echo "# concurrency $C, $N requests, backends with 5 ms latency"
OURS=$("$BIN" bench gateway --target "http://127.0.0.1:$PORT_T" --target-pid "$TG" --register \
  --concurrency "$C" --requests "$N" | sed 's/^gateway\./troupe.gateway./')
echo "$OURS"
THEIRS=$("$BIN" bench gateway --target "http://127.0.0.1:$PORT_S" --target-pid "$SG" --register \
  --concurrency "$C" --requests "$N" | sed 's/^gateway\./sglang.gateway./')
echo "$THEIRS"
# The ratios of the two runs above (same backends, same load, same CPU quota): requests/s, and
# CPU per request (SGLang's router's over Troupe's gateway). When a router serves nearly what the
# load generator sends the backends directly (`…direct.rps`), the load generator, not the router,
# bounds its requests/s; the CPU ratio measures the routers either way.
printf '%s\n%s\n' "$OURS" "$THEIRS" | awk '
  $1 == "troupe.gateway.target.rps" { t = $2 }
  $1 == "sglang.gateway.target.rps" { s = $2 }
  $1 == "troupe.gateway.target.cpu_us_per_req" { tc = $2 }
  $1 == "sglang.gateway.target.cpu_us_per_req" { sc = $2 }
  END {
    if (s > 0) printf "troupe_vs_sglang.gateway.rps_ratio %.3f\n", t / s
    if (tc > 0) printf "troupe_vs_sglang.gateway.cpu_per_req_ratio %.3f\n", sc / tc
  }'
