#!/usr/bin/env bash
# The reliability suite's soak form (tests/reliability, docs/reliability.md), for manual runs: the same checks as the
# short form CI runs, with more of everything -- 200 generated requests per RPC (TRAINYARD_SOAK_FUZZ), every service
# killed three times in each fault test, 8 sessions x 16 samplers for 300 s (TRAINYARD_SOAK_SECONDS) -- and random
# instead of fixed fuzzing draws. Prints the figures at the end and writes them as JSON to
# TRAINYARD_RELIABILITY_REPORT (default var/reliability-soak.json). Needs Postgres and Redis as scripts/test.sh does;
# extra arguments go to pytest (e.g. -k load).
set -euo pipefail
cd "$(dirname "$0")/.."
export TRAINYARD_SOAK=1
export TRAINYARD_RELIABILITY_REPORT="${TRAINYARD_RELIABILITY_REPORT:-var/reliability-soak.json}"
mkdir -p "$(dirname "$TRAINYARD_RELIABILITY_REPORT")"
exec .venv/bin/python -m pytest -m reliability -p no:cacheprovider -q tests/reliability "$@"
