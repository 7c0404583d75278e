#!/usr/bin/env bash
# The full test suite. Needs PostgreSQL (127.0.0.1:5432, trust auth) and Redis (127.0.0.1:6379) running;
# TRAINYARD_TEST_PG / TRAINYARD_TEST_REDIS point elsewhere. Installs Debian's chromium for the browser tests, which
# then must run (TRAINYARD_REQUIRE_BROWSER=1: a missing Chromium fails them); their screenshots are kept under
# test-artifacts/screenshots/. Then runs deterministic mode's tests under every CPU kernel path
# (scripts/test_deterministic.sh; skip with TRAINYARD_SKIP_KERNEL_MATRIX=1).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh || exit 1
if ! command -v chromium >/dev/null 2>&1; then
  echo "installing Debian's chromium for the browser test ..."
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium >/dev/null 2>&1; } \
    || echo "could not install chromium: the browser tests will fail" >&2
fi
export TRAINYARD_REQUIRE_BROWSER=${TRAINYARD_REQUIRE_BROWSER:-1}
export TRAINYARD_TEST_ARTIFACTS=${TRAINYARD_TEST_ARTIFACTS:-$PWD/test-artifacts}
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
[ "$rc" -ne 0 ] && exit "$rc"
# Deterministic mode's tests again under each CPU kernel path (MKL / oneDNN / torch ISA caps, kernel builds, threads).
if [ "${TRAINYARD_SKIP_KERNEL_MATRIX:-0}" != "1" ]; then
  bash scripts/test_deterministic.sh -q || exit 1
fi
exit 0
