#!/usr/bin/env bash
# Sets up a virtual environment for Troupe's Python API: the bindings (`pip install ./python`,
# a release build of the PyO3 extension) and the `troupe` binary the cluster starts engines
# and hosts with, installed next to the venv's python (where `import troupe` finds it).
#
#   bash scripts/python-env.sh              # -> .venv
#   .venv/bin/python examples/python/grpo.py
#
# VENV=path picks another location. Needs python3 with venv (Debian: python3-venv) and the Rust
# toolchain; pip fetches maturin, numpy and ml_dtypes from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
VENV="${VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check numpy ml_dtypes
export CARGO_TARGET_DIR="$ROOT/target"
cargo build --release --quiet --bin troupe
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check ./python
install -m 755 "$ROOT/target/release/troupe" "$VENV/bin/troupe"
echo "ready: $VENV/bin/python examples/python/grpo.py"
