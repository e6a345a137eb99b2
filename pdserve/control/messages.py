"""Every control-plane message: a small frozen dataclass with a type tag.

The codec (codec.py) turns any of them into an authenticated envelope and back; it looks classes
up in `MESSAGE_TYPES` by tag and checks payload fields against the dataclass annotations. A
message is registered with `@message(tag)`: the transfer messages here, and those of a package
above the control plane in that package (placement's load and status: pdserve/placement/messages.py),
so the control plane imports nothing above it.

Fencing: every message but the two that open a conversation (HandshakeRequest, Ping) is
*addressed*: its envelope names the recipient's incarnation (the identity from its handshake),
and the codec rejects a message addressed to anyone else. A restarted process is a new
incarnation, so nothing meant for its predecessor ever reaches it. `validate()` checks ranges the
type annotations cannot express; the codec calls it on every decoded message.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass

from pdserve.errors import ProtocolError

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


# Block ids per message: a 1M-token context (pdserve up's longest --max-model-len) at 16-token
# blocks (vLLM's default and its smallest on CPU); each id below MAX_BLOCK_ID (5 bytes on the wire).
MAX_BLOCKS = 1 << 16
MAX_BLOCK_ID = 1 << 32
# Layers and KV regions in a handshake reply: several times the deepest model vLLM serves (126 layers).
MAX_LAYERS = 1024
MAX_TEXT = 4096
MAX_WRITE_FOR_S = 3600.0  # the longest write window D may grant (seconds)
MAX_IDENTITY = 256  # an incarnation identity: the codec's limit for senders and recipients
_DIGEST = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PROC_FD = re.compile(r"/proc/[1-9][0-9]{0,9}/fd/[0-9]{1,9}")
MAX_NIXL_METADATA = 256 * 1024  # a NIXL agent's metadata: ~0.5 KiB per registered region


def check(condition: bool, cls, problem: str) -> None:
    """ProtocolError naming the message type unless `condition` holds (for `validate()` methods)."""
    if not condition:
        raise ProtocolError(f"{cls.TAG}: {problem}")


def _check_transfer_id(msg) -> None:
    check(0 < len(msg.transfer_id) <= 256, type(msg), f"transfer_id must be 1..256 characters, got {len(msg.transfer_id)}")


def _check_block_ids(msg, block_ids: list[int]) -> None:
    check(len(block_ids) <= MAX_BLOCKS, type(msg), f"{len(block_ids)} block ids (max {MAX_BLOCKS})")
    check(all(0 <= b < MAX_BLOCK_ID for b in block_ids), type(msg),
          f"block ids must be block numbers 0..{MAX_BLOCK_ID - 1}")


def _check_kv_digest(msg, kv_digest: bytes) -> None:
    check(len(kv_digest) % 4 == 0 and len(kv_digest) <= 4 * MAX_BLOCKS, type(msg),
          f"kv_digest must be 4 bytes per block, at most {MAX_BLOCKS} blocks, got {len(kv_digest)} bytes")


def _check_digest(msg, digest: str, allow_empty: bool = False) -> None:
    check(bool(_DIGEST.fullmatch(digest)) or (allow_empty and digest == ""), type(msg),
           f"prompt_hash must be 32 lowercase hex digits, got {digest[:40]!r}")


def _check_text(msg, name: str, text: str) -> None:
    check(len(text) <= MAX_TEXT, type(msg), f"{name} longer than {MAX_TEXT} characters")


def _check_host_proof(msg) -> None:
    check(msg.host_proof == "" or bool(_PROC_FD.fullmatch(msg.host_proof)), type(msg),
           f"host_proof must be /proc/<pid>/fd/<n>, got {msg.host_proof[:80]!r}")
    check(bool(_SHA256.fullmatch(msg.host_proof_digest)) == bool(msg.host_proof), type(msg),
           "host_proof_digest must be 64 lowercase hex digits exactly when host_proof is set")


@message("handshake_request")
@dataclass(frozen=True)
class HandshakeRequest:
    """Peer -> handshake server: who I am, my KV layout fingerprint, and the proof that I share
    the server's host (as in HandshakeReply; both empty when not offered): under transport auto a
    server starts its NIXL agent only for a peer that proved nothing (nixl_auto.py)."""

    ADDRESSED = False
    engine_id: str
    fingerprint: dict
    host_proof: str = ""
    host_proof_digest: str = ""

    def validate(self) -> None:
        check(0 < len(self.engine_id) <= MAX_IDENTITY, type(self), "engine_id must be 1..256 characters")
        _check_host_proof(self)


@message("handshake_reply")
@dataclass(frozen=True)
class HandshakeReply:
    """Handshake server -> peer: my incarnation, fingerprint and how to reach my KV regions.

    `engine_id` is the replying process's incarnation identity (the envelope's sender); `pid`,
    `start_time` (clock ticks since boot, /proc/<pid>/stat) and `boot_id` let a peer on the same
    host prove that this incarnation has died. `regions` are RegionDescriptor.to_wire() dicts;
    `layers[i]` places attention layer i: `[region_id, byte offset of block 0, bytes per block,
    number of blocks]`.

    How to reach the regions: `nixl_metadata` is the replier's NIXL agent metadata (empty without
    NIXL; its agent is named `engine_id`, which binds it to this incarnation); `host_proof` is a
    `/proc/<pid>/fd/<n>` path only a process on the replier's host (and in its PID namespace) can
    open, holding a random token whose SHA-256 is `host_proof_digest`: reading it back proves the
    peer shares our host and shared memory can reach it. Both empty when not offered.
    """

    engine_id: str
    fingerprint: dict
    regions: list[dict]
    layers: list[list[int]]
    pid: int
    start_time: int
    boot_id: str
    nixl_metadata: bytes = b""
    host_proof: str = ""
    host_proof_digest: str = ""

    def validate(self) -> None:
        check(0 < len(self.engine_id) <= MAX_IDENTITY, type(self), "engine_id must be 1..256 characters")
        _check_text(self, "boot_id", self.boot_id)
        check(0 < self.pid < 1 << 32 and 0 <= self.start_time < 1 << 62, type(self), "pid/start_time out of range")
        check(len(self.regions) <= MAX_LAYERS and len(self.layers) <= MAX_LAYERS, type(self),
              f"{len(self.regions)} regions, {len(self.layers)} layers (max {MAX_LAYERS} each)")
        check(len(self.nixl_metadata) <= MAX_NIXL_METADATA, type(self),
               f"nixl_metadata of {len(self.nixl_metadata)} bytes (max {MAX_NIXL_METADATA})")
        _check_host_proof(self)


@message("handshake_refused")
@dataclass(frozen=True)
class HandshakeRefused:
    """Handshake server -> peer: no (fingerprint mismatch, ...), with the reason."""

    reason: str

    def validate(self) -> None:
        _check_text(self, "reason", self.reason)


@message("remote_blocks")
@dataclass(frozen=True)
class RemoteBlocks:
    """D -> P (WRITE mode): D's block ids for the whole prompt; P writes its blocks [first_block:]
    there. `prompt_hash` names the prompt those blocks are for; P writes only if its own prompt
    has the same hash and the same number of blocks. `write_for` is a duration, not a time: P may
    touch those blocks for at most `write_for` seconds after it received this message (less a
    margin), every copy included, so no clock of D's is ever compared with one of P's."""

    transfer_id: str
    block_ids: list[int]
    first_block: int
    prompt_hash: str
    write_for: float

    def validate(self) -> None:
        _check_transfer_id(self)
        _check_block_ids(self, self.block_ids)
        check(0 <= self.first_block <= len(self.block_ids), type(self),
               f"first_block {self.first_block} outside 0..{len(self.block_ids)}")
        _check_digest(self, self.prompt_hash)
        check(math.isfinite(self.write_for) and 0.0 <= self.write_for <= MAX_WRITE_FOR_S, type(self),
              f"write_for must be 0..{MAX_WRITE_FOR_S:g} seconds")


@message("write_done")
@dataclass(frozen=True)
class WriteDone:
    """P -> D (WRITE mode): every block of `transfer_id` was written (ok), or P stopped for good
    (not ok: failed, cancelled, or released by D) and will not write again. `kv_digest`: with
    `kv_verify digest`, a CRC-32 per block of what P sent (transfer/kv_digest.py)."""

    transfer_id: str
    ok: bool
    error: str = ""
    prompt_hash: str = ""
    kv_digest: bytes = b""

    def validate(self) -> None:
        _check_transfer_id(self)
        _check_text(self, "error", self.error)
        _check_digest(self, self.prompt_hash, allow_empty=not self.ok)
        _check_kv_digest(self, self.kv_digest)


@message("release")
@dataclass(frozen=True)
class Release:
    """D -> P: D gave up on `transfer_id` (or never wanted it). WRITE: P stops writing and
    confirms with WriteDone(ok=False) — also for a transfer it does not know yet, which it then
    refuses to start. READ: P frees the blocks it held."""

    transfer_id: str
    reply_host: str = ""  # D's notify address: P answers a Release for a transfer it never had
    reply_notify_port: int = 0

    def validate(self) -> None:
        _check_transfer_id(self)
        check(len(self.reply_host) <= 255, type(self), "reply_host longer than 255 characters")
        check(0 <= self.reply_notify_port < 65536 and bool(self.reply_host) == bool(self.reply_notify_port),
               type(self), "reply_host and reply_notify_port must be given together, with a valid port")


@message("ping")
@dataclass(frozen=True)
class Ping:
    """Liveness probe; the server answers Pong (whose envelope names the live incarnation)."""

    ADDRESSED = False


@message("pong")
@dataclass(frozen=True)
class Pong:
    """Answer to Ping."""


@message("read_done")
@dataclass(frozen=True)
class ReadDone:
    """D -> P (READ mode): D read `block_ids` of `transfer_id` from this incarnation's memory.
    P answers ReadAck (to `reply_host`:`reply_notify_port`) and frees them. P says ok only if it
    still holds exactly those blocks for that transfer and that prompt, so a read of blocks P
    never held (stale or forged params, a restarted P) can never pass as a KV transfer."""

    transfer_id: str
    block_ids: list[int]
    prompt_hash: str
    reply_host: str
    reply_notify_port: int

    def validate(self) -> None:
        _check_transfer_id(self)
        _check_block_ids(self, self.block_ids)
        _check_digest(self, self.prompt_hash)
        check(0 < len(self.reply_host) <= 255, type(self), "reply_host must be a host name")
        check(0 < self.reply_notify_port < 65536, type(self), f"reply_notify_port {self.reply_notify_port} is not a port")


@message("read_ack")
@dataclass(frozen=True)
class ReadAck:
    """P -> D: the answer to ReadDone; `kv_digest` as in WriteDone, of the blocks P held."""

    transfer_id: str
    ok: bool
    error: str = ""
    kv_digest: bytes = b""

    def validate(self) -> None:
        _check_transfer_id(self)
        _check_text(self, "error", self.error)
        _check_kv_digest(self, self.kv_digest)


@message("clock_skew")
@dataclass(frozen=True)
class ClockSkew:
    """Server -> sender of an authentic frame refused for its timestamp: this clock and the sender's
    are `offset_s` apart (sender's minus ours), more than the codec's skew window. The sender's codec
    refuses this notice as skewed too, and so measures the offset itself (codec.ClockSkewError):
    without it, an instance whose clock is off would never learn why it is not served."""

    offset_s: float

    def validate(self) -> None:
        check(math.isfinite(self.offset_s), type(self), "offset_s must be finite")
