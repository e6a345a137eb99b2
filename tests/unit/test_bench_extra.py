"""scipy and matplotlib are the `bench` extra: an instance (connector, plugins) imports neither, and
a bench command without them fails with one line saying how to install them."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ("scipy", "matplotlib")
INSTANCE_MODULES = ("pdserve.connector.connector", "pdserve.connector.plugin", "pdserve.faults.rig")

# Runs in a child: imports `modules`, recording every module whose code imports a package of the
# extra (import statements and importlib.import_module, whether or not it was loaded already).
RECORD_IMPORTERS = """
import builtins, importlib, json, sys
EXTRA = {extra!r}
importers = set()
original_import, original_import_module = builtins.__import__, importlib.import_module
def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.partition(".")[0] in EXTRA:
        importers.add((globals or {{}}).get("__name__", "?"))
    return original_import(name, globals, locals, fromlist, level)
def recording_import_module(name, package=None):
    if name.partition(".")[0] in EXTRA:
        importers.add(sys._getframe(1).f_globals.get("__name__", "?"))
    return original_import_module(name, package)
builtins.__import__, importlib.import_module = recording_import, recording_import_module
for module in {modules!r}:
    __import__(module)
print(json.dumps({{"importers": sorted(importers), "loaded": [m for m in EXTRA if m in sys.modules]}}))
"""

# Runs in a child as if the extra were not installed.
HIDE_EXTRA = "import sys\nfor name in {extra!r}:\n    sys.modules[name] = None\n"


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_extra_holds_scipy_and_matplotlib_and_the_package_does_not():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in project["dependencies"]}
    assert not names & set(EXTRA)
    assert set(EXTRA) <= set(project["optional-dependencies"]["bench"])


def test_an_instance_imports_neither_package():
    child = run_child(RECORD_IMPORTERS.format(extra=EXTRA, modules=INSTANCE_MODULES))
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert "matplotlib" not in result["loaded"]
    # vLLM's own dependencies (transformers) import scipy where it is installed; pdserve never does
    assert not [name for name in result["importers"] if name.startswith("pdserve")]


@pytest.mark.parametrize("command", [["bench", "--report-only", "--out", "{tmp}"],
                                     ["bench-pair", "{tmp}/a:write", "{tmp}/b:write"]])
def test_a_bench_command_without_the_extra_says_how_to_install_it(command, tmp_path):
    argv = [a.format(tmp=tmp_path) for a in command]
    code = HIDE_EXTRA.format(extra=EXTRA) + "from pdserve.cli import main\nraise SystemExit(main(sys.argv[1:]))\n"
    child = run_child(code, *argv)
    assert child.returncode == 1, child.stderr[-3000:]
    lines = [line for line in child.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'pdserve[bench]'" in lines[0], child.stderr[-3000:]
