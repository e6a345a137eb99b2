import hashlib
import hmac
import os
import time

import msgpack
import pytest

from pdserve.control.codec import MAX_FRAME_BYTES, Codec, is_addressed
from pdserve.control.messages import (
    MESSAGE_TYPES,
    HandshakeReply,
    HandshakeRequest,
    Ping,
    ReadAck,
    ReadDone,
    Release,
    WriteDone,
    field_types,
)
from pdserve.errors import AuthenticationError, FencedError, ProtocolError
from tests.unit.control.samples import example

SECRET = b"test-secret"
EXAMPLES = [example(cls) for cls in MESSAGE_TYPES.values()] + [
    example(WriteDone, ok=False, error="peer segment missing", prompt_hash="")
    if "prompt_hash" in field_types(WriteDone) else WriteDone("tx-2", False, "peer segment missing"),
    example(ReadAck, ok=False, error="no KV is held for transfer tx-1"),
]


def _payload(msg, **overrides) -> dict:
    return {**{name: getattr(msg, name) for name in field_types(type(msg))}, **overrides}


def recipient_for(msg) -> str:
    return "engine-y" if is_addressed(type(msg)) else ""


def _frame(envelope: dict, secret: bytes = SECRET) -> bytes:
    body = msgpack.packb(envelope, use_bin_type=True)
    return hmac.new(secret, body, hashlib.sha256).digest() + body


