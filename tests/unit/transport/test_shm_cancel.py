"""Cancelling queued batches and start deadlines, with the real ShmTransport and real segments."""

import threading
import time

import numpy as np
import pytest

from pdserve.faults.corrupt import CorruptingTransport
from pdserve.transport import (
    CopyOp,
    Direction,
    RegionDescriptor,
    RegionOps,
    SharedSegment,
    ShmTransport,
    TransferStatus,
    segment_name,
)

SIZE = 4096
ONE_BLOCK = [RegionOps(0, (CopyOp(0, 0, 64),))]
OTHER_BLOCK = [RegionOps(0, (CopyOp(64, 64, 64),))]


@pytest.fixture
def setup():
    local = SharedSegment.create(segment_name("cancel", "local"), SIZE)
    remote = SharedSegment.create(segment_name("cancel", "remote"), SIZE)
    transport = ShmTransport(name="canceltest")
    transport.register_region(0, local.address, SIZE, local.name)
    transport.attach_peer("peer", [RegionDescriptor(0, SIZE, remote.name, None)])
    np.frombuffer(local.mmap, dtype=np.uint8)[:] = 7
    yield transport, np.frombuffer(remote.mmap, dtype=np.uint8)
    transport.close()
    local.close()
    remote.close()


def _block_the_copy_thread(transport):
    """Submit a batch whose copy hook holds the copy thread until the returned event is set."""
    entered, release = threading.Event(), threading.Event()
    transport.set_copy_hook(lambda direction, ranges: (entered.set(), release.wait(10)))
    first = transport.submit("peer", Direction.WRITE, ONE_BLOCK)
    assert entered.wait(10), "the copy thread never started the first batch"
    return first, release


def test_cancel_fails_a_queued_batch_and_copies_nothing(setup):
    transport, remote = setup
    first, release = _block_the_copy_thread(transport)
    queued = transport.submit("peer", Direction.WRITE, OTHER_BLOCK)
    assert transport.cancel(queued) is True
    assert queued.status is TransferStatus.FAILED and queued.error == "cancelled"
    assert transport.cancel(queued) is False, "a finished handle cannot be cancelled again"
    assert transport.cancel(first) is False, "a batch already copying runs to its end"
    release.set()
    assert transport.wait(first, 10) is TransferStatus.DONE
    follower = transport.submit("peer", Direction.WRITE, ONE_BLOCK)
    assert transport.wait(follower, 10) is TransferStatus.DONE, "the copy thread went on after the cancelled batch"
    assert not remote[64:128].any(), "the cancelled batch wrote nothing"
    assert transport.cancel(first) is False


def test_a_batch_that_would_start_after_its_deadline_fails_without_copying(setup):
    transport, remote = setup
    first, release = _block_the_copy_thread(transport)
    late = transport.submit("peer", Direction.WRITE, OTHER_BLOCK, not_after=time.monotonic() + 0.05)
    in_time = transport.submit("peer", Direction.WRITE, ONE_BLOCK, not_after=time.monotonic() + 60)
    time.sleep(0.2)
    release.set()
    assert transport.wait(late, 10) is TransferStatus.FAILED
    assert late.error == "deadline passed before the copy started"
    assert transport.wait(in_time, 10) is TransferStatus.DONE
    assert not remote[64:128].any(), "the late batch wrote nothing"
    assert remote[:64].all()


def test_the_corrupting_wrapper_passes_cancel_and_deadlines_through(setup):
    transport, remote = setup
    wrapper = CorruptingTransport(transport)
    first, release = _block_the_copy_thread(transport)
    queued = wrapper.submit("peer", Direction.WRITE, OTHER_BLOCK, not_after=time.monotonic() + 60)
    assert queued.not_after is not None
    assert wrapper.cancel(queued) is True
    release.set()
    assert transport.wait(first, 10) is TransferStatus.DONE
    assert queued.status is TransferStatus.FAILED and not remote[64:128].any()
