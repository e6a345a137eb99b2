"""Every control-plane message: a small frozen dataclass with a type tag.

The codec (codec.py) turns any of them into an authenticated envelope and back; it looks classes
up in `MESSAGE_TYPES` by tag and checks payload fields against the dataclass annotations, so
adding a message is adding a class here.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

MESSAGE_TYPES: dict[str, type] = {}


def message(tag: str):
    """Register a frozen dataclass as a wire message under `tag`."""

    def register(cls):
        if tag in MESSAGE_TYPES:
            raise ValueError(f"message tag {tag!r} is already used by {MESSAGE_TYPES[tag].__name__}")
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        cls.TAG = tag
        MESSAGE_TYPES[tag] = cls
        return cls

    return register


def tag_of(msg) -> str:
    """The type tag of a message instance; TypeError for anything that is not a registered message."""
    tag = getattr(type(msg), "TAG", None)
    if tag is None or MESSAGE_TYPES.get(tag) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered wire message")
    return tag


def field_types(cls) -> dict[str, object]:
    """Field name -> resolved annotation, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@message("handshake_request")
@dataclass(frozen=True)
class HandshakeRequest:
    """Peer -> handshake server: who I am and my KV layout fingerprint."""

    engine_id: str
    fingerprint: dict


@message("handshake_reply")
@dataclass(frozen=True)
class HandshakeReply:
    """Handshake server -> peer: my fingerprint and how to reach my KV regions.

    `regions` are RegionDescriptor.to_wire() dicts; `layers[i]` places attention layer i:
    `[region_id, byte offset of block 0, bytes per block, number of blocks]`.
    """

    engine_id: str
    fingerprint: dict
    regions: list[dict]
    layers: list[list[int]]


@message("handshake_refused")
@dataclass(frozen=True)
class HandshakeRefused:
    """Handshake server -> peer: no (fingerprint mismatch, ...), with the reason."""

    reason: str


@message("remote_blocks")
@dataclass(frozen=True)
class RemoteBlocks:
    """D -> P (WRITE mode): D's block ids for the prompt; P writes its blocks [first_block:] there."""

    transfer_id: str
    block_ids: list[int]
    first_block: int


@message("write_done")
@dataclass(frozen=True)
class WriteDone:
    """P -> D (WRITE mode): every block of `transfer_id` was written (ok) or the write failed."""

    transfer_id: str
    ok: bool
    error: str = ""


@message("release")
@dataclass(frozen=True)
class Release:
    """D -> P (READ mode): D finished reading `transfer_id`'s blocks, or aborted; P may free them."""

    transfer_id: str


@message("ping")
@dataclass(frozen=True)
class Ping:
    """Liveness probe; the server answers Pong."""


@message("pong")
@dataclass(frozen=True)
class Pong:
    """Answer to Ping."""


@message("read_done")
@dataclass(frozen=True)
class ReadDone:
    """D -> P (READ mode, request): D read `block_ids` of `transfer_id`; P answers ReadAck and
    frees them. P says ok only if it held exactly those blocks for that transfer all along, so a
    read of blocks P never held (stale or forged params) can never pass as a KV transfer."""

    transfer_id: str
    block_ids: list[int]


@message("read_ack")
@dataclass(frozen=True)
class ReadAck:
    """P -> D: the answer to ReadDone."""

    transfer_id: str
    ok: bool
    error: str = ""
