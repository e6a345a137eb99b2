"""Nothing of an instance outlives it in /dev/shm: `pdserve up` (collocated, --restart never),
the instance's whole process group SIGKILLed, pdserve exits naming it, the host's /dev/shm as before."""

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.launch.process import group_members
from pdserve.launch.shm_namespace import MOUNT_SOURCE, namespace_available, tmpfs_bytes
from pdserve.launch.shm_sweep import list_entries, unheld_since

pytestmark = pytest.mark.integration

PORT = 18970
KV_CACHE = 256 << 20


def instance_leader(port: int) -> int:
    """The pid of the vLLM instance serving `port` (the leader of its process group)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            leader = os.getpgid(pid) == pid
        except OSError:
            continue  # gone meanwhile
        if leader and b"pdserve.vllm_cli" in argv and str(port).encode() in argv:
            return pid
    raise AssertionError(f"no vLLM instance on port {port}")


def test_sigkilled_instance_leaves_nothing_in_dev_shm(tmp_path):
    before = list_entries()
    ready = tmp_path / "ready"
    up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--mode", "collocated", "--port", str(PORT),
                           "--enforce-eager", "--kv-cache", "256MiB", "--restart", "never", "--ready-file", str(ready)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert up.poll() is None and time.monotonic() < deadline, up.communicate(timeout=60)
            time.sleep(0.5)
        leader = instance_leader(PORT + 1)  # the front has PORT
        private = os.listdir(f"/proc/{leader}/root/dev/shm")  # the instance's own /dev/shm
        assert any(n.startswith("psm_") for n in private), private  # vLLM's segments: the test is not vacuous
        if namespace_available():
            assert not set(private) & set(os.listdir("/dev/shm")), "the instance's segments are on the host"
            with open(f"/proc/{leader}/mountinfo") as f:
                mount = [m for m in f.read().splitlines() if " /dev/shm " in m][-1]
            assert f"tmpfs {MOUNT_SOURCE} " in mount and f"size={tmpfs_bytes(KV_CACHE) >> 10}k" in mount
        os.killpg(leader, signal.SIGKILL)
        _, stderr = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)
            up.communicate(timeout=120)
    assert up.returncode == 1
    assert stderr.strip().splitlines()[-1].startswith("pdserve: error: vllm exited with code -9")
    assert group_members(leader) == []
    left = unheld_since(before)
    assert left == [], f"/dev/shm gained {[(e.name, e.size) for e in left]}"
