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
# ROUNDS (default 3) measures the two routers in turn that many times, so a slow or fast spell of
# a shared machine lands on both; each round's figures are printed under `round<N>.`, then every
# figure's median under its plain name, and the ratios of the medians (and each round's).
#
# PEER=floor measures against `examples/proxy_floor.rs` instead of sglang-router: a hand-written
# proxy that does none of a router's work (no policy, retries, limits, JSON), the floor of what any
# HTTP/1 router costs on this machine; its figures are `floor.gateway.*` and the ratios
# `troupe_vs_floor.*` (FLOOR_BIN: another build of it). LATENCY_MS (default 5) is the backends' latency (0: the gateway row of
# `troupe bench gateway`, e.g. `PEER=floor LATENCY_MS=0 CONCURRENCY=32 QUOTA=1`).
#
# Needs: a release build (`cargo build --release`), `pip install
# sglang-router` (PEER=floor: `cargo build --release --example proxy_floor` instead), and for
# QUOTA root with cgroup v1 (/sys/fs/cgroup/cpu) or v2 (cpu.max).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TROUPE_BIN:-target/release/troupe}
C=${CONCURRENCY:-64}
N=${REQUESTS:-20000}
QUOTA=${QUOTA:-}
ROUNDS=${ROUNDS:-3}
PEER=${PEER:-sglang}
LATENCY_MS=${LATENCY_MS:-5}
FLOOR=${FLOOR_BIN:-target/release/examples/proxy_floor}
case "$PEER" in
  sglang|floor) ;;
  *) echo "PEER must be sglang or floor, got '$PEER'" >&2; exit 2 ;;
esac
if ! awk -v l="$LATENCY_MS" 'BEGIN { exit !(l ~ /^[0-9]*\.?[0-9]+$/) }'; then
  echo "LATENCY_MS must be a number of milliseconds of at least 0, got '$LATENCY_MS'" >&2; exit 2
fi
case "$ROUNDS" in
  ''|*[!0-9]*|0) echo "ROUNDS must be a positive whole number, got '$ROUNDS'" >&2; exit 2 ;;
esac
# A cgroup's quota is at least 1 ms per 100 ms period, so QUOTA (cores) is at least 0.01.
if [ -n "$QUOTA" ] && ! awk -v q="$QUOTA" 'BEGIN { exit !(q ~ /^[0-9]*\.?[0-9]+$/ && q >= 0.01) }'; then
  echo "QUOTA must be a number of cores of at least 0.01 (e.g. 0.25), got '$QUOTA'" >&2; exit 2
fi

# Two ports nothing listens on now (the kernel's picks, both held until both are chosen, so
# they differ), so two runs, or a run beside a deployment, never share one.
read -r FREE_T FREE_S < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
PORT_T=${PORT_TROUPE:-$FREE_T}
PORT_S=${PORT_SGLANG:-$FREE_S}

[ -x "$BIN" ] || { echo "no $BIN: run cargo build --release" >&2; exit 2; }
if [ "$PEER" = sglang ]; then
  command -v sglang-router >/dev/null || { echo "no sglang-router: pip install sglang-router" >&2; exit 2; }
else
  [ -x "$FLOOR" ] || { echo "no $FLOOR: run cargo build --release --example proxy_floor" >&2; exit 2; }
fi

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

