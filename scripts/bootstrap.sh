#!/usr/bin/env bash
# Create .venv and install Trainyard with pinned dependencies (idempotent; reinstalls when the pins change).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.trainyard-installed
# Locked packages installed without their dependencies, after the rest (requirements.lock says why for each).
NO_DEPS='^tinker_cookbook=='
if [ ! -f "$stamp" ] || [ requirements.lock -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing Python dependencies into .venv (log: .venv/install.log) ..."
  {
    .venv/bin/python -m pip install --upgrade pip &&
    # The CPU build of torch first, so nothing else can pull a CUDA build.
    .venv/bin/python -m pip install torch==2.13.0 &&
    .venv/bin/python -m pip install -r <(grep -v -E "$NO_DEPS" requirements.lock) &&
    .venv/bin/python -m pip install --no-deps $(grep -E "$NO_DEPS" requirements.lock) &&
    .venv/bin/python -m pip install --no-deps -e .
  } > .venv/install.log 2>&1 || { tail -n 40 .venv/install.log; echo "install failed: see .venv/install.log" >&2; exit 1; }
  touch "$stamp"
fi
# Debian packages the platform uses where the host lacks them: apt_install WHAT "IF IT FAILS" PACKAGE...
# (apt-get update only when the install fails without it; sudo when not root).
apt_install() {
  local what=$1 otherwise=$2 sudo=""
  shift 2
  echo "installing Debian's $* for $what ..."
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo="sudo"
  { $sudo apt-get install -y -q "$@" >/dev/null 2>&1 \
    || { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q "$@" >/dev/null 2>&1; }; } \
    || echo "could not install $*: $otherwise" >&2
}
# Deterministic mode's kernels (kernels/csrc/invariant.c) need a C compiler; built here once so that the first use
# does not wait for it (kernels/native.py builds it on demand otherwise).
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
  apt_install "deterministic mode's kernels" "deterministic mode will refuse to start" gcc libc6-dev
fi
# jemalloc for the services that hold models (docker-compose.yml's training environment; without it they run on the
# default allocator, with more memory).
if ! .venv/bin/python -c "import ctypes.util, sys; sys.exit(ctypes.util.find_library('jemalloc') is None)"; then
  apt_install "the training services" "the training services use the default allocator" libjemalloc2
fi
# bubblewrap for the evaluator sandbox (services/evaluators/sandbox.py): without it uploaded evaluators are refused.
if ! command -v bwrap >/dev/null 2>&1; then
  apt_install "the evaluator sandbox" "evaluators (reward functions) will be refused" bubblewrap
fi
.venv/bin/python -c "from kernels import native; native.build()" \
  || echo "building deterministic mode's kernels failed: deterministic mode will refuse to start" >&2
