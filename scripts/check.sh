#!/usr/bin/env bash
# Static gates CI runs before the tests: formatting, clippy with warnings as errors (the
# workspace and the Python extension's crate), no Rust source file over 600 lines (split
# by responsibility instead), and no dependency cycle between the modules of a crate
# (scripts/module-cycles.py: top-level modules and their children). Each gate is a timed phase
# (scripts/phase.sh). With TROUPE_CLIPPY_IN_BUILD=1 (.ci/run) clippy is left to the test build
# (scripts/test-all.sh), which then compiles the workspace's crates with clippy-driver.
#
#   bash scripts/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/phase.sh

fmt() {
  cargo fmt --all --check
  cargo fmt --manifest-path python/Cargo.toml --check
}

clippy() {
  cargo clippy --workspace --all-targets --quiet -- -D warnings &&
    cargo clippy --manifest-path python/Cargo.toml --all-targets --quiet -- -D warnings
}

sizes() {
  local limit=600 long
  long=$(find crates src tests examples python/src -name '*.rs' -print0 \
    | xargs -0 wc -l | awk -v max="$limit" '$2 != "total" && $1 > max { print $2 " (" $1 " lines)" }')
  if [ -n "$long" ]; then
    echo "error: source files over $limit lines (split them by responsibility):" >&2
    echo "$long" >&2
    return 1
  fi
  python3 scripts/module-cycles.py
}

phase gate.fmt fmt
phase gate.sizes-cycles sizes
if [ "${TROUPE_CLIPPY_IN_BUILD:-}" = 1 ]; then
  # CI lints in the test build itself (scripts/test-all.sh runs clippy-driver as the
  # workspace's compiler), so nothing is compiled twice; a lint there fails the build.
  echo "check: fmt, file sizes and module cycles clean; clippy runs in the build (TROUPE_CLIPPY_IN_BUILD=1)"
  exit 0
fi
phase gate.clippy clippy
echo "check: fmt, clippy, file sizes and module cycles clean"
