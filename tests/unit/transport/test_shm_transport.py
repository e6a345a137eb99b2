import multiprocessing as mp
import os
import threading

import numpy as np
import pytest

from pdserve.errors import TransferTimeout
from pdserve.faults.corrupt import CorruptingTransport
from pdserve.transport import (
    CopyOp,
    Direction,
    RegionOps,
    SharedSegment,
    ShmTransport,
    TransferStatus,
    block_copy_ops,
    segment_name,
)
from pdserve.transport.shared_segment import SHM_DIR
from tests.unit.transport import peer

BLOCK = 4096
NUM_BLOCKS = 64


@pytest.fixture
def local_segment():
    segment = SharedSegment.create(segment_name("shmtest", "local"), BLOCK * NUM_BLOCKS)
    yield segment
    segment.close()


@pytest.fixture
def remote_segment():
    segment = SharedSegment.create(segment_name("shmtest", "remote"), BLOCK * NUM_BLOCKS)
    yield segment
    segment.close()


@pytest.fixture
def transport(local_segment, remote_segment):
    """A transport whose 'peer' is a segment of this same process (the two-process test is below)."""
    t = ShmTransport()
    t.register_region(0, local_segment.address, local_segment.size, local_segment.name)
    t.attach_peer("peer", [_descriptor_of(remote_segment)])
    yield t
    t.close()


def _descriptor_of(segment):
    from pdserve.transport import RegionDescriptor

    return RegionDescriptor(0, segment.size, segment.name, None)


def _array(segment):
    return np.frombuffer(segment.mmap, dtype=np.uint8)


def _run(transport, direction, ops, peer_id="peer", region_id=0):
    handle = transport.submit(peer_id, direction, [RegionOps(region_id, tuple(ops))])
    return transport.wait(handle, 10), handle


def test_write_and_read_scattered_blocks_in_one_process(transport, local_segment, remote_segment):
    local, remote = _array(local_segment), _array(remote_segment)
    local[:] = peer.pattern(local.size, 1)
    status, handle = _run(transport, Direction.WRITE, block_copy_ops([1, 2, 7], [30, 5, 6], BLOCK))
    assert status is TransferStatus.DONE and handle.error is None
    assert handle.num_bytes == 3 * BLOCK and handle.seconds >= 0
    for src, dst in [(1, 30), (2, 5), (7, 6)]:
        assert np.array_equal(remote[dst * BLOCK : (dst + 1) * BLOCK], local[src * BLOCK : (src + 1) * BLOCK])
    assert not remote[:5 * BLOCK].any(), "bytes outside the destination blocks stay untouched"

    remote[:] = peer.pattern(remote.size, 2)
    status, _ = _run(transport, Direction.READ, block_copy_ops([0, 63], [9, 10], BLOCK))
    assert status is TransferStatus.DONE
    assert np.array_equal(local[:BLOCK], remote[9 * BLOCK : 10 * BLOCK])
    assert np.array_equal(local[63 * BLOCK :], remote[10 * BLOCK : 11 * BLOCK])


@pytest.mark.parametrize(
    "op, words",
    [
        (CopyOp(NUM_BLOCKS * BLOCK - 10, 0, 11), ["local_offset=262134", "length=11", "local size 262144"]),
        (CopyOp(0, NUM_BLOCKS * BLOCK, 1), ["remote_offset=262144", "remote size 262144"]),
        (CopyOp(-1, 0, 4), ["local_offset=-1"]),
        (CopyOp(0, 0, -4), ["length=-4"]),
    ],
)
def test_out_of_bounds_op_fails_the_handle_and_copies_nothing(transport, local_segment, remote_segment, op, words):
    _array(local_segment)[:] = 7
    status, handle = _run(transport, Direction.WRITE, [CopyOp(0, 0, BLOCK), op])
    assert status is TransferStatus.FAILED
    assert "region 0" in handle.error and "out of bounds" in handle.error
    for word in words:
        assert word in handle.error
    assert not _array(remote_segment).any(), "a rejected batch copies no byte, not even its valid ops"


