"""The injection matrix of kv_verify digest, two real engines: wrong bytes of every kind (a flipped
bit, a torn block, a block of another request, a block an earlier incarnation left, a stale block a
late copy left) put where they can arise (P's blocks between its hash and the copy or D's read, the
transport as a copy lands, D's blocks after the last copy landed and before D checks), in WRITE and
READ. With the digest on every one fails its transfer and is counted; with it off every one is
served: fences and deadlines prevent these by construction, they cannot see bytes."""

from __future__ import annotations

import ctypes

import pytest

from pdserve.config import TransferMode
from pdserve.control.messages import ReadDone, WriteDone
from tests.unit.connector.harness import Instance, Pair
from tests.unit.transfer.nixl_fakes import SlowNixl
from tests.unit.transfer.transfers import D_BLOCKS, P_BLOCKS, hold, read_recv, send, write_recv

WRITE, READ = TransferMode.WRITE, TransferMode.READ
KINDS = ("bit_flip", "torn", "other_request", "earlier_incarnation", "stale")
OTHER_P_BLOCK = 6  # a P block of another request
LAYER, VICTIM = 1, 2  # the layer and the position of the block the injection spoils


def wrong_bytes(kind: str, good: bytes, before: bytes, other: bytes) -> bytes:
    """`good`: what should be there; `before`: what the block held before the transfer; `other`:
    another request's block."""
    half = len(good) // 2
    return {
        "bit_flip": bytes([good[0] ^ 0x01]) + good[1:],
        "torn": good[:half] + before[half:],  # the copy stopped halfway
        "other_request": other,
        "earlier_incarnation": bytes(b ^ 0x5A for b in good),  # what a restarted P's block held (other bytes)
        "stale": before,  # the copy of that block never landed; what an earlier transfer left stays
    }[kind]


def spoil(side: Instance, block: int, kind: str, before: bytes, other: bytes) -> None:
    start, end = side.block_range(LAYER, block)
    side.segment.mmap[start:end] = wrong_bytes(kind, side.segment.mmap[start:end], before, other)


def run(mode: TransferMode, kind: str, where: str, verify: bool) -> Pair:
    """One transfer with `kind` injected at `where` ("send", "transport", "landing"); the pair, closed."""
    config = {"kv_verify": "digest" if verify else "off"}
    factory = SlowNixl if (where == "send" and mode is WRITE) else None
    with Pair(mode, p_timeouts=config, d_timeouts=config, transport_factory=factory) as pair:
        p, d = pair.p, pair.d
        d_victim, p_victim = D_BLOCKS[VICTIM], P_BLOCKS[VICTIM]
        d_before, other = d.read_block(LAYER, d_victim), p.read_block(LAYER, OTHER_P_BLOCK)
        if where == "transport":
            copier = p if mode is WRITE else d
            copier.transport.set_copy_hook(lambda direction, ranges: _spoil_ranges(ranges, kind, d_before, other))
        if mode is WRITE:
            d.engine.add_recv(write_recv())
            pair.pump_until(lambda: d.notifier.sent, sides=(d,))
            send(p, request_id="req-p", transfer_id="t1")
            if where == "send":  # P's block changes after P hashed it, before the put moves it
                pair.pump_until(lambda: p.transport.agent.running(), sides=(p,))
                spoil(p, p_victim, kind, d_before, other)
                p.transport.agent.end_all()
            pair.pump_until(lambda: p.notifier.messages(WriteDone), sides=(p,))
        else:
            hold(p, request_id="req-p", transfer_id="t1")
            p.finished_req_ids.add("req-p")
            pair.pump(sides=(p,))
            d.engine.add_recv(read_recv())
            pair.pump_until(lambda: d.notifier.messages(ReadDone), sides=(d,))
            if where == "send":  # P's held block changes after D read it, before P answers
                spoil(p, p_victim, kind, d_before, other)
        if where == "landing":  # after the last copy landed, before D checks
            spoil(d, d_victim, kind, d_before, other)
        pair.pump_until(lambda: "req-d" in d.recving)
        return pair


def _spoil_ranges(ranges, kind: str, before: bytes, other: bytes) -> None:
    """In the transport, as a batch lands: the first block-sized piece of its last landed range
    (the ranges are the copy's, blocks merged) is not what P sent."""
    address, length = ranges[-1]
    size = min(length, len(before))
    good = ctypes.string_at(address, size)
    bad = wrong_bytes(kind, good, before[:size], other[:size])
    if bad == good:  # "stale"/"torn" of a block that already held those bytes cannot happen here
        bad = bytes([good[0] ^ 0x01]) + good[1:]
    ctypes.memmove(address, bad, size)


@pytest.mark.parametrize("where", ["send", "transport", "landing"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", [WRITE, READ], ids=lambda m: m.value)
def test_every_injection_is_detected_with_the_digest_on(mode, kind, where):
    pair = run(mode, kind, where, verify=True)
    assert pair.d.failed_recving == {"req-d"}, "wrong KV served"
    assert len(pair.d.engine.stats.digest_mismatches) == 1
    assert pair.d.engine.stats.num_completed == 0


@pytest.mark.parametrize("where", ["send", "transport", "landing"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", [WRITE, READ], ids=lambda m: m.value)
def test_without_the_digest_the_same_injection_is_served(mode, kind, where):
    pair = run(mode, kind, where, verify=False)
    assert pair.d.failed_recving == set() and pair.d.recving == {"req-d"}
