"""A real install: `pip install <checkout>` into a fresh virtual environment that sees this one's packages
(vLLM, vllm-router: "an environment that has vLLM"), then `pdserve up --host 0.0.0.0 --mode write
--model tiny -- --max-num-seqs 8` from an empty directory serves a completion, the flag reaching both
instances, its model and logs in the user's cache directory, nothing written in the environment."""

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.integration

CHECKOUT = Path(__file__).resolve().parents[2]
NOT_PACKAGED = (".git", ".venv", ".cache", "models", "runs", "benchmarks", "build", "*.egg-info", "__pycache__",
                ".pytest_cache", ".ruff_cache", ".import_linter_cache")
PORT = 18960


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The fresh environment's directory, with pdserve installed from a copy of the checkout."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    shutil.copytree(CHECKOUT, source, ignore=shutil.ignore_patterns(*NOT_PACKAGED))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "host-packages.pth").write_text("".join(f"{p}\n" for p in ours))
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", str(source)], check=True, timeout=300, env=_env(root))
    return venv


def _env(root: Path) -> dict[str, str]:
    """No work directory given, HOME in the temp dir, this environment's scripts (vllm-router) on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDSERVE_WORK_DIR", "PDSERVE_HOME", "XDG_CACHE_HOME", "PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "HOME": str(root / "home"), "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"}


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def test_version(installed):
    done = subprocess.run([installed / "bin" / "pdserve", "--version"], capture_output=True, text=True, timeout=60,
                          env=_env(installed.parent))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pdserve 0.1.0"


def test_up_from_an_empty_directory_serves_and_writes_only_to_the_cache(installed):
    root = installed.parent
    empty = root / "empty"
    empty.mkdir()
    env = _env(root)
    work = Path(env["HOME"]) / ".cache" / "pdserve"
    assert not work.exists()
    venv_before = _tree(installed)
    up = subprocess.run([installed / "bin" / "pdserve", "up", "--mode", "write", "--model", "tiny", "--port", str(PORT),
                         "--host", "0.0.0.0", "--enforce-eager", "--kv-cache", "256MiB", "--detach", "--", "--max-num-seqs", "8"],
                        cwd=empty, env=env, capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, up.stdout + up.stderr
    pid = int(up.stdout.split("supervisor pid ")[1].split()[0])
    try:
        assert _listens_on_every_interface(PORT)
        endpoint = f"http://127.0.0.1:{PORT}"
        model = requests.get(f"{endpoint}/v1/models", timeout=30).json()["data"][0]["id"]
        answer = requests.post(f"{endpoint}/v1/completions", timeout=120, json={
            "model": model, "prompt": "The old sailor carried the rope", "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
    finally:
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid, 120)
    assert (work / "models" / "tiny" / "model.safetensors").is_file()
    (run,) = (work / "runs").iterdir()
    assert {"prefill.log", "decode.log", "router.log", "front.log", "up.log"} <= {p.name for p in run.iterdir()}
    assert _flag_reached(run)
    assert list(empty.iterdir()) == []
    assert _tree(installed) == venv_before, "pdserve wrote into its environment"


def _listens_on_every_interface(port: int) -> bool:
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return any(row[1] == f"00000000:{port:04X}" and row[3] == "0A" for row in rows)  # 0A: LISTEN


def _flag_reached(run: Path) -> bool:
    """vLLM logs its non-default arguments: the flag given after -- reached both instances."""
    return all("max_num_seqs" in (run / f"{name}.log").read_text() for name in ("prefill", "decode"))


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                return  # exited; only its parent has not reaped it yet
        except FileNotFoundError:
            return
        time.sleep(0.5)
    pytest.fail(f"the supervisor {pid} did not stop within {timeout:.0f} s of SIGTERM")
