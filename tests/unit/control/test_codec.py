import hashlib
import hmac
import os
import time

import msgpack
import pytest

from pdserve.control.codec import Codec
from pdserve.control.messages import (
    MESSAGE_TYPES,
    HandshakeRefused,
    HandshakeReply,
    HandshakeRequest,
    Ping,
    Pong,
    ReadAck,
    ReadDone,
    Release,
    RemoteBlocks,
    WriteDone,
)
from pdserve.errors import AuthenticationError, ProtocolError

SECRET = b"test-secret"
EXAMPLES = [
    HandshakeRequest("engine-d", {"model": "m", "block_size": 16, "dtype": "bfloat16"}),
    HandshakeReply(
        "engine-p",
        {"model": "m"},
        [{"region_id": 0, "size": 4096, "shm_name": "pdserve-1-x-kv0", "address": None}],
        [[0, 0, 256, 16], [0, 4096, 256, 16]],
    ),
    HandshakeRefused("block size differs: 16 vs 32"),
    RemoteBlocks("tx-1", [4, 5, 9], 0),
    WriteDone("tx-1", True),
    WriteDone("tx-2", False, "peer segment missing"),
    Release("tx-1"),
    ReadDone("tx-1", [1, 2, 3]),
    ReadAck("tx-1", False, "no KV is held for transfer tx-1"),
    Ping(),
    Pong(),
]


def _frame(envelope: dict, secret: bytes = SECRET) -> bytes:
    body = msgpack.packb(envelope, use_bin_type=True)
    return hmac.new(secret, body, hashlib.sha256).digest() + body


def _envelope(**overrides) -> dict:
    envelope = {
        "v": 1,
        "type": "release",
        "sender": "engine-x",
        "ts": time.time(),
        "nonce": os.urandom(16),
        "payload": {"transfer_id": "tx-1"},
    }
    envelope.update(overrides)
    return envelope


@pytest.fixture
def codec():
    return Codec(SECRET, "engine-x")


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(codec, msg):
    envelope = Codec(SECRET, "engine-y").decode(codec.encode(msg))
    assert envelope.message == msg and type(envelope.message) is type(msg)
    assert envelope.sender == "engine-x"
    assert abs(envelope.ts - time.time()) < 5


def test_encode_refuses_non_messages(codec):
    with pytest.raises(TypeError, match="not a registered wire message"):
        codec.encode({"transfer_id": "x"})


def test_tampered_body_or_other_secret_fails_the_mac(codec):
    frame = bytearray(codec.encode(Release("tx-1")))
    frame[-1] ^= 0x01
    with pytest.raises(AuthenticationError, match="bad MAC"):
        codec.decode(bytes(frame))
    with pytest.raises(AuthenticationError, match="bad MAC"):
        Codec(b"another-secret", "y").decode(codec.encode(Release("tx-1")))


def test_stale_and_future_timestamps_are_rejected(codec):
    with pytest.raises(AuthenticationError, match="stale message: sent 60"):
        codec.decode(_frame(_envelope(ts=time.time() - 60)))
    with pytest.raises(AuthenticationError, match="from the future"):
        codec.decode(_frame(_envelope(ts=time.time() + 60)))


def test_replayed_nonce_is_rejected(codec):
    frame = codec.encode(Release("tx-1"))
    codec.decode(frame)
    with pytest.raises(AuthenticationError, match="replayed message: nonce"):
        codec.decode(frame)


def test_nonce_cache_stays_bounded():
    codec = Codec(SECRET, "x", max_nonces=10)
    for _ in range(50):
        codec.decode(codec.encode(Ping()))
    assert len(codec._seen) <= 10


@pytest.mark.parametrize(
    "envelope, error",
    [
        (_envelope(type="launch_missiles"), "unknown message type 'launch_missiles'"),
        (_envelope(payload={}), "release: missing field(s) ['transfer_id']"),
        (_envelope(payload={"transfer_id": "t", "x": 1}), "release: unexpected field(s) ['x']"),
        (_envelope(payload={"transfer_id": 7}), "release: field 'transfer_id' must be str, got int"),
        (
            _envelope(type="remote_blocks", payload={"transfer_id": "t", "block_ids": [1, "2"], "first_block": 0}),
            "field 'block_ids' item 1 must be int, got str",
        ),
        (
            _envelope(type="write_done", payload={"transfer_id": "t", "ok": 1}),
            "field 'ok' must be bool, got int",
        ),
        (
            _envelope(type="remote_blocks", payload={"transfer_id": "t", "block_ids": [1], "first_block": True}),
            "field 'first_block' must be int, got bool",
        ),
        (_envelope(v=2), "unsupported envelope version 2"),
        ({**_envelope(), "extra": 1}, "envelope keys must be"),
        (_envelope(nonce=b"short"), "nonce must be 16 bytes"),
        (_envelope(sender=5), "envelope field 'sender' has type int"),
    ],
)
def test_malformed_envelopes_are_rejected_with_the_reason(codec, envelope, error):
    envelope = {**envelope, "ts": time.time()}  # built at collection time: make it fresh, not stale
    with pytest.raises(ProtocolError) as info:
        codec.decode(_frame(envelope))
    assert error in str(info.value)
    assert not isinstance(info.value, AuthenticationError)


def test_default_fields_may_be_omitted(codec):
    frame = _frame(_envelope(type="write_done", payload={"transfer_id": "t", "ok": True}))
    assert codec.decode(frame).message == WriteDone("t", True, "")


@pytest.mark.parametrize(
    "raw, error",
    [
        (b"", "frame too short"),
        (b"x" * 32, "frame too short"),
        (None, "frame must be bytes"),
    ],
)
def test_garbage_frames_are_rejected(codec, raw, error):
    with pytest.raises(ProtocolError, match=error):
        codec.decode(raw)


def test_signed_garbage_body_is_rejected_as_not_msgpack(codec):
    body = b"\xc1\xc1\xc1"
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        codec.decode(hmac.new(SECRET, body, hashlib.sha256).digest() + body)
    body = msgpack.packb([1, 2])
    with pytest.raises(ProtocolError, match="envelope must be a map"):
        codec.decode(hmac.new(SECRET, body, hashlib.sha256).digest() + body)
