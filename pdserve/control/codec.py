"""The one codec of the control plane: messages <-> authenticated msgpack envelopes.

Wire frame: `mac (32 bytes) || body`, where body is msgpack of
`{"v": 1, "type": tag, "sender": id, "ts": unix seconds, "nonce": 16 bytes, "payload": {...}}`
and mac = HMAC-SHA256(secret, body). Decoding checks, in order: the MAC (before parsing anything),
the envelope's shape, the timestamp's skew, the nonce against recently seen ones (replay), the
type tag, and every payload field against the message dataclass. No pickle, ever.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
import types
import typing
from collections import OrderedDict
from dataclasses import dataclass

import msgpack

from pdserve.control.messages import MESSAGE_TYPES, field_types, tag_of
from pdserve.errors import AuthenticationError, ProtocolError

VERSION = 1
MAC_BYTES = 32
NONCE_BYTES = 16
MAX_FRAME_BYTES = 16 * 1024 * 1024
_ENVELOPE_KEYS = frozenset({"v", "type", "sender", "ts", "nonce", "payload"})


@dataclass(frozen=True)
class Envelope:
    """A decoded, authenticated message and who sent it."""

    sender: str
    message: object
    ts: float


class Codec:
    """Encodes and authenticates messages for one sender; decodes and verifies anyone's.

    Thread-safe. Every process of a deployment shares `secret`; `sender_id` names this end.
    """

    def __init__(self, secret: bytes, sender_id: str, max_skew_s: float = 30.0, max_nonces: int = 100_000):
        if not secret:
            raise ValueError("the control-plane secret must not be empty")
        self.sender_id = sender_id
        self.max_skew_s = max_skew_s
        self._secret = bytes(secret)
        self._max_nonces = max_nonces
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> ts, in arrival order
        self._lock = threading.Lock()

    def encode(self, msg) -> bytes:
        tag = tag_of(msg)
        payload = {name: getattr(msg, name) for name in field_types(type(msg))}
        envelope = {
            "v": VERSION,
            "type": tag,
            "sender": self.sender_id,
            "ts": time.time(),
            "nonce": os.urandom(NONCE_BYTES),
            "payload": payload,
        }
        body = msgpack.packb(envelope, use_bin_type=True)
        return hmac.new(self._secret, body, hashlib.sha256).digest() + body

    def decode(self, raw: bytes) -> Envelope:
        """Verify and decode one frame; raises AuthenticationError or ProtocolError saying why."""
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
        self._check_fresh(envelope)
        cls = MESSAGE_TYPES.get(envelope["type"])
        if cls is None:
            raise ProtocolError(f"unknown message type {envelope['type']!r}")
        return Envelope(envelope["sender"], _build(cls, envelope["payload"]), envelope["ts"])

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
        checks = {"type": str, "sender": str, "ts": (int, float), "nonce": bytes, "payload": dict}
        for key, expected in checks.items():
            if not isinstance(envelope[key], expected) or isinstance(envelope[key], bool):
                raise ProtocolError(f"envelope field {key!r} has type {type(envelope[key]).__name__}")
        if len(envelope["nonce"]) != NONCE_BYTES:
            raise ProtocolError(f"envelope nonce must be {NONCE_BYTES} bytes, got {len(envelope['nonce'])}")
        return envelope

    def _check_fresh(self, envelope: dict) -> None:
        now = time.time()
        ts = float(envelope["ts"])
        if ts < now - self.max_skew_s:
            raise AuthenticationError(f"stale message: sent {now - ts:.1f} s ago (max skew {self.max_skew_s:g} s)")
        if ts > now + self.max_skew_s:
            raise AuthenticationError(f"message from the future: {ts - now:.1f} s ahead (max skew {self.max_skew_s:g} s)")
        nonce = envelope["nonce"]
        with self._lock:
            while self._seen and (
                next(iter(self._seen.values())) < now - self.max_skew_s or len(self._seen) >= self._max_nonces
            ):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthenticationError(f"replayed message: nonce {nonce.hex()} already seen")
            self._seen[nonce] = ts


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
    return cls(**payload)


def _is_required(field) -> bool:
    from dataclasses import MISSING

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
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, annotation)
    return None if ok else f"must be {annotation.__name__}, got {type(value).__name__}"
