"""A copy that outlives its deadline (a NIXL put or get: nothing stops it) hands its blocks back
only once it ended: P says WriteDone(ok=False) only after its puts ended, D reports the failure
(vLLM then recomputes into, or reuses, the blocks) only after its gets ended. The real
NixlTransport runs on a stand-in agent whose requests run until the test ends them."""

from __future__ import annotations

import time

from pdserve.config import TransferMode
from pdserve.control.messages import Release, WriteDone
from pdserve.transfer.specs import HoldSpec, RecvSpec, SendSpec
from tests.unit.connector.harness import D_ADDRESS, NUM_LAYERS, P_ADDRESS, PROMPT_HASH, Pair
from tests.unit.transfer.nixl_fakes import SlowNixl

WINDOW_S = 0.3  # D's transfer_timeout: the copies' deadline
OVERDUE_S = 0.5  # how long past it the copies run


def test_write_past_its_deadline_lets_d_reuse_its_blocks_only_after_p_s_puts_ended():
    with Pair(TransferMode.WRITE, d_timeouts={"transfer_timeout": WINDOW_S, "release_grace": 5.0},
              transport_factory=SlowNixl) as pair:
        before = pair.d.snapshot()
        pair.d.engine.add_recv(RecvSpec("req-d", "t1", TransferMode.WRITE, P_ADDRESS, (3, 4, 5, 6), 0, None, None,
                                        PROMPT_HASH))
        pair.p.engine.begin_step()
        pair.p.engine.add_send(SendSpec("req-p", "t1", D_ADDRESS, (0, 1, 2, 3), PROMPT_HASH))
        pair.p.engine.all_layers_ready()
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: pair.p.transport.agent.running())
        pair.pump_for(WINDOW_S + OVERDUE_S)  # past D's deadline and P's write window
        assert pair.p.transport.agent.running(), "the stand-in's puts ended by themselves"
        assert pair.p.notifier.messages(WriteDone) == [], "P said it stopped while its puts ran"
        assert pair.d.recving == set() and pair.p.sending == set(), "blocks handed back while a put ran"
        assert pair.d.snapshot() == before
        ended = time.monotonic()
        pair.p.transport.agent.end_all()  # the puts land their bytes, then end
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        [done] = [s for s in pair.p.notifier.sent if isinstance(s.message, WriteDone)]
        assert not done.message.ok and done.at >= ended
        assert pair.d.failed_recving == {"req-d"}, "a transfer past its deadline was not recomputed"
        assert pair.d.reported_at["req-d"] >= ended and pair.p.reported_at["req-p"] >= ended
        assert pair.p.transport.stuck == [] and not pair.p.engine.has_active() and not pair.d.engine.has_active()


def test_read_past_its_deadline_hands_d_s_blocks_back_only_after_its_gets_ended():
    with Pair(TransferMode.READ, d_timeouts={"transfer_timeout": WINDOW_S}, transport_factory=SlowNixl) as pair:
        pair.p.engine.add_hold(HoldSpec("req-p", "t1", (1, 2), time.time() + 30, PROMPT_HASH))
        pair.d.engine.add_recv(RecvSpec("req-d", "t1", TransferMode.READ, P_ADDRESS, (3, 4), 0, (1, 2), time.time() + 30,
                                        PROMPT_HASH))
        pair.pump_until(lambda: pair.d.transport.agent.running())
        pair.pump_for(WINDOW_S + OVERDUE_S)
        assert pair.d.transport.agent.running(), "the stand-in's gets ended by themselves"
        assert pair.d.recving == set(), "D handed its blocks back while its get still filled them"
        ended = time.monotonic()
        pair.d.transport.agent.end_all()
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}, "a read past its deadline was not recomputed"
        assert pair.d.reported_at["req-d"] >= ended
        for layer in range(NUM_LAYERS):  # the get landed what it read, before the blocks were given back
            assert [pair.d.read_block(layer, b) for b in (3, 4)] == [pair.p.read_block(layer, b) for b in (1, 2)]
        pair.pump_until(lambda: pair.p.notifier is not None and [m for m in pair.d.notifier.messages(Release)])
        assert pair.d.transport.stuck == []
