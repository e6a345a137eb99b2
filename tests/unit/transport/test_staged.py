"""StagedTransport (kv_buffer_device: cpu): device KV through pinned host mirrors and the host
transports, with CPU tensors standing in for device memory."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pdserve.errors import TransferError
from pdserve.transport import CopyOp, Direction, RegionOps, ShmTransport, TransferStatus, block_copy_ops
from pdserve.transport.cpu_backend import CpuStandIn
from pdserve.transport.nixl_auto import PeerRoute, RoutedTransport
from pdserve.transport.staged import StagedTransport

BLOCK = 4096
NUM_BLOCKS = 16
SIZE = BLOCK * NUM_BLOCKS
DEADLINE_S = 20.0


class Side:
    def __init__(self, name: str, fill: int):
        self.device = torch.full((SIZE,), fill, dtype=torch.uint8)
        inner = RoutedTransport("shm", ShmTransport())
        self.transport = StagedTransport(CpuStandIn(f"{name}{os.getpid()}"), inner, f"{name}{os.getpid()}")
        self.transport.register_tensor(0, self.device)

    def block(self, index: int) -> torch.Tensor:
        return self.device[index * BLOCK:(index + 1) * BLOCK]


@pytest.fixture
def sides():
    prefill, decode = Side("p", 0), Side("d", 0)
    prefill.device.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8))
    prefill.transport.attach_peer("d", decode.transport.local_descriptors(), PeerRoute(True))
    decode.transport.attach_peer("p", prefill.transport.local_descriptors(), PeerRoute(True))
    yield prefill, decode
    prefill.transport.close()
    decode.transport.close()


def _wait(transport, handle) -> None:
    assert transport.wait(handle, DEADLINE_S) is TransferStatus.DONE, handle.error


def test_peers_see_host_regions_and_the_inner_transport_s_extras_pass_through(sides):
    prefill, _ = sides
    [desc] = prefill.transport.local_descriptors()
    assert desc.device.is_cpu and desc.shm_name.startswith("/proc/") and desc.ipc is None
    assert prefill.transport.take_attached() == ["shm"] and prefill.transport.transport_of("d") == "shm"


def test_write_stages_then_writes_and_the_receiver_lands_the_blocks(sides):
    prefill, decode = sides
    mine, theirs = [1, 2, 3, 9], [5, 6, 7, 0]
    ops = block_copy_ops(mine, theirs, BLOCK)
    _wait(prefill.transport, prefill.transport.submit("d", Direction.WRITE, [RegionOps(0, ops)],
                                                      not_after=time.monotonic() + DEADLINE_S))
    assert not decode.device.any(), "a WRITE reached D's device memory without D landing it"
    landing = [RegionOps(0, block_copy_ops(theirs, theirs, BLOCK))]
    _wait(decode.transport, decode.transport.land(landing))
    for a, b in zip(mine, theirs):
        assert torch.equal(decode.block(b), prefill.block(a))
    assert decode.device.view(NUM_BLOCKS, BLOCK)[[1, 2, 3, 4]].sum() == 0


def test_read_needs_the_sender_staged_and_lands_in_the_reader_s_device(sides):
    prefill, decode = sides
    held, into = [4, 5, 11], [0, 1, 2]
    _wait(prefill.transport, prefill.transport.stage([RegionOps(0, block_copy_ops(held, held, BLOCK))]))
    handle = decode.transport.submit("p", Direction.READ, [RegionOps(0, block_copy_ops(into, held, BLOCK))])
    _wait(decode.transport, handle)
    for a, b in zip(into, held):
        assert torch.equal(decode.block(a), prefill.block(b))
    assert handle.copy_seconds is not None and handle.num_bytes == 3 * BLOCK


def test_a_failing_step_fails_the_batch_naming_it(sides):
    prefill, _ = sides
    handle = prefill.transport.submit("nobody", Direction.WRITE, [RegionOps(0, (CopyOp(0, 0, BLOCK),))])
    assert prefill.transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED
    assert handle.error == "remote: peer 'nobody' is not attached"
    handle = prefill.transport.submit("d", Direction.READ, [RegionOps(0, (CopyOp(SIZE, 0, 1),))])
    assert prefill.transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED and "out of bounds" in handle.error
    handle = prefill.transport.stage([RegionOps(0, (CopyOp(0, 0, BLOCK),))], not_after=time.monotonic() - 1)
    assert prefill.transport.wait(handle, DEADLINE_S) is TransferStatus.FAILED and "deadline" in handle.error


def test_memory_is_registered_as_tensors_only():
    side = Side("x", 0)
    with pytest.raises(TransferError, match="register_tensor"):
        side.transport.register_region(1, 4096, 4096)
    with pytest.raises(ValueError, match="already registered"):
        side.transport.register_tensor(0, side.device)
    side.transport.close()
