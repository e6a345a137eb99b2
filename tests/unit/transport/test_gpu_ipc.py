"""GpuIpcTransport with CPU tensors standing in for device memory (cpu_backend.py): the peer is a
real second process whose region we map through its handle; the CUDA backend is gpu_check.py's."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from pdserve.errors import TransferError
from pdserve.transport import CopyOp, Direction, RegionDescriptor, RegionOps, TransferStatus, block_copy_ops
from pdserve.transport import gpu_ipc as gpu_ipc_module
from pdserve.transport.cpu_backend import CpuStandIn
from pdserve.transport.device import MemoryDevice
from pdserve.transport.gpu_ipc import GpuIpcTransport
from tests.unit.transport.peer import gpu_ipc_owner, pattern

BLOCK = 4096
NUM_BLOCKS = 32
SIZE = BLOCK * NUM_BLOCKS
DEADLINE_S = 20.0


class Owner:
    """The peer process: a GpuIpcTransport holding `pattern(SIZE, seed)` in region 0."""

    def __init__(self, seed: int = 1):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=gpu_ipc_owner, args=(child, f"own{os.getpid()}", SIZE, seed), daemon=True)
        self.process.start()
        assert self.conn.poll(DEADLINE_S), "the peer did not start"
        self.descriptors = [RegionDescriptor.from_wire(d) for d in self.conn.recv()]

    def bytes(self, start: int, stop: int) -> bytes:
        self.conn.send(("bytes", start, stop))
        assert self.conn.poll(DEADLINE_S)
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(("exit",))
            self.conn.poll(DEADLINE_S)
        self.process.join(DEADLINE_S)


@pytest.fixture
def pair():
    owner = Owner()
    local = torch.zeros(SIZE, dtype=torch.uint8)
    transport = GpuIpcTransport(CpuStandIn(f"loc{os.getpid()}"))
    transport.register_tensor(0, local)
    transport.attach_peer("owner", owner.descriptors)
    yield transport, local, owner
    transport.close()
    owner.stop()


def _scattered(seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.permutation(NUM_BLOCKS)[:20].tolist(), rng.permutation(NUM_BLOCKS)[:20].tolist()


def test_read_and_write_move_scattered_blocks_between_processes(pair):
    transport, local, owner = pair
    mine, theirs = _scattered(3)
    ops = block_copy_ops(mine, theirs, BLOCK)
    handle = transport.submit("owner", Direction.READ, [RegionOps(0, ops)], not_after=time.monotonic() + DEADLINE_S)
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.DONE, handle.error
    remote = pattern(SIZE, 1)
    for a, b in zip(mine, theirs):
        assert local[a * BLOCK:(a + 1) * BLOCK].numpy().tobytes() == remote[b * BLOCK:(b + 1) * BLOCK].tobytes()
    local.copy_(torch.from_numpy(pattern(SIZE, 2)))
    handle = transport.submit("owner", Direction.WRITE, [RegionOps(0, ops)])
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.DONE, handle.error
    assert handle.num_bytes == 20 * BLOCK and handle.copy_seconds is not None
    for a, b in zip(mine, theirs):
        assert owner.bytes(b * BLOCK, (b + 1) * BLOCK) == local[a * BLOCK:(a + 1) * BLOCK].numpy().tobytes()


def test_a_batch_out_of_bounds_fails_before_any_byte_moves(pair):
    transport, local, _ = pair
    handle = transport.submit("owner", Direction.READ, [RegionOps(0, (CopyOp(0, 0, BLOCK), CopyOp(0, SIZE, 1)))])
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED and "out of bounds" in handle.error
    assert not local.any()
    handle = transport.submit("nobody", Direction.READ, [RegionOps(0, (CopyOp(0, 0, BLOCK),))])
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED and "not attached" in handle.error


def test_a_dead_peer_fails_the_next_transfer_and_its_mapping_is_released(pair):
    transport, _, owner = pair
    assert transport.usage().mapped_regions == 1
    os.kill(owner.process.pid, signal.SIGKILL)
    time.sleep(0.2)  # not reaped yet: a zombie is gone too
    handle = transport.submit("owner", Direction.READ, [RegionOps(0, (CopyOp(0, 0, BLOCK),))])
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
    assert f"peer 'owner': process {owner.process.pid} that exported the region has exited" in handle.error
    assert transport.usage() == (1, 0, 0), "the dead peer's mapping outlived the failure"
    transport.detach_peer("owner")
    assert transport.usage() == (0, 0, 0)
    owner.process.join(DEADLINE_S)
    with pytest.raises(TransferError, match="has exited"):
        transport.attach_peer("owner", owner.descriptors)


def test_attach_names_every_region_it_cannot_map():
    good = GpuIpcTransport(CpuStandIn("good"))
    good.register_tensor(0, torch.zeros(BLOCK, dtype=torch.uint8))
    [desc] = good.local_descriptors()
    foreign = RegionDescriptor(1, BLOCK, None, 4096, MemoryDevice("cuda", 0), desc.ipc._replace(kind="cuda"))
    bare = RegionDescriptor(2, BLOCK, None, 4096)
    with GpuIpcTransport(CpuStandIn("other")) as other:
        with pytest.raises(TransferError) as info:
            other.attach_peer("p", [desc, foreign, bare, bare])
        message = str(info.value)
        assert "region 1 is on cuda:0" in message and "region 2 is described more than once" in message
        assert other.usage() == (0, 0, 0)
        other.attach_peer("p", [desc])
        assert other.usage() == (1, 1, 0)
        other.attach_peer("p", [desc])  # the same again: no new mapping
        assert other.usage() == (1, 1, 0)
    good.close()


def test_regions_are_registered_as_tensors_only():
    with GpuIpcTransport(CpuStandIn("reg")) as transport:
        with pytest.raises(TransferError, match="register_tensor"):
            transport.register_region(0, 4096, 4096)
        transport.register_tensor(0, torch.zeros(16))
        with pytest.raises(ValueError, match="already registered"):
            transport.register_tensor(0, torch.zeros(16))
        [desc] = transport.local_descriptors()
        assert desc.size == 64 and desc.ipc.kind == "shm" and desc.device.is_cpu


class HeldEvents(CpuStandIn):
    """The stand-in, with events that complete only when the test releases them."""

    def __init__(self, token: str):
        super().__init__(token)
        self.release = False
        self.ready_complete = True

    def record(self, stream):
        return self

    def record_ready(self):
        return "ready"

    def done(self, event) -> bool:
        return self.ready_complete if event == "ready" else self.release

    def on_stream(self, stream):
        return nullcontext()


def test_a_peer_detached_mid_copy_stays_mapped_until_the_copy_completed():
    backend = HeldEvents("held")
    with GpuIpcTransport(backend) as transport, GpuIpcTransport(CpuStandIn("peer")) as peer:
        peer.register_tensor(0, torch.ones(SIZE, dtype=torch.uint8))
        transport.register_tensor(0, torch.zeros(SIZE, dtype=torch.uint8))
        transport.attach_peer("peer", peer.local_descriptors())
        handle = transport.submit("peer", Direction.READ, [RegionOps(0, (CopyOp(0, 0, SIZE),))])
        time.sleep(0.1)
        transport.detach_peer("peer")
        assert handle.status is TransferStatus.PENDING and transport.usage() == (0, 1, 1)
        backend.release = True
        assert transport.wait(handle, DEADLINE_S) is TransferStatus.DONE
        assert transport.usage() == (0, 0, 0)


def test_the_deadline_fails_a_batch_whose_layer_is_never_written():
    backend = HeldEvents("late")
    backend.ready_complete = False
    with GpuIpcTransport(backend) as transport, GpuIpcTransport(CpuStandIn("peer2")) as peer:
        peer.register_tensor(0, torch.ones(SIZE, dtype=torch.uint8))
        local = torch.zeros(SIZE, dtype=torch.uint8)
        transport.register_tensor(0, local)
        transport.attach_peer("peer", peer.local_descriptors())
        handle = transport.submit("peer", Direction.READ, [RegionOps(0, (CopyOp(0, 0, SIZE),))],
                                  not_after=time.monotonic() + 0.1)
        assert transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
        assert handle.error == "deadline passed before the copy started" and not local.any()


def test_close_waits_for_copies_in_flight_and_fails_them(monkeypatch):
    monkeypatch.setattr(gpu_ipc_module, "SETTLE_DEADLINE_S", 0.3)
    backend = HeldEvents("closing")
    transport = GpuIpcTransport(backend)
    with GpuIpcTransport(CpuStandIn("peer3")) as peer:
        peer.register_tensor(0, torch.ones(SIZE, dtype=torch.uint8))
        transport.register_tensor(0, torch.zeros(SIZE, dtype=torch.uint8))
        transport.attach_peer("peer", peer.local_descriptors())
        handle = transport.submit("peer", Direction.READ, [RegionOps(0, (CopyOp(0, 0, SIZE),))])
        time.sleep(0.1)
        transport.close()
        assert handle.status is TransferStatus.PENDING, "a copy still in flight was reported over"
        assert transport.usage().mapped_regions == 1, "memory a copy may still use was unmapped"
        backend.release = True
        transport._copier.progress()
        assert handle.status is TransferStatus.FAILED and "closed during the transfer" in handle.error
