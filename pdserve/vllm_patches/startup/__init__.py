"""A directory for PYTHONPATH, holding the `sitecustomize` every Python process under pdserve's vLLM
entry runs at startup (pdserve.vllm_cli puts it there; see sitecustomize.py)."""

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
