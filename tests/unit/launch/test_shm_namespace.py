"""The private /dev/shm wrapper: its command line, and real process trees killed with SIGKILL."""

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from pdserve.launch.process import group_members
from pdserve.launch.shm_namespace import (
    HEADROOM_BYTES,
    MOUNT_SOURCE,
    ShmNamespace,
    confine,
    namespace_available,
    tmpfs_bytes,
)
from pdserve.launch.shm_sweep import holders
from tests.unit.launch.fakes import host_entries, shm_holder


def test_wrap_runs_the_command_in_a_new_mount_namespace_with_a_sized_tmpfs():
    argv = ShmNamespace(5 << 30).wrap(("taskset", "-c", "0", "python", "-m", "x", "--arg", "a b"))
    assert argv[:5] == ("unshare", "--mount", "--propagation", "private", "--")
    assert argv[5:7] == ("sh", "-c")
    assert 'mount -t tmpfs -o "$1" pdserve-shm /dev/shm' in argv[7] and argv[7].endswith('exec "$@"')
    assert argv[8:10] == (MOUNT_SOURCE, f"size={5 << 30},mode=1777,nosuid,nodev")
    assert argv[10:] == ("taskset", "-c", "0", "python", "-m", "x", "--arg", "a b")  # untouched, unquoted
    with pytest.raises(ValueError):
        ShmNamespace(1 << 20).wrap(())


def test_tmpfs_holds_the_kv_cache_and_headroom():
    assert tmpfs_bytes(1 << 30) == (1 << 30) + HEADROOM_BYTES and HEADROOM_BYTES >= 1 << 30


def test_confine_wraps_where_possible_else_asks_for_a_sweep():
    confined = confine(("true",), 1 << 20)
    assert confined.sweep_shm is not namespace_available()
    assert (confined.argv[0] == "unshare") is namespace_available()
    assert subprocess.run(confined.argv, timeout=30).returncode == 0


def test_the_wrapped_command_keeps_its_pid_and_exit_code():
    argv = ShmNamespace(1 << 20).wrap((sys.executable, "-c", "import os, sys; print(os.getpid()); sys.exit(7)"))
    if not namespace_available():
        argv = argv[argv.index(sys.executable):]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=30)
    assert int(out) == child.pid and child.returncode == 7


def test_a_mount_that_fails_exits_125_without_running_the_command():
    if not namespace_available():
        pytest.skip("no private mount namespace on this machine: nothing is mounted")
    argv = ShmNamespace(1 << 20).wrap(("true",))
    argv = (*argv[:9], "size=not-a-size", *argv[10:])
    assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 125


def test_sigkilled_tree_leaves_the_hosts_dev_shm_as_it_was(tmp_path):
    """However the machine confines it (namespace or sweep), nothing of the tree stays in /dev/shm."""
    token = f"pdserve-test-{secrets.token_hex(4)}"
    process = shm_holder(tmp_path, token, confine_with=64 << 20)
    try:
        private = sorted(n for n in os.listdir(f"/proc/{process.pid}/root/dev/shm") if token in n)
        assert private == [f"psm_{token}", f"sem.{token}-child"]  # the tree's own /dev/shm, whichever it is
        if namespace_available():
            assert host_entries(token) == []  # private: never visible on the host
            with open(f"/proc/{process.pid}/mountinfo") as f:
                mounts = f.read().splitlines()
            shm_mount = [m for m in mounts if " /dev/shm " in m][-1]
            assert f"tmpfs {MOUNT_SOURCE} " in shm_mount and "size=65536k" in shm_mount
        else:
            assert host_entries(token) == private
        os.killpg(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while group_members(process.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        process.stop(time.monotonic() + 5)  # the fallback sweeps here
    assert host_entries(token) == []


def test_an_inode_held_in_a_private_namespace_does_not_protect_the_hosts_file_of_that_name(tmp_path):
    if not namespace_available():
        pytest.skip("no private mount namespace on this machine")
    token = f"pdserve-test-{secrets.token_hex(4)}"
    host_file = f"/dev/shm/psm_{token}"
    with open(host_file, "wb") as f:
        f.write(b"x")
    try:
        process = shm_holder(tmp_path, token, confine_with=16 << 20)
        try:
            host = os.stat(host_file)
            private = os.stat(f"/proc/{process.pid}/root/dev/shm/psm_{token}")
            assert (private.st_dev, private.st_ino) != (host.st_dev, host.st_ino)
            held = holders()
            assert (host.st_dev, host.st_ino) not in held  # same path, other file: compared by inode
            assert process.pid in held[(private.st_dev, private.st_ino)]
        finally:
            process.stop(time.monotonic() + 5)
    finally:
        os.unlink(host_file)


def test_without_unshare_one_warning_and_the_sweep_instead(monkeypatch, caplog):
    from pdserve.launch import shm_namespace

    monkeypatch.setattr(shm_namespace.shutil, "which", lambda name: None)
    namespace_available.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="pdserve.launch.shm_namespace"):
            assert confine(("true",), 1 << 20) == (("true",), True)
            assert confine(("false",), 1 << 20) == (("false",), True)
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "no unshare command" in warnings[0] and "sweeping" in warnings[0]
    finally:
        namespace_available.cache_clear()  # the next caller probes the real machine again
