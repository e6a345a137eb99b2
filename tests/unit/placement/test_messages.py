"""Placement's wire messages are validated: P's load and D's status."""

from __future__ import annotations

import pytest

from pdserve.control.codec import Codec
from pdserve.control.messages import MESSAGE_TYPES
from pdserve.errors import ProtocolError
from pdserve.placement.messages import DecodeStatus, PrefillLoad
from tests.unit.placement.samples import NOW, d_status


def test_prefill_load_names_a_bounded_number_of_transfers():
    PrefillLoad("h", 1, 0, 0.001, 0.0, 512, NOW, counted_transfers=["t"] * 64).validate()
    with pytest.raises(ProtocolError, match="counted transfers"):
        PrefillLoad("h", 1, 0, 0.001, 0.0, 512, NOW, counted_transfers=["t"] * 65).validate()
    with pytest.raises(ProtocolError, match="counted_transfers"):
        PrefillLoad("h", 1, 0, 0.001, 0.0, 512, NOW, counted_transfers=[""]).validate()


def test_prefill_load_message_is_validated():
    with pytest.raises(ProtocolError, match="per_token_s"):
        PrefillLoad("h", 1, 0, float("nan"), 0.0, 512, NOW).validate()
    with pytest.raises(ProtocolError, match="queued_tokens"):
        PrefillLoad("h", 1, -1, 0.001, 0.0, 512, NOW).validate()


@pytest.mark.parametrize("headroom", [0.0, 1.5, float("nan"), -0.2])
def test_a_status_with_a_headroom_outside_0_1_is_refused(headroom):
    with pytest.raises(ProtocolError, match="chunk_headroom"):
        d_status(chunk_headroom=headroom).validate()


def test_a_status_with_half_its_costs_is_refused():
    with pytest.raises(ProtocolError, match="given together"):
        d_status(per_decode_s=None).validate()
    with pytest.raises(ProtocolError, match="placed_local"):
        d_status(placed_local={"": 1}).validate()


def test_placement_registers_its_messages_with_the_control_codec():
    """The codec stays generic: placement's messages reach it through `@message`, and go over the
    wire like the transfer messages, fenced to their recipient."""
    assert MESSAGE_TYPES["prefill_load"] is PrefillLoad and MESSAGE_TYPES["decode_status"] is DecodeStatus
    sender, receiver = Codec(b"secret", "engine-p"), Codec(b"secret", "engine-d")
    for msg in (PrefillLoad("127.0.0.1", 6301, 512, 0.001, 0.005, 512, NOW, counted_transfers=["tx-1"]),
                d_status(placed_local={"127.0.0.1:6301": 2})):
        envelope = receiver.decode(sender.encode(msg, recipient="engine-d"))
        assert envelope.message == msg and envelope.sender == "engine-p"