def _envelope(**overrides) -> dict:
    envelope = {
        "v": 2,
        "type": "release",
        "sender": "engine-y",
        "to": "engine-x",
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
    envelope = Codec(SECRET, "engine-y").decode(codec.encode(msg, recipient_for(msg)))
    assert envelope.message == msg and type(envelope.message) is type(msg)
    assert envelope.sender == "engine-x" and envelope.recipient == recipient_for(msg)
    assert abs(envelope.ts - time.time()) < 5


def test_encode_refuses_non_messages(codec):
    with pytest.raises(TypeError, match="not a registered wire message"):
        codec.encode({"transfer_id": "x"})


def test_tampered_body_or_other_secret_fails_the_mac(codec):
    frame = bytearray(codec.encode(Release("tx-1"), "engine-x"))
    frame[-1] ^= 0x01
    with pytest.raises(AuthenticationError, match="bad MAC"):
        codec.decode(bytes(frame))
    with pytest.raises(AuthenticationError, match="bad MAC"):
        Codec(b"another-secret", "y").decode(codec.encode(Release("tx-1"), "y"))


def test_stale_and_future_timestamps_are_rejected(codec):
    with pytest.raises(AuthenticationError, match="stale message: sent 60"):
        codec.decode(_frame(_envelope(ts=time.time() - 60)))
    with pytest.raises(AuthenticationError, match="from the future"):
        codec.decode(_frame(_envelope(ts=time.time() + 60)))


def test_replayed_nonce_is_rejected(codec):
    frame = codec.encode(Release("tx-1"), "engine-x")
    codec.decode(frame)
    with pytest.raises(AuthenticationError, match="replayed message: nonce"):
        codec.decode(frame)


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_timestamps_are_rejected(codec, ts):
    frame = _frame(_envelope(ts=ts))
    with pytest.raises(AuthenticationError, match="not a finite time"):
        codec.decode(frame)


def test_a_full_replay_cache_refuses_new_messages_instead_of_forgetting_fresh_nonces():
    codec = Codec(SECRET, "x", max_nonces=10)
    frames = [codec.encode(Ping()) for _ in range(11)]
    for frame in frames[:10]:
        codec.decode(frame)
    with pytest.raises(AuthenticationError, match="replay cache full"):
        codec.decode(frames[10])
    for frame in frames[:10]:  # every nonce of the flood is still remembered
        with pytest.raises(AuthenticationError, match="replayed message"):
            codec.decode(frame)


def test_nonces_leave_the_cache_with_the_skew_window():
    codec = Codec(SECRET, "x", max_skew_s=30.0, max_nonces=10)
    old = [_frame(_envelope(type="ping", payload={}, to="", ts=time.time() - 29.5)) for _ in range(10)]
    for frame in old:
        codec.decode(frame)
    time.sleep(0.6)  # the ten nonces are now outside the window: forgotten, and refused as stale
    codec.decode(codec.encode(Ping()))
    with pytest.raises(AuthenticationError, match="stale message"):
        codec.decode(old[0])


def test_a_message_for_another_incarnation_is_fenced(codec):
    sender = Codec(SECRET, "engine-y")
    with pytest.raises(FencedError, match="addressed to 'engine-x-old'"):
        codec.decode(sender.encode(Release("tx-1"), recipient="engine-x-old"))
    assert codec.decode(sender.encode(Release("tx-1"), recipient="engine-x")).message == Release("tx-1")


@pytest.mark.parametrize("cls", [c for c in MESSAGE_TYPES.values() if is_addressed(c)], ids=lambda c: c.__name__)
def test_addressed_types_without_a_recipient_are_fenced(codec, cls):
    with pytest.raises(FencedError, match="names no recipient"):
        codec.decode(Codec(SECRET, "engine-y").encode(example(cls)))


def test_unaddressed_types_reach_anyone(codec):
    unaddressed = [c for c in MESSAGE_TYPES.values() if not is_addressed(c)]
    assert unaddressed, "the messages that open a conversation (Ping, HandshakeRequest) need no recipient"
    for cls in unaddressed:
        assert type(codec.decode(Codec(SECRET, "engine-y").encode(example(cls))).message) is cls


def test_decoder_calls_validate_and_passes_its_protocol_error_on(codec, monkeypatch):
    def refuse(self):
        raise ProtocolError(f"release: transfer id {self.transfer_id!r} refused by validate")

    monkeypatch.setattr(Release, "validate", refuse, raising=False)
    with pytest.raises(ProtocolError, match="refused by validate"):
        codec.decode(_frame(_envelope()))


def test_frames_above_the_limit_are_neither_sent_nor_accepted(codec):
    with pytest.raises(ProtocolError, match="max 1048576"):
        codec.encode(example(ReadAck, error="x" * MAX_FRAME_BYTES), "engine-y")
    with pytest.raises(ProtocolError, match="frame too large"):
        codec.decode(b"x" * (MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize(
    "envelope, error",
    [
        (_envelope(type="launch_missiles"), "unknown message type 'launch_missiles'"),
        (_envelope(payload={}), "release: missing field(s) ['transfer_id']"),
        (_envelope(payload={"transfer_id": "t", "x": 1}), "release: unexpected field(s) ['x']"),
        (_envelope(payload={"transfer_id": 7}), "release: field 'transfer_id' must be str, got int"),
        (
            _envelope(type="read_done", payload=_payload(example(ReadDone), block_ids=[1, "2"])),
            "field 'block_ids' item 1 must be int, got str",
        ),
        (
            _envelope(type="write_done", payload={"transfer_id": "t", "ok": 1}),
            "field 'ok' must be bool, got int",
        ),
        (
            _envelope(type="read_ack", payload={"transfer_id": "t", "ok": True, "error": b"x"}),
            "field 'error' must be str, got bytes",
        ),
        (_envelope(v=1), "unsupported envelope version 1"),
        (_envelope(to=7), "envelope field 'to' has type int"),
        (_envelope(sender=""), "envelope sender must be 1..256 characters"),
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
    frame = _frame(_envelope(type="read_ack", payload={"transfer_id": "t", "ok": True}))
    assert codec.decode(frame).message == ReadAck("t", True, "")
    frame = _frame(_envelope(type="handshake_request", payload={"engine_id": "d", "fingerprint": {}}))
    assert codec.decode(frame).message == HandshakeRequest("d", {})  # a requester that proves no host


@pytest.mark.parametrize("proof, digest, error", [
    ("/etc/shadow", "ab" * 32, "host_proof must be /proc/<pid>/fd/<n>"),
    ("/proc/7/fd/3", "", "host_proof_digest must be 64 lowercase hex digits"),
    ("", "ab" * 32, "host_proof_digest must be 64 lowercase hex digits"),
])
def test_a_malformed_host_proof_is_rejected_in_either_handshake_message(codec, proof, digest, error):
    for cls in (HandshakeRequest, HandshakeReply):
        payload = _payload(example(cls), host_proof=proof, host_proof_digest=digest)
        frame = _frame({**_envelope(type=cls.TAG, payload=payload), "ts": time.time()})
        with pytest.raises(ProtocolError, match=error):
            codec.decode(frame)


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
