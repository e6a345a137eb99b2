"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Iterator

import pytest

from pdserve.launch.shm_sweep import ShmEntry, holders, list_entries
from tests.reference_cache import ReferenceCache

SESSION_MARK = "PDSERVE_TEST_SESSION"  # in the environment of every process this run starts
SHM_GRACE_S = 10.0  # processes stopped at the very end may still be releasing their segments


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """models/tiny, built on first use (well under a second)."""
    from pdserve.model.build import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def greedy_reference() -> Iterator[ReferenceCache]:
    """Greedy generations by configuration name, shared across modules (collocated is the reference)."""
    cache = ReferenceCache()
    try:
        yield cache
    finally:
        cache.close()


@pytest.fixture(scope="session", autouse=True)
def dev_shm_left_as_found():
    """Fail the run if it leaves anything in /dev/shm: an entry added since the session began
    that no live process holds, or that a process of this run (or the run itself) still holds.
    Entries held by other people's processes on the same machine are theirs, not a leak."""
    token = secrets.token_hex(8)
    os.environ[SESSION_MARK] = token
    before = list_entries()
    yield
    deadline = time.monotonic() + SHM_GRACE_S
    while (leaks := _shm_leaks(before, token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if leaks:
        listing = ", ".join(f"{e.name} ({e.size / 2**20:.1f} MiB)" for e in sorted(leaks, key=lambda e: e.name))
        pytest.fail(f"the test run left {len(leaks)} entries in /dev/shm: {listing}", pytrace=False)


def _shm_leaks(before: dict[tuple[int, int], ShmEntry], token: str) -> list[ShmEntry]:
    added = [e for inode, e in list_entries().items() if inode not in before]
    if not added:
        return []
    held = holders()
    return [e for e in added if not held.get(e.inode) or any(_of_this_run(pid, token) for pid in held[e.inode])]


def _of_this_run(pid: int, token: str) -> bool:
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{SESSION_MARK}={token}".encode() in f.read().split(b"\0")
    except OSError:
        return False  # gone meanwhile
