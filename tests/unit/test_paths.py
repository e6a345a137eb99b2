"""The work directory: the variable, else the source checkout, else the user's cache; never site-packages."""

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import paths


@pytest.fixture
def clean_env(monkeypatch):
    for variable in (*paths.WORK_DIR_VARIABLES, "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_the_variable_wins_and_the_older_name_still_counts(clean_env, tmp_path):
    clean_env.setenv("PDSERVE_HOME", str(tmp_path / "old"))
    assert paths.work_dir() == tmp_path / "old"
    clean_env.setenv("PDSERVE_WORK_DIR", str(tmp_path / "new"))
    assert paths.work_dir() == tmp_path / "new"


def test_a_source_checkout_is_its_own_work_dir(clean_env):
    checkout = Path(paths.__file__).resolve().parents[1]
    assert (checkout / "pyproject.toml").is_file()
    assert paths.work_dir() == checkout == paths.source_checkout()


def test_an_installed_package_uses_the_users_cache(clean_env, tmp_path):
    site = tmp_path / "site-packages"
    (site / "pdserve").mkdir(parents=True)
    (site / "pdserve" / "paths.py").write_text(Path(paths.__file__).read_text())
    (site / "pyproject.toml").write_text('[project]\nname = "other"\n')  # not ours: must not count
    code = "import pdserve.paths as p; print(p.work_dir()); print(p.source_checkout())"
    home = tmp_path / "home"
    for env, expected in (({"HOME": str(home)}, home / ".cache" / "pdserve"),
                          ({"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "xdg")}, tmp_path / "xdg" / "pdserve")):
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "PYTHONPATH": str(site)},
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == [str(expected), "None"]


def test_the_global_flag_sets_the_variable_for_children(clean_env, tmp_path):
    work = tmp_path / "w"
    code = ("import os, sys\nfrom pdserve import cli\nimport pdserve.launch.cli as up\n"
            "up.run_up = lambda args: print(os.environ['PDSERVE_WORK_DIR']) or 0\n"
            "sys.exit(cli.main(['--work-dir', sys.argv[1], 'up']))")
    done = subprocess.run([sys.executable, "-c", code, str(work)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(work) and not work.exists()
