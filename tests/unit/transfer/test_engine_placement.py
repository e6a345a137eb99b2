"""TransferEngine under adaptive placement, two real engines: P learns D's decision from D's
RemoteBlocks or Release (before or after its leg appears), and P's load reaches D; in READ mode,
D's status reaches P."""

from __future__ import annotations

import time

from pdserve.config import TransferMode
from pdserve.placement.messages import DecodeStatus, PrefillLoad
from pdserve.placement.policy import DecodeView
from pdserve.placement.status_view import status_of
from pdserve.transfer.specs import AwaitSpec, CancelSpec
from tests.unit.connector.harness import D_ADDRESS, P_ADDRESS, Pair
from tests.unit.transfer.test_engine_write import recv_spec

WRITE = TransferMode.WRITE


def news(pair: Pair) -> dict:
    out = pair.p.engine.placement.take_news()
    return dict(out.decided) if out else {}


def test_remote_blocks_before_or_after_the_leg_mean_prefill_here():
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(recv_spec(transfer_id="early"))  # D announces before P's leg arrives
        pair.pump_until(lambda: "early" in pair.p.engine._history.early)
        pair.p.engine.await_decision(AwaitSpec("leg-early", "early", D_ADDRESS))
        pair.p.engine.await_decision(AwaitSpec("leg-late", "late", D_ADDRESS))
        assert news(pair) == {"leg-early": True}
        pair.d.engine.add_recv(recv_spec(request_id="req-d2", transfer_id="late"))
        decided = {}
        deadline = time.monotonic() + 5
        while "leg-late" not in decided and time.monotonic() < deadline:
            pair.pump()
            decided.update(news(pair))
        assert decided == {"leg-late": True}


def test_a_release_before_or_after_the_leg_means_d_prefills_it():
    with Pair(WRITE) as pair:
        pair.p.engine.await_decision(AwaitSpec("leg", "t-local", D_ADDRESS))
        pair.d.engine.cancel(CancelSpec("t-local", P_ADDRESS, "decode computes this prompt itself"))
        decided = {}
        deadline = time.monotonic() + 5
        while "leg" not in decided and time.monotonic() < deadline:
            pair.pump()
            decided.update(news(pair))
        assert decided == {"leg": False}
        # a Release that came first (P never saw the leg) is remembered: the leg is dropped at once
        pair.d.engine.cancel(CancelSpec("t-first", P_ADDRESS, "decode computes this prompt itself"))
        pair.pump_until(lambda: "t-first" in pair.p.engine._history.terminal)
        pair.p.engine.await_decision(AwaitSpec("leg2", "t-first", D_ADDRESS))
        assert news(pair) == {"leg2": False}


def first_news(pair: Pair, engine, field: str) -> dict:
    """The first non-empty `field` of `engine`'s WorkerNews, pumping the pair (5 s at most)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pair.pump()
        out = engine.placement.take_news()
        if out and getattr(out, field):
            return dict(getattr(out, field))
    return {}


def test_p_load_reaches_d_rate_limited():
    with Pair(WRITE) as pair:
        pair.p.engine.await_decision(AwaitSpec("leg", "t1", D_ADDRESS))  # P handshakes D
        pair.pump_until(lambda: pair.p.engine.num_peers == 1 and pair.p.engine._peers.ready())
        load = PrefillLoad(P_ADDRESS.host, P_ADDRESS.handshake_port, 777, 0.001, 0.01, 512, time.time())
        pair.p.engine.placement.publish_load(load)
        pair.p.engine.placement.publish_load(load)  # within 20 ms: not sent again
        got = first_news(pair, pair.d.engine, "loads")
        assert got[(P_ADDRESS.host, P_ADDRESS.handshake_port)].queued_tokens == 777
        sent = [s for s in pair.p.notifier.sent if isinstance(s.message, PrefillLoad)]
        assert len(sent) == 1


def test_read_d_status_reaches_p_rate_limited():
    with Pair(TransferMode.READ) as pair:
        pair.d.engine._peers.lookup(P_ADDRESS)  # D meets P when it first reads from it
        pair.pump_until(lambda: pair.d.engine._peers.ready())
        status = status_of(DecodeView(2, 300, 0, 576, None, False), D_ADDRESS.host, D_ADDRESS.handshake_port,
                           time.time(), {"127.0.0.1:6301": 5})
        pair.d.engine.placement.publish_status(status)
        pair.d.engine.placement.publish_status(status)  # within 20 ms: not sent again
        got = first_news(pair, pair.p.engine, "statuses")
        assert got == {(D_ADDRESS.host, D_ADDRESS.handshake_port): status}
        assert len([s for s in pair.d.notifier.sent if isinstance(s.message, DecodeStatus)]) == 1
        assert pair.d.engine.placement.take_news() is None  # a status is P's news, not D's
