import json
import os

import pytest

from pdserve.errors import ConfigError
from pdserve.launch import nixl_mode
from pdserve.launch.modes import plan
from pdserve.launch.options import UpOptions
from pdserve.vllm_patches.torch_extensions import STARTUP_DIRECTORY


def test_nixl_mode_plan(monkeypatch):
    monkeypatch.setattr(nixl_mode, "nixl_installed", lambda: True)
    deployment = plan(UpOptions(mode="nixl", model="/m", port=38000, cores=(0, 1), prefix_caching=False))
    prefill, decode = deployment.instances
    assert (prefill.cores, decode.cores) == ((0,), (1,))
    assert json.loads(prefill.extra_args[1])["kv_role"] == "kv_producer"
    assert json.loads(decode.extra_args[1])["kv_role"] == "kv_consumer"
    assert prefill.extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode.extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert prefill.extra_env["PYTHONPATH"].split(os.pathsep)[0] == str(STARTUP_DIRECTORY)  # its sitecustomize installs the workarounds
    assert prefill.extra_env["PDSERVE_NIXL_NO_AFFINITY"] == "1"
    assert "--no-enable-prefix-caching" in prefill.vllm_args
    router = deployment.router
    assert router.extra_args == ("--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url)
    assert all(38000 <= p < 39000 for p in deployment.ports)


def test_nixl_mode_refuses_without_nixl_or_two_cores(monkeypatch):
    monkeypatch.setattr(nixl_mode, "nixl_installed", lambda: False)
    with pytest.raises(ConfigError, match="not installed"):
        plan(UpOptions(mode="nixl", cores=(0, 1)))
    monkeypatch.setattr(nixl_mode, "nixl_installed", lambda: True)
    with pytest.raises(ConfigError, match="two cores"):
        plan(UpOptions(mode="nixl", cores=(0,)))
