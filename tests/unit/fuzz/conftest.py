"""Hypothesis keeps its caches out of the repository: in a temporary directory per session."""

import shutil
import tempfile

import pytest
from hypothesis import configuration

_HOME = tempfile.mkdtemp(prefix="pdserve-hypothesis-")
configuration.set_hypothesis_home_dir(_HOME)


@pytest.fixture(scope="session", autouse=True)
def _remove_hypothesis_home():
    yield
    shutil.rmtree(_HOME, ignore_errors=True)
