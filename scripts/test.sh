#!/usr/bin/env bash
# The test suite: set up the venv if needed, check the layers and lint, then the unit tests (two
# processes) and the integration tests (real vLLM, one shared deployment at a time).
#   bash scripts/test.sh           everything CI runs
#   bash scripts/test.sh --fast    lint and unit tests only: the contributor's loop
# Further arguments go to the integration run's pytest (e.g. -k, -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
"$root/.venv/bin/ruff" check --quiet pdserve tests scripts
"$root/.venv/bin/lint-imports" --no-cache >/dev/null || "$root/.venv/bin/lint-imports" --no-cache
"$root/.venv/bin/python" -m pytest -q -ra -n 2 --dist worksteal --durations=10 -m "not integration" tests/unit
if [ "${1:-}" = "--fast" ]; then
  exit 0
fi
exec "$root/.venv/bin/python" -m pytest -q -ra --durations=60 -m integration tests/integration "$@"
