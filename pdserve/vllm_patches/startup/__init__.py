"""A directory for PYTHONPATH, holding pdserve's `sitecustomize`, run at startup by every Python
process under pdserve's vLLM entry (pdserve.vllm_patches.torch_extensions puts it there) and by the
`nixl` mode's instances (launch/nixl_mode.py); see sitecustomize.py."""
