#!/usr/bin/env bash
# Every test: the Rust workspace, then the Python bindings' pytest suite (python/).
#
#   bash scripts/test-all.sh
#
# The Python part needs python3 that can make a venv (Debian: python3-venv); without it, it is
# skipped with a warning, unless TROUPE_REQUIRE_PYTHON_BINDINGS=1, which makes it required.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace
if python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
  bash scripts/python-tests.sh
elif [ "${TROUPE_REQUIRE_PYTHON_BINDINGS:-}" = 1 ]; then
  echo "error: TROUPE_REQUIRE_PYTHON_BINDINGS=1 but python3 cannot make a venv (Debian: apt install python3-venv)" >&2
  exit 1
else
  echo "warning: python3 cannot make a venv (Debian: apt install python3-venv); skipping the Python binding tests" >&2
fi
