"""The one codec of the control plane: messages <-> authenticated msgpack envelopes.

Wire frame: `mac (32 bytes) || body`, where body is msgpack of
`{"v": 2, "type": tag, "sender": id, "to": recipient, "ts": unix seconds, "nonce": 16 bytes,
"payload": {...}}` and mac = HMAC-SHA256(secret, body). Decoding checks, in order: the MAC
(before parsing anything), the envelope's shape, the timestamp (finite, within the skew), the
type tag, the recipient (fencing), the nonce against recently seen ones (replay), every payload
field against the message dataclass, and the message's own `validate()`. No pickle, ever.

`to` is the recipient's incarnation identity (its `sender_id`), or "" for the message types that
open a conversation and may go to anyone (`ADDRESSED = False` on the class).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import threading
import time
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass

import msgpack

from pdserve.control.limits import MAX_FRAME_BYTES
from pdserve.control.messages import MESSAGE_TYPES, field_types, tag_of
from pdserve.control.replay import ReplayCache
from pdserve.errors import AuthenticationError, FencedError, ProtocolError

VERSION = 2
MAC_BYTES = 32
NONCE_BYTES = 16
MAX_ID_CHARS = 256  # sender and recipient identities
_ENVELOPE_KEYS = frozenset({"v", "type", "sender", "to", "ts", "nonce", "payload"})


class ClockSkewError(AuthenticationError):
    """An authentic frame (its MAC checked) whose timestamp is outside the skew window: the sender's
    clock and ours are `offset_s` apart (sender's minus ours, as measured on arrival)."""

    def __init__(self, message: str, sender: str, offset_s: float):
        super().__init__(message)
        self.sender = sender
        self.offset_s = offset_s


@dataclass(frozen=True)
class Envelope:
    """A decoded, authenticated message, who sent it, and whom it was addressed to ("" = anyone)."""

    sender: str
    message: object
    ts: float
    recipient: str = ""


def is_addressed(cls) -> bool:
    """Whether messages of type `cls` must name their recipient (true unless the class says not)."""
    return getattr(cls, "ADDRESSED", True)


class Codec:
    """Encodes and authenticates messages for one sender; decodes and verifies anyone's.

    Thread-safe. Every process of a deployment shares `secret`; `sender_id` names this end; `clock`
    gives the time stamped on frames and compared with theirs (the wall clock).
    """

    def __init__(self, secret: bytes, sender_id: str, max_skew_s: float = 30.0, max_nonces: int = 100_000,
                 clock: Callable[[], float] | None = None):
        if not secret:
            raise ValueError("the control-plane secret must not be empty")
        if not isinstance(sender_id, str) or not 0 < len(sender_id) <= MAX_ID_CHARS:
            raise ValueError(f"sender_id must be 1..{MAX_ID_CHARS} characters, got {sender_id!r}")
        self.sender_id = sender_id
        self.max_skew_s = max_skew_s
        self._clock = clock or _wall_clock
        self._secret = bytes(secret)
        self._replay = ReplayCache(max_nonces)
        self._lock = threading.Lock()

    def encode(self, msg, recipient: str = "") -> bytes:
        """Sign `msg` for `recipient` (the peer incarnation's identity; "" only for message types
        with `ADDRESSED = False`, which the receiver accepts from anyone). ProtocolError if the
        recipient is no usable identity or the frame would exceed MAX_FRAME_BYTES."""
        tag = tag_of(msg)
        if not isinstance(recipient, str) or len(recipient) > MAX_ID_CHARS:
            raise ProtocolError(f"recipient must be a string of at most {MAX_ID_CHARS} characters, got {recipient!r:.300}")
        payload = {name: getattr(msg, name) for name in field_types(type(msg))}
        envelope = {
            "v": VERSION,
            "type": tag,
            "sender": self.sender_id,
            "to": recipient,
            "ts": self._clock(),
            "nonce": os.urandom(NONCE_BYTES),
            "payload": payload,
        }
        body = msgpack.packb(envelope, use_bin_type=True)
        if MAC_BYTES + len(body) > MAX_FRAME_BYTES:
            raise ProtocolError(f"{tag} frame would be {MAC_BYTES + len(body)} bytes (max {MAX_FRAME_BYTES})")
        return hmac.new(self._secret, body, hashlib.sha256).digest() + body

    def decode(self, raw: bytes) -> Envelope:
        """Verify and decode one frame; raises AuthenticationError (FencedError when addressed to
        another incarnation) or ProtocolError saying why."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"frame must be bytes, got {type(raw).__name__}")
        raw = bytes(raw)
        if len(raw) <= MAC_BYTES:
            raise ProtocolError(f"frame too short ({len(raw)} bytes) to hold a MAC and a body")
        if len(raw) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame too large ({len(raw)} bytes > {MAX_FRAME_BYTES})")
        mac, body = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._secret, body, hashlib.sha256).digest()):
            raise AuthenticationError("bad MAC: the message was tampered with or signed with another secret")
        envelope = self._unpack(body)
        now = self._clock()
        self._check_skew(envelope["ts"], now, envelope["sender"])
        cls = MESSAGE_TYPES.get(envelope["type"])
        if cls is None:
            raise ProtocolError(f"unknown message type {envelope['type']!r}")
        self._check_recipient(cls, envelope["to"])
        with self._lock:
            self._replay.admit(envelope["nonce"], float(envelope["ts"]), now - self.max_skew_s)
        return Envelope(envelope["sender"], _build(cls, envelope["payload"]), float(envelope["ts"]), envelope["to"])

    def _unpack(self, body: bytes) -> dict:
        try:
            envelope = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
        except Exception as e:  # noqa: BLE001 - msgpack raises many types; all mean "not msgpack"
            raise ProtocolError(f"envelope is not valid msgpack: {type(e).__name__}: {e}") from None
        if not isinstance(envelope, dict):
            raise ProtocolError(f"envelope must be a map, got {type(envelope).__name__}")
        if set(envelope) != _ENVELOPE_KEYS:
            raise ProtocolError(f"envelope keys must be {sorted(_ENVELOPE_KEYS)}, got {sorted(map(str, envelope))}")
        if envelope["v"] != VERSION:
            raise ProtocolError(f"unsupported envelope version {envelope['v']!r} (we speak {VERSION})")
        checks = {"type": str, "sender": str, "to": str, "ts": (int, float), "nonce": bytes, "payload": dict}
        for key, expected in checks.items():
            if not isinstance(envelope[key], expected) or isinstance(envelope[key], bool):
                raise ProtocolError(f"envelope field {key!r} has type {type(envelope[key]).__name__}")
        if len(envelope["nonce"]) != NONCE_BYTES:
            raise ProtocolError(f"envelope nonce must be {NONCE_BYTES} bytes, got {len(envelope['nonce'])}")
        if not 0 < len(envelope["sender"]) <= MAX_ID_CHARS:
            raise ProtocolError(f"envelope sender must be 1..{MAX_ID_CHARS} characters, got {len(envelope['sender'])}")
        if len(envelope["to"]) > MAX_ID_CHARS:
            raise ProtocolError(f"envelope recipient longer than {MAX_ID_CHARS} characters")
        return envelope

    def _check_skew(self, ts: int | float, now: float, sender: str) -> None:
        # A NaN compares false with everything: it would pass both bounds below and never leave
        # the replay cache.
        if not _finite(ts):
            raise AuthenticationError(f"message timestamp {ts!r} is not a finite time")
        if ts < now - self.max_skew_s:
            raise ClockSkewError(f"stale message: sent {now - ts:.1f} s ago (max skew {self.max_skew_s:g} s)",
                                 sender, ts - now)
        if ts > now + self.max_skew_s:
            raise ClockSkewError(f"message from the future: {ts - now:.1f} s ahead (max skew {self.max_skew_s:g} s)",
                                 sender, ts - now)

    def _check_recipient(self, cls, recipient: str) -> None:
        if recipient and recipient != self.sender_id:
            raise FencedError(f"{cls.TAG} addressed to {recipient!r}, not to this incarnation ({self.sender_id!r})")
        if not recipient and is_addressed(cls):
            raise FencedError(f"{cls.TAG} names no recipient, but this message type must")


def _wall_clock() -> float:
    return time.time()


def _build(cls, payload: dict):
    fields = field_types(cls)
    required = {name for name, f in cls.__dataclass_fields__.items() if _is_required(f)}
    missing = required - set(payload)
    if missing:
        raise ProtocolError(f"{cls.TAG}: missing field(s) {sorted(missing)}")
    extra = set(payload) - set(fields)
    if extra:
        raise ProtocolError(f"{cls.TAG}: unexpected field(s) {sorted(map(str, extra))}")
    for name, value in payload.items():
        problem = _type_problem(value, fields[name])
        if problem is not None:
            raise ProtocolError(f"{cls.TAG}: field {name!r} {problem}")
    msg = cls(**payload)
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    return msg


def _is_required(field) -> bool:
    return field.default is MISSING and field.default_factory is MISSING


def _type_problem(value, annotation) -> str | None:
    """None if `value` fits `annotation`, else what is wrong. Supports the shapes messages use."""
    if annotation is typing.Any:
        return None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, option) for option in typing.get_args(annotation)]
        return None if None in problems else f"must be {annotation}, got {type(value).__name__}"
    if annotation is type(None):
        return None if value is None else f"must be None, got {type(value).__name__}"
    if origin is list or annotation is list:
        if not isinstance(value, list):
            return f"must be a list, got {type(value).__name__}"
        args = typing.get_args(annotation)
        if args:
            for i, item in enumerate(value):
                problem = _type_problem(item, args[0])
                if problem is not None:
                    return f"item {i} {problem}"
        return None
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            return f"must be a map, got {type(value).__name__}"
        args = typing.get_args(annotation)
        if args:
            for key, item in value.items():
                problem = _type_problem(key, args[0]) or _type_problem(item, args[1])
                if problem is not None:
                    return f"entry {key!r} {problem}"
        return None
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not _finite(value):
            return f"must be a finite number, got {value!r}"
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, annotation)
    return None if ok else f"must be {annotation.__name__}, got {type(value).__name__}"


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
