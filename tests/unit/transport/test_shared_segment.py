import multiprocessing as mp
import os

import pytest

from pdserve.errors import TransferError
from pdserve.transport import SharedSegment, segment_name, sweep_stale_segments
from pdserve.transport.shared_segment import SHM_DIR
from tests.unit.transport import peer


def test_segment_name_carries_pid_and_rejects_bad_parts():
    assert segment_name("tok", "kv0") == f"pdserve-{os.getpid()}-tok-kv0"
    with pytest.raises(ValueError):
        segment_name("a/b", "kv0")


def test_create_attach_share_bytes_and_close_unlinks():
    name = segment_name("segtest", "a")
    segment = SharedSegment.create(name, 8192)
    other = SharedSegment.attach(name)
    try:
        assert other.size == 8192 and segment.address != 0
        segment.mmap[100:104] = b"abcd"
        assert other.mmap[100:104] == b"abcd"
        with pytest.raises(TransferError, match="already exists"):
            SharedSegment.create(name, 10)
        with pytest.raises(TransferError, match="has 8192 bytes, need 9000"):
            SharedSegment.attach(name, 9000)
    finally:
        other.close(unlink=False)
        segment.close()
        segment.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    with pytest.raises(TransferError, match="does not exist"):
        SharedSegment.attach(name)


def test_sweep_removes_dead_pids_segment_but_not_a_live_ones():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=peer.segment_leaker, args=(child, "sweeptest", 4096))
    proc.start()
    leaked = parent.recv()
    proc.join(30)
    assert proc.exitcode == 0
    assert os.path.exists(os.path.join(SHM_DIR, leaked)), "the dead process left its segment behind"
    live = SharedSegment.create(segment_name("sweeptest", "live"), 4096)
    try:
        removed = sweep_stale_segments()
        assert leaked in removed
        assert live.name not in removed
        assert not os.path.exists(os.path.join(SHM_DIR, leaked))
        assert os.path.exists(os.path.join(SHM_DIR, live.name))
    finally:
        live.close()


def test_unlinked_segment_is_reachable_through_proc_fd_and_leaves_no_name():

    seg = SharedSegment.create(segment_name("t", "procfd"), 4096)
    original = os.path.join("/dev/shm", seg.name)
    path = seg.unlink_name()
    assert not os.path.exists(original)
    assert path == f"/proc/{os.getpid()}/fd/{seg._fd}"
    seg.mmap[:4] = b"abcd"
    peer = SharedSegment.attach(path, 4096)
    assert bytes(peer.mmap[:4]) == b"abcd"
    peer.mmap[4:8] = b"efgh"
    assert bytes(seg.mmap[4:8]) == b"efgh"
    peer.close(unlink=False)
    seg.close()
    assert not any(n.startswith(f"pdserve-{os.getpid()}-t-procfd") for n in os.listdir("/dev/shm"))