# Each router gets two backends of its own on two consecutive free ports, started anew by every
# round's bench on the same ports (registered in the first round only).
read -r BASE_T BASE_S < <(python3 -c '
import socket
def pair():
    while True:
        a = socket.socket(); a.bind(("127.0.0.1", 0)); p = a.getsockname()[1]
        b = socket.socket()
        try:
            b.bind(("127.0.0.1", p + 1))
            return a, b, p
        except OSError:
            a.close(); b.close()
t = pair(); s = pair()
while s[2] in (t[2] - 1, t[2], t[2] + 1):
    s = pair()
print(t[2], s[2])')
# TROUPE_GATEWAY_ARGS: extra flags for Troupe's gateway, e.g. --io-threads 1 to match a quota of
# at most one core (it serves on one thread per core by default).
# shellcheck disable=SC2086
launch "troupe-bench-gateway-$$" "$BIN" gateway --listen "127.0.0.1:$PORT_T" --policy round_robin \
  --health-interval-s 0 ${TROUPE_GATEWAY_ARGS:-} >/dev/null
TG=$LAUNCHED; PIDS+=("$TG")
if [ "$PEER" = sglang ]; then
  # The launcher is the router (it renames itself `sglang::router`).
  launch "troupe-bench-$PEER-$$" sglang-router launch --host 127.0.0.1 --port "$PORT_S" \
    --policy round_robin --log-level warn >/dev/null 2>&1
else
  # The floor proxy is given its backends (it has no `POST /workers`).
  launch "troupe-bench-$PEER-$$" "$FLOOR" "127.0.0.1:$PORT_S" "http://127.0.0.1:$BASE_S" \
    "http://127.0.0.1:$((BASE_S + 1))" >/dev/null
fi
SG=$LAUNCHED; PIDS+=("$SG")
wait_port "$PORT_T"; wait_port "$PORT_S"
if [ -n "$QUOTA" ]; then
  if [ -n "${QUOTA_AFTER_START:-}" ]; then
    limit "$TG" "troupe-bench-gateway-$$"
    limit "$SG" "troupe-bench-$PEER-$$"
    echo "# each router limited to $QUOTA core(s), moved into its cgroup after it started"
  else
    echo "# each router limited to $QUOTA core(s), started inside its cgroup"
  fi
fi
echo "# threads: troupe gateway $(ls /proc/"$TG"/task | wc -l), $PEER $(ls /proc/"$SG"/task | wc -l)"
echo "# concurrency $C, $N requests, backends with $LATENCY_MS ms latency, $ROUNDS round(s)"
ALL=""
for r in $(seq 1 "$ROUNDS"); do
  REG=""; [ "$r" = 1 ] && REG=--register
  PEER_REG=$REG; [ "$PEER" = floor ] && PEER_REG=""
  OURS=$("$BIN" bench gateway --target "http://127.0.0.1:$PORT_T" --target-pid "$TG" $REG \
    --backend-port-base "$BASE_T" --concurrency "$C" --requests "$N" \
    --backend-latency-ms "$LATENCY_MS" | sed 's/^gateway\./troupe.gateway./')
  THEIRS=$("$BIN" bench gateway --target "http://127.0.0.1:$PORT_S" --target-pid "$SG" $PEER_REG \
    --backend-port-base "$BASE_S" --concurrency "$C" --requests "$N" \
    --backend-latency-ms "$LATENCY_MS" | sed "s/^gateway\\./$PEER.gateway./")
  if [ "$ROUNDS" = 1 ]; then
    printf '%s\n%s\n' "$OURS" "$THEIRS"
  else
    printf '%s\n%s\n' "$OURS" "$THEIRS" | sed "s/^/round$r./"
  fi
  ALL+="$(printf '%s\n%s\n' "$OURS" "$THEIRS" | sed "s/^/$r /")"$'\n'
done
# With several rounds (the two routers measured in turn, so a slower or faster spell of the
# machine lands on both), every figure once more under its plain name: its median over rounds.
# Then the ratios (same backends, same load, same CPU quota): requests/s, and CPU per request
# (SGLang's router's over Troupe's gateway), of those medians, and each round's. When a router
# serves nearly what the load generator sends the backends directly (`…direct.rps`), the load
# generator, not the router, bounds its requests/s; the CPU ratio measures the routers either way.
# Last, one line per router with its requests/s beside its CPU per request, and
# `<router>.gateway.load_generator_at_ceiling`: 1 when the router served within 90% of the direct
# rate, or, under QUOTA, used less than 90% of its quota (`<router>.gateway.quota_used`: requests/s
# times CPU per request over the quota), so something besides its CPU bounded it.
printf '%s' "$ALL" | awk -v rounds="$ROUNDS" -v peer="$PEER" -v quota="${QUOTA:-0}" '
  function median(k,   n, i, j, t, a) {
    n = 0
    for (i = 1; i <= rounds; i++) if ((k, i) in v) a[++n] = v[k, i]
    for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] > a[j]; j--) { t = a[j]; a[j] = a[j - 1]; a[j - 1] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  NF == 3 { v[$2, $1] = $3; if (!($2 in seen)) { seen[$2] = 1; order[++names] = $2 } }
  END {
    if (rounds > 1) for (i = 1; i <= names; i++) printf "%s %s\n", order[i], median(order[i])
    t = median("troupe.gateway.target.rps"); s = median(peer ".gateway.target.rps")
    tc = median("troupe.gateway.target.cpu_us_per_req"); sc = median(peer ".gateway.target.cpu_us_per_req")
    if (s > 0) printf "troupe_vs_%s.gateway.rps_ratio %.3f\n", peer, t / s
    if (tc > 0) printf "troupe_vs_%s.gateway.cpu_per_req_ratio %.3f\n", peer, sc / tc
    # Each router: requests/s beside its CPU per request, and whether the load generator was
    # at its ceiling (the router served at least 90% of what the generator gets from the
    # backends directly): then requests/s hides a gap between routers, and CPU per request
    # is the figure to compare.
    n = split("troupe " peer, who, " ")
    for (i = 1; i <= n; i++) {
      r = median(who[i] ".gateway.target.rps"); c = median(who[i] ".gateway.target.cpu_us_per_req")
      d = median(who[i] ".gateway.direct.rps")
      # Under a quota, a router that used under 90% of it was waiting on the load side too.
      used = (quota > 0 && c > 0) ? r * c / 1e6 / quota : 0
      ceil = ((d > 0 && r >= 0.9 * d) || (quota > 0 && c > 0 && used < 0.9)) ? 1 : 0
      printf "%s.gateway.load_generator_at_ceiling %d\n", who[i], ceil
      if (quota > 0 && c > 0) printf "%s.gateway.quota_used %.3f\n", who[i], used
      printf "# %s: %.0f requests/s at %.1f us of its CPU per request%s\n", who[i], r, c, \
        ceil ? sprintf(" (bounded by the load side: %.0f requests/s direct%s; compare CPU per request)", d, \
          quota > 0 ? sprintf(", %.0f%% of its quota used", 100 * used) : "") : ""
    }
    if (rounds > 1) for (r = 1; r <= rounds; r++) {
      t = v["troupe.gateway.target.rps", r]; s = v[peer ".gateway.target.rps", r]
      if (s > 0) printf "round%d.troupe_vs_%s.gateway.rps_ratio %.3f\n", r, peer, t / s
    }
  }'
