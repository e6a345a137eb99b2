"""`transport: gpu-ipc` and `kv_buffer_device`: what each means for KV on a GPU or in host
memory, vLLM's own kv_buffer_device read when pdserve's is absent, and combinations that cannot
move the KV refused naming the field and the rule."""

from __future__ import annotations

import pytest

from pdserve.config import SECRET_FILE_ENV, parse_connector_config
from pdserve.errors import ConfigError

ENV = {SECRET_FILE_ENV: "/run/pdserve/secret"}


def parse(extra: dict, vllm: str | None = None, kv_device: str = "cpu"):
    return parse_connector_config("kv_producer", extra, env=ENV, vllm_kv_buffer_device=vllm, kv_device=kv_device)


@pytest.mark.parametrize("extra, vllm, kv_device, buffer, staging", [
    ({}, None, "cpu", "cpu", False),  # host KV, as today
    ({}, "cpu", "cpu", "cpu", False),  # vLLM's CPU default: the KV's own device, nothing to stage
    ({}, "cuda", "cuda", "cuda", False),  # vLLM's CUDA default: move from the GPU
    ({}, "cpu", "cuda", "cpu", True),  # vLLM's field asks for a host buffer, as for NixlConnector
    ({"kv_buffer_device": "cuda"}, "cpu", "cuda", "cuda", False),  # pdserve's key wins
    ({"kv_buffer_device": "cpu"}, None, "cuda", "cpu", True),
    ({"kv_buffer_device": "cuda"}, None, "cpu", "cuda", False),  # host KV: nothing to stage either way
])
def test_kv_buffer_device_and_when_it_stages(extra, vllm, kv_device, buffer, staging):
    config = parse(extra, vllm, kv_device)
    assert (config.kv_buffer_device, config.host_staging) == (buffer, staging)


def test_gpu_ipc_is_a_transport_for_kv_on_a_gpu():
    assert parse({"transport": "gpu-ipc", "kv_buffer_device": "cuda"}, kv_device="cuda").transport == "gpu-ipc"


@pytest.mark.parametrize("extra, vllm, kv_device, words", [
    ({"kv_buffer_device": "xpu"}, None, "cuda", "kv_connector_extra_config.kv_buffer_device must be cpu"),
    ({"kv_buffer_device": 0}, None, "cuda", "got 0"),
    ({}, "xpu", "xpu", "kv_transfer_config.kv_buffer_device (vLLM's"),
    ({"transport": "gpu-ipc"}, None, "cpu", "transport gpu-ipc moves GPU memory, but the KV cache is in host memory"),
    ({"transport": "gpu-ipc", "kv_buffer_device": "cpu"}, None, "cuda", "kv_buffer_device cpu stages it there"),
    ({"transport": "shm"}, "cuda", "cuda", "transport shm moves host memory, but the KV cache is on cuda"),
    ({"transport": "gpu-ips"}, None, "cuda", "unknown transport 'gpu-ips'"),
])
def test_what_cannot_move_the_kv_is_refused_saying_why(extra, vllm, kv_device, words):
    with pytest.raises(ConfigError) as caught:
        parse(extra, vllm, kv_device)
    assert words in str(caught.value)


def test_host_staging_over_shm_is_accepted():
    assert parse({"transport": "shm", "kv_buffer_device": "cpu"}, kv_device="cuda").host_staging
