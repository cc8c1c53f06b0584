#!/usr/bin/env bash
# Set up specdecode on a fresh machine: a virtual environment in .venv with torch and the package.
#   bash scripts/setup.sh          # runtime only
#   bash scripts/setup.sh --test   # plus the test dependencies (pytest, transformers, ruff)
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: an unpinned requirement would pull the newest (multi-GB CUDA) build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${PIP[@]}" "torch==${TORCH_VERSION}"
fi
if [ "${1:-}" = "--test" ]; then
    "${PIP[@]}" -e ".[test]"
else
    "${PIP[@]}" -e .
fi
