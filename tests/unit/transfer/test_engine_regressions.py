import time

from pdserve.config import TransferMode
from pdserve.control.messages import ReadAck, ReadDone, Release, RemoteBlocks, WriteDone
from pdserve.transfer.specs import HoldSpec, RecvSpec
from tests.unit.connector.harness import D_ADDRESS, D_IDENTITY, P_ADDRESS, P_IDENTITY, PROMPT_HASH, Pair


def test_hold_failed_by_an_early_release_is_not_confirmable():
    """D gave up (Release) before P's worker saw the hold: P frees the blocks at once, so a later
    ReadDone for them must be refused."""
    with Pair(TransferMode.READ) as pair:
        pair.p.engine.on_message(D_IDENTITY, Release("t1"))
        pair.pump(sides=(pair.p,))  # held early
        pair.p.engine.add_hold(HoldSpec("req-p", "t1", (0, 1), time.time() + 30, PROMPT_HASH))
        pair.p.finished_req_ids.add("req-p")
        pair.pump(sides=(pair.p,))
        assert pair.p.sending == {"req-p"}  # P frees the blocks
        pair.p.engine.on_message(D_IDENTITY, ReadDone("t1", [0, 1], PROMPT_HASH, D_ADDRESS.host, D_ADDRESS.notify_port))
        pair.pump_until(lambda: pair.p.notifier.messages(ReadAck), sides=(pair.p,))
        [ack] = pair.p.notifier.messages(ReadAck)
        assert not ack.ok


def test_engine_keeps_no_state_for_requests_it_never_transferred():
    with Pair(TransferMode.WRITE) as pair:
        for i in range(1000):
            pair.d.engine.take_finished({f"req-{i}"})
        assert pair.d.engine._completions.num_waiting == 0  # noqa: SLF001


def test_recv_failed_by_an_early_write_done_does_not_announce_blocks():
    with Pair(TransferMode.WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.d.engine.on_message(P_IDENTITY, WriteDone("t1", False, "prefill ended"))
        pair.pump(sides=(pair.d,))
        pair.d.engine.add_recv(RecvSpec("req-d", "t1", TransferMode.WRITE, P_ADDRESS, (1, 2), 0, None, None,
                                        PROMPT_HASH))
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        pair.pump_for(0.05)
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.notifier.messages(RemoteBlocks) == []
        assert pair.d.snapshot() == d_before
