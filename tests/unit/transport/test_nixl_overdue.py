"""A NIXL copy that outlives its deadline, between two real agents over UCX TCP on 127.0.0.1:
its handle fails only once the request ended, so no byte lands in the destination after the
handle let go of it (releasing a NIXL request stops nothing of an RMA put or get)."""

import os
import time

import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="the nixl extra is part of the test environment (scripts/bootstrap.sh)")

from pdserve.transport import CopyOp, Direction, RegionOps, TransferStatus  # noqa: E402
from pdserve.transport.nixl import NixlTransport  # noqa: E402

SIZE = 192 << 20
SETTLE_S = 1.0  # how long the destination is watched after the handle ended (the late bytes came within 0.41 s)
WAIT_S = 20.0


@pytest.fixture
def agents(monkeypatch):
    """Two NIXL transports in this process, each with its own agent and region: ours (`local`)
    and the peer's (`remote`); UCX over TCP, where a copy runs long enough to outlive a deadline."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    stuck: list[str] = []
    peer = NixlTransport(f"peer-{os.getpid()}", on_stuck_copy=stuck.append)
    ours = NixlTransport(f"ours-{os.getpid()}", on_stuck_copy=stuck.append)
    local, remote = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    try:
        peer.register_region(0, remote.ctypes.data, SIZE)
        ours.register_region(0, local.ctypes.data, SIZE)
        ours.attach_peer(peer._agent.name, peer.local_descriptors(), peer.local_endpoint())
        yield ours, peer._agent.name, local, remote, stuck
    finally:
        ours.close()
        peer.close()


@pytest.mark.parametrize("direction", [Direction.WRITE, Direction.READ])
def test_a_copy_past_its_deadline_lets_go_of_its_memory_only_after_its_last_byte(agents, direction):
    ours, peer_id, local, remote, stuck = agents
    source, destination = (local, remote) if direction is Direction.WRITE else (remote, local)
    whole = [RegionOps(0, (CopyOp(0, 0, SIZE),))]
    source[:] = 1
    warm = ours.submit(peer_id, direction, whole)
    assert ours.wait(warm, WAIT_S) is TransferStatus.DONE, warm.error
    assert warm.copy_seconds > 0.02, f"{SIZE} bytes took {warm.copy_seconds:.3f} s: too fast to outlive a deadline"
    handle, not_after, deadline_in = None, 0.0, 0.005
    for value in range(2, 6):  # a deadline inside the copy: after it began, before it ended
        source[:] = value
        not_after = time.monotonic() + deadline_in
        handle = ours.submit(peer_id, direction, whole, not_after=not_after)
        assert ours.wait(handle, WAIT_S), "the copy's handle never ended"
        at_release = destination.copy()  # the handle let go of the destination: it must not change any more
        if handle.status is TransferStatus.DONE:
            deadline_in /= 4  # the copy beat its deadline
        elif "before the copy started" in handle.error:
            deadline_in *= 4  # a loaded machine posted it late
        else:
            break
    assert handle.status is TransferStatus.FAILED and "deadline passed during the copy" in handle.error, handle
    time.sleep(SETTLE_S)
    changed = int(np.count_nonzero(destination != at_release))
    assert changed == 0, f"{changed} bytes landed after the handle of a {direction.name} let go of the memory"
    assert np.all(destination == value), "the request ran to its end before its handle failed"
    print(f"{direction.name}: the copy ended {handle.finished - not_after:.3f} s after its deadline")
    assert stuck == []
