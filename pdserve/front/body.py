"""A request body as the front reads it: parsed once, at the edge, into its top-level members.

    body = RequestBody.parse(raw, content_type)   # BodyRefused: a size field out of range, or bad JSON
    body.raw                                      # what is forwarded: the client's, less what only pdserve may set
    body.field("stream")                          # a top-level member, decoded (None when absent)

A JSON object is split into its top-level members without decoding them (msgspec.Raw: a 16 MiB
prompt is scanned, never made into Python objects), so a large body costs the event loop
milliseconds. The members pdserve sets itself between its processes never come from a client:
`kv_transfer_params` is taken out of every body (an instance would take it for a transfer's). The
sizes the front or an instance allocates by (`n`, `best_of`) are checked here, before anything is
made of them, against vLLM's own bounds: a 400 naming the field and the rule.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.front.openai_error import OpenAIError

INTERNAL_MEMBERS = frozenset({"kv_transfer_params"})
MAX_SEQUENCES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default (sampling_params._verify_num_sequences)
SIZE_MEMBERS = ("n", "best_of")
# a body msgspec cannot read (NaN, UTF-16) is tried with Python's parser, as vLLM's server reads it, up
# to this size; a larger one is refused where an instance would read it as JSON
FALLBACK_PARSE_BYTES = 1 << 20
MAX_DECODED_MEMBER_BYTES = 64 << 10  # field() decodes members up to this size; a larger one reads as malformed

_members = msgspec.json.Decoder(dict[str, msgspec.Raw])
_encoder = msgspec.json.Encoder()
_MALFORMED = object()


class BodyRefused(Exception):
    """The body breaks a rule the front holds; `error` answers it (400)."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class RequestBody:
    """`original`: the bytes as the client sent them. `members`: a JSON object's top-level members,
    undecoded (views of `original`); None for a body that is not a JSON object (forwarded as it came:
    its reader names what is wrong). `changed`: members were taken out or set, so what is forwarded
    is `members` encoded again (`raw`, or piece by piece: pieces())."""

    original: bytes | bytearray
    members: dict[str, msgspec.Raw] | None = None
    changed: bool = False

    @classmethod
    def parse(cls, raw: bytes | bytearray, content_type: str | None = None) -> RequestBody:
        if not raw:
            return cls(raw)
        try:
            members = _members.decode(raw)
        except msgspec.DecodeError:
            members = _fallback(raw, content_type)
            if members is not None:  # read by Python's parser: forwarded as it encodes them
                return cls(raw, members, changed=True).with_members(drop=INTERNAL_MEMBERS)._checked()
        except msgspec.ValidationError:
            members = None  # JSON, but not an object
        if members is None:
            return cls(raw)
        body = cls(raw, members)._checked()
        return body.with_members(drop=INTERNAL_MEMBERS) if INTERNAL_MEMBERS & members.keys() else body

    @functools.cached_property
    def raw(self) -> bytes | bytearray:
        """What is forwarded, whole."""
        if not self.changed:
            return self.original
        assert self.members is not None
        return _encoder.encode(self.members)

    @functools.cached_property
    def num_bytes(self) -> int:
        return sum(len(piece) for piece in self.pieces(1 << 62))

    def pieces(self, size: int = 256 << 10) -> Iterator[bytes | memoryview]:
        """What is forwarded, in pieces of at most about `size` bytes, none of them a copy of a large member."""
        if not self.changed:
            whole = memoryview(self.original)
            yield from (whole[at:at + size] for at in range(0, len(whole), size))
            return
        assert self.members is not None
        yield b"{"
        for i, (name, value) in enumerate(self.members.items()):
            yield (b"," if i else b"") + _encoder.encode(name) + b":"
            whole = memoryview(value)
            yield from (whole[at:at + size] for at in range(0, len(whole), size))
        yield b"}"

    @property
    def is_object(self) -> bool:
        return self.members is not None

    def has(self, name: str) -> bool:
        return self.members is not None and name in self.members

    def field(self, name: str, default: Any = None) -> Any:
        """Member `name` decoded (`default` when absent or null); a member that is not JSON the front can
        read quickly (over MAX_DECODED_MEMBER_BYTES) is returned as _MALFORMED (see malformed())."""
        if self.members is None or name not in self.members:
            return default
        raw = self.members[name]
        if len(memoryview(raw)) > MAX_DECODED_MEMBER_BYTES:
            return _MALFORMED
        try:
            value = msgspec.json.decode(raw)
        except msgspec.DecodeError:  # NaN or Infinity, read by the fallback parser
            value = json.loads(bytes(raw))
        return default if value is None else value

    def raw_member(self, name: str) -> msgspec.Raw | None:
        return None if self.members is None else self.members.get(name)

    def with_members(self, drop: frozenset[str] = frozenset(), **values: Any) -> RequestBody:
        """This body with the members `drop` taken out and `values` set (encoded when forwarded)."""
        assert self.members is not None
        members: dict[str, msgspec.Raw] = {k: v for k, v in self.members.items() if k not in drop}
        members.update((k, msgspec.Raw(_encoder.encode(v))) for k, v in values.items())
        return RequestBody(self.original, members, changed=True)

    def _checked(self) -> RequestBody:
        self._check_sizes()
        return self

    def _check_sizes(self) -> None:
        for name in SIZE_MEMBERS:
            value = self.field(name)
            if value is None:
                continue
            number = integer(value)
            if number is None or not 1 <= number <= MAX_SEQUENCES:
                shown = "a value too large to read" if value is _MALFORMED else json.dumps(value)[:40]
                raise BodyRefused(OpenAIError(400, f"{name} must be an integer from 1 to {MAX_SEQUENCES}, got {shown}",
                                              param=name))


def encode(members: dict[str, Any]) -> bytes:
    """A JSON object of `members` (msgspec.Raw members written as they are)."""
    return _encoder.encode(members)


def malformed(value: Any) -> bool:
    return value is _MALFORMED


def integer(value: Any) -> int | None:
    """`value` as the integer vLLM's schema reads it as (an int, an integral float, a decimal string); None if none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and len(value) <= 20:
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _fallback(raw: bytes, content_type: str | None) -> dict[str, msgspec.Raw] | None:
    """The members of a body msgspec refused, read as vLLM's server reads it (Python's json); None
    where it is not a JSON object. BodyRefused where it is too large to read that way and would be read as JSON."""
    if len(raw) > FALLBACK_PARSE_BYTES:
        if _read_as_json(content_type):
            raise BodyRefused(OpenAIError(400, "the request body is not valid JSON (UTF-8, no NaN or Infinity)"))
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return {k: msgspec.Raw(json.dumps(v, allow_nan=True).encode()) for k, v in value.items()}


def _read_as_json(content_type: str | None) -> bool:
    """Whether a server reads a body with this Content-Type as JSON (FastAPI: when absent or JSON)."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")
