#!/usr/bin/env bash
# Every test: the Rust workspace, then the Python bindings' pytest suite (python/).
#
#   bash scripts/test-all.sh            # everything (what CI runs, after scripts/check.sh)
#   bash scripts/test-all.sh rust       # only the Rust workspace: build, then run the tests
#   bash scripts/test-all.sh python     # only the Python suite (builds what it needs)
#
# Each phase prints `phase NAME SECONDS` when it ends (scripts/phase.sh). The Python part needs
# python3 that can make a venv (Debian: python3-venv); without it, it is skipped with a warning,
# unless TROUPE_REQUIRE_PYTHON_BINDINGS=1, which makes it required.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/phase.sh

# TROUPE_CLIPPY_IN_BUILD=1 (.ci/run sets it): the workspace's crates (and the Python extension's)
# are compiled by clippy-driver, rustc with clippy's lints, warnings denied, instead of rustc,
# so the lints of `cargo clippy --all-targets -D warnings` run in the one build the tests need
# rather than in a second, metadata-only compile of every crate (cargo's own clippy protocol:
# RUSTC_WORKSPACE_WRAPPER and CLIPPY_ARGS, as `cargo clippy` sets them).
if [ "${TROUPE_CLIPPY_IN_BUILD:-}" = 1 ]; then
  driver="$(rustc --print sysroot)/bin/clippy-driver"
  if [ ! -x "$driver" ]; then
    echo "error: TROUPE_CLIPPY_IN_BUILD=1 but there is no clippy-driver at $driver (rustup component add clippy)" >&2
    exit 1
  fi
  export RUSTC_WORKSPACE_WRAPPER="$driver"
  export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
fi

what="${1:-all}"
case "$what" in
  all | rust | python) ;;
  *)
    echo "usage: bash scripts/test-all.sh [all|rust|python]" >&2
    exit 2
    ;;
esac

if [ "$what" != python ]; then
  # The build is its own phase, so a run's table tells compile time from test time.
  # TROUPE_CARGO_TIMINGS=1 (.ci/run sets it) writes cargo's timing report of the build
  # (target/cargo-timings/cargo-timing.html: the crates on the critical path).
  timings=()
  if [ "${TROUPE_CARGO_TIMINGS:-}" = 1 ]; then timings=(--timings); fi
  phase rust.build cargo test --workspace --no-run --quiet "${timings[@]}"
  # TROUPE_BEFORE_TESTS: a file sourced between the build and the tests (.ci/run's: it waits
  # for the tools it installs meanwhile and says which tests they make required).
  if [ -n "${TROUPE_BEFORE_TESTS:-}" ]; then
    phase install.wait . "$TROUPE_BEFORE_TESTS"
  fi
  phase rust.test cargo test --workspace
fi
if [ "$what" != rust ]; then
  if python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
    bash scripts/python-tests.sh
  elif [ "${TROUPE_REQUIRE_PYTHON_BINDINGS:-}" = 1 ]; then
    echo "error: TROUPE_REQUIRE_PYTHON_BINDINGS=1 but python3 cannot make a venv (Debian: apt install python3-venv)" >&2
    exit 1
  else
    echo "warning: python3 cannot make a venv (Debian: apt install python3-venv); skipping the Python binding tests" >&2
  fi
fi
