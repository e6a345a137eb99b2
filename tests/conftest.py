"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """models/tiny, built on first use (well under a second)."""
    from pdserve.model.build import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def greedy_reference() -> dict:
    """Greedy generations by configuration name, shared across modules (collocated is the reference)."""
    return {}
