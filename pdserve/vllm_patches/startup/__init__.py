"""A directory for PYTHONPATH, holding the `sitecustomize` every Python process under pdserve's vLLM
entry runs at startup (pdserve.vllm_patches.torch_extensions puts it there; see sitecustomize.py)."""
