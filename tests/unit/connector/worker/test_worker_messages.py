"""What the worker's control-plane server passes on to the engine (worker.py: `TRANSFER_MESSAGES`)."""

from __future__ import annotations

from pdserve.connector.worker.worker import TRANSFER_MESSAGES
from pdserve.control.messages import (
    MESSAGE_TYPES,
    ClockSkew,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    Ping,
    Pong,
)
from pdserve.control.registration import Registration


def test_the_worker_hands_the_engine_every_message_but_the_handshake_ping_and_registration():
    """A message type the worker's server does not pass on is dropped with a warning in a real
    deployment, whatever the engine would do with it (the engine tests, tests/unit/transfer/, bypass the server).
    A Registration is for the router's registrar, never for a worker; a ClockSkew notice for the
    socket that sent a refused frame."""
    conversation = {HandshakeRequest, HandshakeReply, HandshakeRefused, Ping, Pong, Registration, ClockSkew}
    assert set(TRANSFER_MESSAGES) == set(MESSAGE_TYPES.values()) - conversation
