"""Fuzzing the codec with frames that carry a valid MAC: random envelopes and payloads for every
message type must be refused with a PDServeError or decode to values of the declared types and
ranges; frames with a bad MAC, another recipient, or a nonce seen before are never accepted."""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
import types
import typing

import msgpack
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from pdserve.control.codec import MAX_ID_CHARS, VERSION, Codec, is_addressed
from pdserve.control.messages import MESSAGE_TYPES, field_types
from pdserve.errors import AuthenticationError, FencedError, PDServeError
from tests.unit.control.samples import example
from tests.unit.fuzz.strategies import FLOAT, TEXT, WIRE_VALUE, fuzz_settings, shaped_like

pytestmark = pytest.mark.timeout(120)

SECRET = b"fuzz-secret"
RECEIVER = "fuzz-receiver"
TAGS = sorted(MESSAGE_TYPES)
MAX_SKEW_S = 30.0


def _sign(body: bytes, secret: bytes = SECRET) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest() + body


FIELD_KIND = st.sampled_from(["typed"] * 8 + ["any", "missing"])
ONE_IN_TEN, ONE_IN_TWENTY = st.integers(0, 9), st.integers(0, 19)
EXTRA_FIELDS = st.dictionaries(st.text(max_size=8), WIRE_VALUE, min_size=1, max_size=3)
TAG = st.one_of(st.sampled_from(TAGS), TEXT)
ENVELOPE_VERSION = st.sampled_from([VERSION] * 9 + [VERSION - 1])
SENDER = st.one_of(st.sampled_from(["fuzz-sender"] * 4 + ["", "x" * (MAX_ID_CHARS + 1)]), TEXT)
RECIPIENT = st.one_of(st.sampled_from([RECEIVER] * 4 + [""]), TEXT)
TS_OFFSET = st.one_of(st.floats(-MAX_SKEW_S / 2, MAX_SKEW_S / 2), FLOAT, st.integers(-100, 100))
NONCE = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20))
ENVELOPE_KEY = st.sampled_from(["v", "type", "sender", "to", "ts", "nonce", "payload"])
SHORT_TEXT = st.text(max_size=5)


@st.composite
def payloads(draw, cls) -> dict:
    """Mostly well-typed fields, some of any type, some missing, some extra."""
    payload = {}
    for name, annotation in field_types(cls).items():
        kind = draw(FIELD_KIND)
        if kind == "typed":
            payload[name] = draw(shaped_like(annotation))
        elif kind == "any":
            payload[name] = draw(WIRE_VALUE)
    if draw(ONE_IN_TEN) == 0:
        payload.update(draw(EXTRA_FIELDS))
    return payload


PAYLOADS = {tag: payloads(cls) for tag, cls in MESSAGE_TYPES.items()}


@st.composite
def envelopes(draw) -> dict:
    tag = draw(TAG)
    envelope = {
        "v": draw(ENVELOPE_VERSION),
        "type": tag,
        "sender": draw(SENDER),
        "to": draw(RECIPIENT),
        "ts": time.time() + draw(TS_OFFSET),
        "nonce": draw(NONCE),
        "payload": draw(PAYLOADS[tag]) if tag in PAYLOADS else draw(WIRE_VALUE),
    }
    if draw(ONE_IN_TWENTY) == 0:
        envelope.pop(draw(ENVELOPE_KEY))
    if draw(ONE_IN_TWENTY) == 0:
        envelope[draw(SHORT_TEXT)] = draw(WIRE_VALUE)
    if draw(ONE_IN_TWENTY) == 0:
        envelope["payload"] = draw(WIRE_VALUE)
    return envelope


