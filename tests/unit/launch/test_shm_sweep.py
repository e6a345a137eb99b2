"""The fallback sweep, on real files in the host's /dev/shm (names unique to each test)."""

import mmap
import os
import secrets
import signal
import time

import pytest

from pdserve.launch.shm_sweep import SHM_DIR, holders, list_entries, sweep, unheld_since
from tests.unit.launch.fakes import host_entries, shm_holder


@pytest.fixture
def token():
    token = f"pdserve-test-{secrets.token_hex(4)}"
    yield token
    for name in host_entries(token):
        os.unlink(os.path.join(SHM_DIR, name))


def create(name: str, size: int = 4096) -> str:
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_only_new_entries_that_nobody_holds_are_removed(token):
    create(f"{token}-old")
    before = list_entries()
    create(f"{token}-left", 8192)
    opened = open(create(f"{token}-open"), "rb")
    fd = os.open(create(f"{token}-mapped"), os.O_RDWR)
    mapped = mmap.mmap(fd, 4096)
    os.close(fd)  # held by the mapping alone
    try:
        assert [e.name for e in unheld_since(before) if token in e.name] == [f"{token}-left"]
        held = holders()
        for name in ("open", "mapped"):
            st = os.stat(os.path.join(SHM_DIR, f"{token}-{name}"))
            assert os.getpid() in held[(st.st_dev, st.st_ino)]
        removed = sweep(before, "test")
        assert [(e.name, e.size) for e in removed if token in e.name] == [(f"{token}-left", 8192)]
        assert host_entries(token) == [f"{token}-mapped", f"{token}-old", f"{token}-open"]
    finally:
        opened.close()
        mapped.close()


def test_an_entry_replaced_under_the_same_name_counts_as_new(token):
    path = create(f"{token}-reused")
    before = list_entries()
    os.unlink(path)
    create(f"{token}-reused")
    assert [e.name for e in sweep(before, "test") if token in e.name] == [f"{token}-reused"]


def test_a_sigkilled_unconfined_tree_is_swept_after_its_group_is_gone(tmp_path, token):
    """The fallback path end to end: what the dead tree left goes, what a live process holds stays."""
    process = shm_holder(tmp_path, token, confine_with=None)
    ours = open(create(f"{token}-ours"), "rb")  # appeared after its start, but held by us
    try:
        assert host_entries(token) == sorted([f"psm_{token}", f"sem.{token}-child", f"{token}-ours"])
        os.killpg(process.pid, signal.SIGKILL)
        process.stop(time.monotonic() + 5)
        assert host_entries(token) == [f"{token}-ours"]
    finally:
        ours.close()
        process.stop(time.monotonic() + 5)
