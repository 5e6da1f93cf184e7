# Timed phases for the test scripts (sourced, not run): `phase NAME COMMAND...` runs COMMAND,
# prints `phase NAME SECONDS` on stderr when it ends (pass or fail), and appends the same line to
# $TROUPE_PHASE_LOG when that is set, so `.ci/run` can print every phase of every script it
# called in one table at the end. The exit status is COMMAND's.
#
#   . scripts/phase.sh
#   phase rust.test cargo test --workspace

phase() {
  local name="$1"
  shift
  local start end rc
  start=$(date +%s.%N)
  if "$@"; then rc=0; else rc=$?; fi
  end=$(date +%s.%N)
  local line
  line=$(awk -v n="$name" -v a="$start" -v b="$end" -v rc="$rc" \
    'BEGIN { printf "phase %-22s %8.1f s%s", n, b - a, (rc == 0 ? "" : "  (failed, exit " rc ")") }')
  echo "$line" >&2
  if [ -n "${TROUPE_PHASE_LOG:-}" ]; then
    echo "$line" >>"$TROUPE_PHASE_LOG"
  fi
  return "$rc"
}

# Prints the table of $TROUPE_PHASE_LOG and the total wall time since START (seconds since the
# epoch, as `date +%s.%N` prints it).
phase_table() {
  local start="$1"
  [ -n "${TROUPE_PHASE_LOG:-}" ] && [ -f "$TROUPE_PHASE_LOG" ] || return 0
  echo "---- phases (wall seconds) ----"
  cat "$TROUPE_PHASE_LOG"
  awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "phase %-22s %8.1f s\n", "TOTAL", b - a }'
}
