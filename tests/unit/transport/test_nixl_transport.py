"""NixlTransport between two real NIXL agents in two processes (UCX: CMA on one host, or TCP)."""

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="the nixl extra is part of the test environment (scripts/bootstrap.sh)")

from pdserve.transport import CopyOp, Direction, RegionOps, TransferStatus, block_copy_ops  # noqa: E402
from pdserve.transport.nixl import NixlTransport  # noqa: E402

BLOCK = 4096
NUM_BLOCKS = 64
BIG = 256 << 20  # the agent-death test's region: big enough that some transfers are in flight at the kill
DEADLINE_S = 20.0


def _pattern(start: int, length: int) -> np.ndarray:
    cycle = np.arange(251, dtype=np.uint8)
    return np.tile(cycle, length // 251 + 2)[start % 251:start % 251 + length]


def _peer_main(conn, size: int) -> None:
    """The other process: one region of `size` bytes holding (i % 251), served by commands."""
    transport = NixlTransport("peer")
    region = _pattern(0, size)
    transport.register_region(0, region.ctypes.data, size)
    conn.send(([d.to_wire() for d in transport.local_descriptors()], transport.local_endpoint()))
    while True:
        command, *args = conn.recv()
        if command == "bytes":
            start, length = args
            conn.send(region[start:start + length].tobytes())
        elif command == "exit":
            transport.close()
            conn.send("closed")
            return


class Peer:
    def __init__(self, size: int):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child, size), daemon=True)
        self.process.start()
        assert self.conn.poll(DEADLINE_S), "the peer process did not start its agent"
        from pdserve.transport import RegionDescriptor
        wire, self.endpoint = self.conn.recv()
        self.descriptors = [RegionDescriptor.from_wire(d) for d in wire]

    def bytes(self, start: int, length: int) -> bytes:
        self.conn.send(("bytes", start, length))
        assert self.conn.poll(DEADLINE_S)
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("exit",))
            self.conn.poll(DEADLINE_S)
        self.process.join(DEADLINE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(DEADLINE_S)


@pytest.fixture
def pair():
    peer = Peer(NUM_BLOCKS * BLOCK)
    local = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    transport = NixlTransport(f"local-{os.getpid()}")
    transport.register_region(0, local.ctypes.data, local.nbytes)
    transport.attach_peer("peer", peer.descriptors, peer.endpoint)
    yield transport, local, peer
    transport.close()
    peer.stop()


def test_read_of_scattered_blocks_lands_each_block_where_asked(pair):
    transport, local, _ = pair
    remote_blocks, local_blocks = [3, 4, 5, 17, 40, 2], [10, 11, 12, 0, 63, 30]
    ops = block_copy_ops(local_blocks, remote_blocks, BLOCK)
    assert len(ops) == 4, "blocks contiguous on both sides were merged into one copy"
    handle = transport.submit("peer", Direction.READ, [RegionOps(0, ops)])
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.DONE, handle.error
    assert handle.num_bytes == len(remote_blocks) * BLOCK and handle.copy_seconds is not None
    for lb, rb in zip(local_blocks, remote_blocks):
        assert np.array_equal(local[lb * BLOCK:(lb + 1) * BLOCK], _pattern(rb * BLOCK, BLOCK)), (lb, rb)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local_blocks))
    assert not any(local[b * BLOCK:(b + 1) * BLOCK].any() for b in untouched), "a block nobody asked for changed"


def test_write_of_scattered_blocks_changes_only_those_blocks_of_the_peer(pair):
    transport, local, peer = pair
    local[:] = 0xAB
    local_blocks, remote_blocks = [0, 1, 9], [7, 8, 50]
    handle = transport.submit("peer", Direction.WRITE, [RegionOps(0, block_copy_ops(local_blocks, remote_blocks, BLOCK))])
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.DONE, handle.error
    remote = np.frombuffer(peer.bytes(0, NUM_BLOCKS * BLOCK), dtype=np.uint8)
    for b in range(NUM_BLOCKS):
        expected = np.full(BLOCK, 0xAB, np.uint8) if b in remote_blocks else _pattern(b * BLOCK, BLOCK)
        assert np.array_equal(remote[b * BLOCK:(b + 1) * BLOCK], expected), f"remote block {b}"