def test_unknown_peer_and_unknown_regions_fail_the_handle(transport):
    status, handle = _run(transport, Direction.READ, [CopyOp(0, 0, 1)], peer_id="nobody")
    assert status is TransferStatus.FAILED and "'nobody' is not attached" in handle.error
    status, handle = _run(transport, Direction.READ, [CopyOp(0, 0, 1)], region_id=5)
    assert status is TransferStatus.FAILED and "no local region 5" in handle.error


def test_missing_or_short_peer_segment_fails_attach_naming_each_region(transport, local_segment, remote_segment):
    from pdserve.errors import TransferError
    from pdserve.transport import RegionDescriptor

    bad = [
        RegionDescriptor(0, 100, "pdserve-0-no-such-segment", None),
        RegionDescriptor(1, local_segment.size * 2, local_segment.name, None),
        RegionDescriptor(2, 10, None, 0x1000),
    ]
    with pytest.raises(TransferError) as info:
        transport.attach_peer("peer", bad)
    message = str(info.value)
    assert "peer 'peer'" in message and "region 0" in message and "does not exist" in message
    assert "region 1" in message and f"has {local_segment.size} bytes, need {local_segment.size * 2}" in message
    assert "region 2 has no shm segment name" in message
    status, handle = _run(transport, Direction.WRITE, [CopyOp(0, 0, 1)])
    assert status is TransferStatus.FAILED and "'peer' is not attached" in handle.error, "a failed attach detaches"
    transport.attach_peer("peer", [_descriptor_of(remote_segment)])
    status, handle = _run(transport, Direction.WRITE, [CopyOp(0, 0, 1)], region_id=0)
    assert status is TransferStatus.DONE


def test_region_the_peer_does_not_have_fails_the_handle(transport, local_segment):
    transport.register_region(1, local_segment.address, 16, local_segment.name)
    status, handle = _run(transport, Direction.READ, [CopyOp(0, 0, 1)], region_id=1)
    assert status is TransferStatus.FAILED and "'peer' has no region 1" in handle.error


def test_attach_is_idempotent_and_detach_forgets_the_peer(transport, remote_segment):
    mapping = transport._peers["peer"]
    transport.attach_peer("peer", [_descriptor_of(remote_segment)])
    assert transport._peers["peer"] is mapping
    transport.detach_peer("peer")
    transport.detach_peer("peer")
    status, handle = _run(transport, Direction.READ, [CopyOp(0, 0, 1)])
    assert status is TransferStatus.FAILED and "not attached" in handle.error


def test_wait_times_out_while_the_copy_thread_is_busy(transport):
    release = threading.Event()
    transport.set_copy_hook(lambda direction, ranges: release.wait(10))
    handle = transport.submit("peer", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, 8),))])
    with pytest.raises(TransferTimeout, match="not finished after 0.050 s"):
        transport.wait(handle, 0.05)
    assert transport.poll(handle) is TransferStatus.PENDING
    release.set()
    assert transport.wait(handle, 10) is TransferStatus.DONE


def test_close_fails_queued_transfers_joins_thread_and_leaves_no_file(local_segment):
    remote = SharedSegment.create(segment_name("shmtest", "closing"), BLOCK)
    t = ShmTransport(name="closing")
    t.register_region(0, local_segment.address, local_segment.size, local_segment.name)
    t.attach_peer("p", [_descriptor_of(remote)])
    release, entered = threading.Event(), threading.Event()
    t.set_copy_hook(lambda direction, ranges: (entered.set(), release.wait(10)))
    first = t.submit("p", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, 8),))])
    queued = t.submit("p", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, 8),))])
    assert entered.wait(10)  # the copy thread is inside the first transfer
    threading.Timer(0.1, release.set).start()
    t.close()
    t.close()
    assert first.status is TransferStatus.DONE
    assert queued.status is TransferStatus.FAILED and "closed" in queued.error
    late = t.submit("p", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, 8),))])
    assert late.status is TransferStatus.FAILED and "closed" in late.error
    assert not [th for th in threading.enumerate() if th.name == "pdserve-closing-copy"]
    remote.close()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"pdserve-{os.getpid()}-shmtest-closing")]


