#!/usr/bin/env bash
# The test suite: set up the venv if needed, check the layers and lint, then unit and integration tests
# (integration tests start real vLLM).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
"$root/.venv/bin/ruff" check --quiet pdserve tests scripts
"$root/.venv/bin/lint-imports" --no-cache >/dev/null || "$root/.venv/bin/lint-imports" --no-cache
exec "$root/.venv/bin/python" -m pytest -q -ra --durations=40 tests/unit tests/integration "$@"
