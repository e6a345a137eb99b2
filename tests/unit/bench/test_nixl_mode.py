import importlib.util
import json
import os
import types

import pytest

from pdserve.errors import ConfigError
from pdserve.launch import nixl_mode
from pdserve.launch.modes import plan
from pdserve.launch.options import UpOptions


def load_sitecustomize():
    spec = importlib.util.spec_from_file_location("nixl_sitecustomize", nixl_mode.PATCH_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no PDSERVE_NIXL_* set here: installs nothing
    return module


def test_affinity_patch_is_local_to_the_patched_module():
    site = load_sitecustomize()
    target = types.ModuleType("base_worker")
    target.os = os
    site._without_affinity(target)
    before = os.sched_getaffinity(0)
    assert target.os.sched_setaffinity(0, {0}) is None
    assert os.sched_getaffinity(0) == before
    assert target.os.getpid() == os.getpid() and os.sched_setaffinity is not target.os.sched_setaffinity


def test_pthr_delay_patch_sets_the_delay_on_every_agent(monkeypatch):
    site = load_sitecustomize()
    made = []
    bindings = types.ModuleType("nixl_cu12._bindings")
    bindings.nixlAgent = lambda name, config: made.append((name, config.pthrDelay))
    bindings.nixlAgentConfig = types.SimpleNamespace
    api = types.ModuleType("nixl_cu12._api")
    api.nixlBind = bindings
    monkeypatch.setenv("PDSERVE_NIXL_PTHR_DELAY_US", "2000")
    site._with_pthr_delay(api)
    api.nixlBind.nixlAgent("a", types.SimpleNamespace(pthrDelay=0))
    assert made == [("a", 2000)]
    assert api.nixlBind.nixlAgentConfig is types.SimpleNamespace  # the rest is the real module's
    bindings.nixlAgent("b", types.SimpleNamespace(pthrDelay=0))
    assert made[-1] == ("b", 0)  # the bindings module itself is untouched


def test_nixl_mode_plan(monkeypatch):
    monkeypatch.setattr(nixl_mode, "nixl_installed", lambda: True)
    deployment = plan(UpOptions(mode="nixl", model="/m", port=38000, cores=(0, 1), prefix_caching=False))
    prefill, decode = deployment.instances
    assert (prefill.cores, decode.cores) == ((0,), (1,))
    assert json.loads(prefill.extra_args[1])["kv_role"] == "kv_producer"
    assert json.loads(decode.extra_args[1])["kv_role"] == "kv_consumer"
    assert prefill.extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != decode.extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert prefill.extra_env["PYTHONPATH"].split(os.pathsep)[0] == str(nixl_mode.PATCH_DIR)
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
