"""IpcHandle: bound to the incarnation that exported it (alive, exited, zombie, pid reused)."""

import os
import signal
import subprocess
import time

from pdserve.transport.ipc_handle import IpcHandle, process_start, process_state


def _child() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "30"])


def test_a_handle_of_a_running_process_is_alive_and_round_trips():
    handle = IpcHandle.for_this_process("shm", ("/proc/1/fd/3", 4096))
    assert handle.owner_pid == os.getpid() and handle.owner_gone() is None
    assert IpcHandle.from_wire(handle.to_wire()) == handle


def test_a_killed_owner_is_gone_already_as_a_zombie_and_after_it_was_reaped():
    child = _child()
    try:
        handle = IpcHandle("cuda", child.pid, process_start(child.pid), ())
        assert handle.owner_gone() is None
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(200):  # the kernel needs a moment to turn it into a zombie
            if process_state(child.pid) == "Z":
                break
            time.sleep(0.01)
        assert "not yet reaped" in handle.owner_gone()
    finally:
        child.kill()
        child.wait()
    assert "has exited" in handle.owner_gone() and "reaped" not in handle.owner_gone()


def test_a_pid_that_now_names_a_younger_process_is_gone():
    handle = IpcHandle("cuda", os.getpid(), process_start(os.getpid()) - 1, ())
    assert "pid was reused" in handle.owner_gone()
