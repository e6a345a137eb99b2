#!/usr/bin/env bash
# The main job: set up the venv if needed, bring up the default deployment on the tiny model,
# run a short client session (TTFT and mean inter-token latency per request), shut down cleanly.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/pdserve" demo --model tiny "$@"
