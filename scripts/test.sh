#!/usr/bin/env bash
# The test suite: set up the venv if needed, then unit and integration tests (integration tests start real vLLM).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q -ra --durations=40 tests/unit tests/integration "$@"