def test_bad_batches_fail_before_any_byte_moves(pair):
    transport, local, _ = pair
    out_of_bounds = transport.submit("peer", Direction.READ, [RegionOps(0, (CopyOp(0, 0, BLOCK), CopyOp(0, NUM_BLOCKS * BLOCK, 1)))])
    unknown_region = transport.submit("peer", Direction.READ, [RegionOps(5, (CopyOp(0, 0, BLOCK),))])
    unknown_peer = transport.submit("nobody", Direction.READ, [RegionOps(0, (CopyOp(0, 0, BLOCK),))])
    for handle, words in ((out_of_bounds, "out of bounds"), (unknown_region, "no local region 5"),
                          (unknown_peer, "not attached")):
        assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
        assert words in handle.error
    assert not local.any(), "a failed batch copied something"


def test_a_batch_whose_start_deadline_passed_fails_and_copies_nothing(pair):
    transport, local, _ = pair
    late = transport.submit("peer", Direction.READ, [RegionOps(0, (CopyOp(0, BLOCK, BLOCK),))], not_after=time.monotonic() - 1)
    assert transport.wait(late, DEADLINE_S) is TransferStatus.FAILED
    assert late.error == "deadline passed before the copy started"
    assert not local.any()
    in_time = transport.submit("peer", Direction.READ, [RegionOps(0, (CopyOp(0, BLOCK, BLOCK),))], not_after=time.monotonic() + 60)
    assert transport.wait(in_time, DEADLINE_S) is TransferStatus.DONE, in_time.error


def test_attach_without_the_peers_own_agent_metadata_names_the_cause(pair):
    transport, _, peer = pair
    from pdserve.errors import TransferError
    with pytest.raises(TransferError, match="no NIXL agent metadata"):
        transport.attach_peer("other", peer.descriptors, b"")
    with pytest.raises(TransferError, match="metadata of agent 'peer'"):
        transport.attach_peer("other", peer.descriptors, peer.endpoint)
    handle = transport.submit("peer", Direction.READ, [RegionOps(0, (CopyOp(0, 0, BLOCK),))])
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.DONE, "a refused attach broke the real peer"


def test_an_agent_that_dies_mid_transfer_fails_the_transfer_at_once(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # the cross-host path, slow enough to kill the peer mid-copy
    peer = Peer(BIG)
    local = np.zeros(BIG, dtype=np.uint8)
    local[::4096] = 1  # fault every page in before timing anything
    transport = NixlTransport(f"local-{os.getpid()}", copy_timeout_s=DEADLINE_S)
    try:
        transport.register_region(0, local.ctypes.data, BIG)
        transport.attach_peer("peer", peer.descriptors, peer.endpoint)
        whole = [RegionOps(0, (CopyOp(0, 0, BIG),))]
        warm = transport.submit("peer", Direction.READ, whole)
        assert transport.wait(warm, DEADLINE_S) is TransferStatus.DONE, warm.error
        assert warm.seconds > 0.05, f"{BIG} bytes took {warm.seconds:.3f} s: too fast to kill the peer mid-copy"
        handle = transport.submit("peer", Direction.READ, whole)
        time.sleep(warm.seconds / 4)
        assert handle.status is TransferStatus.PENDING, "the transfer ended before the peer was killed"
        os.kill(peer.process.pid, signal.SIGKILL)
        peer.process.join(DEADLINE_S)
        killed = time.monotonic()
        assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
        assert time.monotonic() - killed < 2.0, "the dead peer was noticed only at the copy timeout"
        assert "DISCONNECT" in handle.error, handle.error
        after = transport.submit("peer", Direction.WRITE, whole)
        assert transport.wait(after, DEADLINE_S) is TransferStatus.FAILED, "a transfer to a dead peer succeeded"
    finally:
        transport.close()
        peer.stop()
    assert not transport._in_flight, "a request was left in flight after close"
