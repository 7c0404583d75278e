#!/usr/bin/env bash
# Create .venv and install Trainyard with pinned dependencies (idempotent; reinstalls when the pins change).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.trainyard-installed
if [ ! -f "$stamp" ] || [ requirements.lock -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing Python dependencies into .venv ..."
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU build of torch first, so nothing else can pull a CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -r requirements.lock
  .venv/bin/python -m pip install -q --no-deps -e .
  touch "$stamp"
fi
