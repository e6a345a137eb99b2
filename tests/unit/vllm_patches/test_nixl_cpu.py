"""The NixlConnector CPU workarounds (vllm_patches/nixl_cpu.py) and the sitecustomize that installs them."""

import os
import subprocess
import sys
import types

from pdserve.vllm_patches import nixl_cpu
from pdserve.vllm_patches.torch_extensions import STARTUP_DIRECTORY


def test_affinity_patch_is_local_to_the_patched_module():
    site = nixl_cpu
    target = types.ModuleType("base_worker")
    target.os = os
    site._without_affinity(target)
    before = os.sched_getaffinity(0)
    assert target.os.sched_setaffinity(0, {0}) is None
    assert os.sched_getaffinity(0) == before
    assert target.os.getpid() == os.getpid() and os.sched_setaffinity is not target.os.sched_setaffinity


def test_pthr_delay_patch_sets_the_delay_on_every_agent(monkeypatch):
    site = nixl_cpu
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



def installed_finders(env: dict[str, str]) -> str:
    """The meta path finders a fresh interpreter with the startup directory on its PYTHONPATH has."""
    code = "import sys; print(' '.join(type(f).__name__ for f in sys.meta_path))"
    paths = [str(STARTUP_DIRECTORY), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_NIXL_")},
           "PYTHONPATH": os.pathsep.join(paths), **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_the_startup_sitecustomize_installs_the_workarounds_only_where_asked():
    assert "_PatchAfterImport" in installed_finders({"PDSERVE_NIXL_NO_AFFINITY": "1"})
    assert "_PatchAfterImport" in installed_finders({"PDSERVE_NIXL_PTHR_DELAY_US": "2000"})
    assert "_PatchAfterImport" not in installed_finders({})