@pytest.mark.parametrize("direction", [Direction.WRITE, Direction.READ])
def test_corrupting_transport_inverts_the_delivered_bytes(transport, local_segment, remote_segment, direction):
    local, remote = _array(local_segment), _array(remote_segment)
    local[:] = peer.pattern(local.size, 3)
    remote[:] = peer.pattern(remote.size, 4)
    corrupting = CorruptingTransport(transport)
    status, _ = _run(corrupting, direction, block_copy_ops([2], [3], BLOCK))
    assert status is TransferStatus.DONE and corrupting.num_corrupted == 1
    if direction is Direction.WRITE:
        source, delivered = local[2 * BLOCK : 3 * BLOCK], remote[3 * BLOCK : 4 * BLOCK]
    else:
        source, delivered = remote[3 * BLOCK : 4 * BLOCK], local[2 * BLOCK : 3 * BLOCK]
    expected = source.copy()
    expected[1::2] ^= 0x80  # the sign bit of each little-endian 16-bit value
    assert np.array_equal(delivered, expected)
    assert corrupting.local_descriptors() == transport.local_descriptors()


def test_two_processes_write_and_read_scattered_blocks(local_segment):
    """The peer owns its region in another process; we READ and WRITE its blocks through shm."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    size = BLOCK * NUM_BLOCKS
    proc = ctx.Process(target=peer.segment_owner, args=(child_conn, "twoproc", size, 11), daemon=True)
    proc.start()
    try:
        assert conn.poll(30), "peer process did not start"
        _, name, remote_size = conn.recv()
        remote_pattern = peer.pattern(size, 11)
        local = _array(local_segment)
        local[:] = peer.pattern(size, 12)
        from pdserve.transport import RegionDescriptor

        with ShmTransport() as t:
            t.register_region(0, local_segment.address, local_segment.size, local_segment.name)
            t.attach_peer("owner", [RegionDescriptor(0, remote_size, name, None)])

            pairs = [(5, 40), (6, 41), (7, 42), (20, 3), (63, 0)]  # (local block, remote block)
            ops = block_copy_ops([l for l, _ in pairs], [r for _, r in pairs], BLOCK)
            assert len(ops) == 3, "the contiguous run 5,6,7 -> 40,41,42 merged into one copy"
            status, _ = _run(t, Direction.READ, ops, peer_id="owner")
            assert status is TransferStatus.DONE
            for l, r in pairs:
                assert np.array_equal(local[l * BLOCK : (l + 1) * BLOCK], remote_pattern[r * BLOCK : (r + 1) * BLOCK])

            local[:] = peer.pattern(size, 13)
            write_pairs = [(1, 10), (2, 50), (3, 11)]
            ops = block_copy_ops([l for l, _ in write_pairs], [r for _, r in write_pairs], BLOCK)
            status, _ = _run(t, Direction.WRITE, ops, peer_id="owner")
            assert status is TransferStatus.DONE
            for l, r in write_pairs:
                conn.send(("slice", r * BLOCK, (r + 1) * BLOCK))
                assert conn.recv() == local[l * BLOCK : (l + 1) * BLOCK].tobytes()
            conn.send(("slice", 12 * BLOCK, 50 * BLOCK))
            assert conn.recv() == remote_pattern[12 * BLOCK : 50 * BLOCK].tobytes(), "other blocks untouched"
        conn.send(("exit",))
        assert conn.recv() == "closed"
        proc.join(10)
        assert proc.exitcode == 0
        assert not os.path.exists(os.path.join(SHM_DIR, name))
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