def _conforms(value, annotation) -> bool:
    """An independent check of a decoded value against its declared type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if origin is list or annotation is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if annotation is bool:
        return type(value) is bool
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, annotation)


def _check_accepted(envelope, tag: str) -> None:
    cls = MESSAGE_TYPES[tag]
    message = envelope.message
    assert type(message) is cls
    for name, annotation in field_types(cls).items():
        assert _conforms(getattr(message, name), annotation), (name, getattr(message, name))
    if hasattr(message, "validate"):
        message.validate()  # what the codec accepted passes the message's own range checks
    assert envelope.recipient in ("", RECEIVER)
    assert envelope.recipient or not is_addressed(cls), "an addressed type was accepted without a recipient"
    assert isinstance(envelope.sender, str) and 0 < len(envelope.sender) <= MAX_ID_CHARS
    assert math.isfinite(envelope.ts) and abs(envelope.ts - time.time()) <= MAX_SKEW_S + 5


@fuzz_settings(max_examples=2500)
@given(envelopes())
def test_signed_random_envelopes_are_refused_or_decode_within_their_types(envelope):
    codec = Codec(SECRET, RECEIVER, max_skew_s=MAX_SKEW_S)
    try:
        frame = _sign(msgpack.packb(envelope, use_bin_type=True))
    except (OverflowError, ValueError, TypeError):
        return  # msgpack cannot carry it: no frame to decode
    try:
        decoded = codec.decode(frame)
    except PDServeError as e:
        event(f"refused: {type(e).__name__}")
        return
    event(f"accepted: {envelope['type']}")
    _check_accepted(decoded, envelope["type"])
    with pytest.raises(AuthenticationError, match="replayed"):
        codec.decode(frame)


KEEP = st.just(("keep", None))


def _replacement(annotation):
    return st.one_of(KEEP, KEEP, KEEP, shaped_like(annotation).map(lambda v: ("set", v)), WIRE_VALUE.map(lambda v: ("set", v)))


FIELD_REPLACEMENTS = {
    tag: st.fixed_dictionaries({name: _replacement(a) for name, a in field_types(cls).items()})
    for tag, cls in MESSAGE_TYPES.items()
}


@fuzz_settings(max_examples=2000)
@given(st.sampled_from(TAGS).flatmap(lambda tag: st.tuples(st.just(tag), FIELD_REPLACEMENTS[tag])))
def test_valid_messages_with_fields_replaced_are_refused_or_decode_within_their_ranges(tagged):
    """Start from a valid message of each type and replace some fields with values of the
    declared type (edge cases included) or of any type: the payload checks and the messages'
    own validate() decide, and whatever they accept respects the declared types and ranges."""
    tag, replacements = tagged
    sample = example(MESSAGE_TYPES[tag])
    payload = {name: getattr(sample, name) for name in field_types(type(sample))}
    payload.update({name: value for name, (action, value) in replacements.items() if action == "set"})
    envelope = {
        "v": VERSION, "type": tag, "sender": "fuzz-sender", "to": RECEIVER, "ts": time.time(),
        "nonce": os.urandom(16), "payload": payload,
    }
    try:
        frame = _sign(msgpack.packb(envelope, use_bin_type=True))
    except (OverflowError, ValueError, TypeError):
        return
    try:
        decoded = Codec(SECRET, RECEIVER, max_skew_s=MAX_SKEW_S).decode(frame)
    except PDServeError as e:
        event(f"refused: {type(e).__name__}")
        return
    event(f"accepted: {tag}")
    _check_accepted(decoded, tag)


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(min_value=0), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(min_value=0), st.just(0)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=8), st.just(0)),
    st.tuples(st.just("other secret"), st.binary(min_size=1, max_size=16), st.just(0)),
)


def _mutate(frame: bytes, mutation) -> bytes:
    kind, arg, mask = mutation
    if kind == "flip":
        i = arg % len(frame)
        return frame[:i] + bytes([frame[i] ^ mask]) + frame[i + 1:]
    if kind == "truncate":
        return frame[: arg % len(frame)]
    if kind == "append":
        return frame + arg
    secret = arg if arg != SECRET else arg + b"x"
    return _sign(frame[32:], secret)


@fuzz_settings(max_examples=1000)
@given(st.sampled_from(TAGS), MUTATIONS, st.text(min_size=1, max_size=MAX_ID_CHARS))
def test_no_forgery_is_accepted(tag, mutation, stranger):
    """A tampered frame, one signed with another secret, one for another recipient, a replay:
    none decodes."""
    cls = MESSAGE_TYPES[tag]
    sender = Codec(SECRET, "fuzz-sender")
    receiver = Codec(SECRET, RECEIVER)
    frame = sender.encode(example(cls), RECEIVER)
    forged = _mutate(frame, mutation)
    if forged != frame:
        with pytest.raises(PDServeError):
            receiver.decode(forged)
    if stranger != RECEIVER:
        with pytest.raises(FencedError):
            receiver.decode(sender.encode(example(cls), stranger))
    assert type(receiver.decode(frame).message) is cls
    with pytest.raises(AuthenticationError, match="replayed"):
        receiver.decode(frame)
