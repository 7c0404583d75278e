#!/usr/bin/env bash
# End-to-end demo on embedded defaults (SQLite, filesystem broker): no servers needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/trainyard demo "$@"
