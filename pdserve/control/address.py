"""Peer addresses as vllm-router carries them: `host:<ip>,handshake:<port>,notify:<port>`.

In MoRIIO mode vllm-router (0.1.17) puts both instances' registered zmq addresses into the
request id: `___prefill_addr_<zmq>___decode_addr_<zmq>_<32 hex>`, to which vLLM may add a prefix
(`cmpl-`) and suffixes (`-0-abcdef12`, `-abcdef12`). Request ids come from clients (the
X-Request-ID header), so parsing is bounded: ids are looked at up to MAX_REQUEST_ID_CHARS, an
address holds no underscore, and a host is an IP address or a DNS name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.errors import ProtocolError

MAX_REQUEST_ID_CHARS = 1024
MAX_HOST_CHARS = 255
_MARKER = "___prefill_addr_"
_REQUEST_ID = re.compile(
    r"___prefill_addr_(?P<prefill>[^_]+)___decode_addr_(?P<decode>[^_]+)_(?P<uid>[0-9a-fA-F]{32})(?:-[0-9A-Za-z-]*)?\Z"
)
_HOST = re.compile(r"^[A-Za-z0-9.:%-]+\Z")  # IPv4, IPv6 (with a %zone), DNS names
_PORT = re.compile(r"^[0-9]{1,5}\Z")
_KEYS = ("host", "handshake", "notify")


def check_host(host, where: str) -> str:
    """`host` if it is a plausible IP address or DNS name, else ProtocolError naming `where`."""
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS or not _HOST.match(host):
        raise ProtocolError(f"{where}: bad host {host!r:.80} (an IP address or DNS name)")
    return host


@dataclass(frozen=True)
class PeerAddress:
    """Where an instance's control plane listens: handshake requests and notify messages."""

    host: str
    handshake_port: int
    notify_port: int


def parse_zmq_address(text: str) -> PeerAddress:
    """`"host:127.0.0.1,handshake:6301,notify:6401"` -> PeerAddress; ProtocolError if malformed.

    Each segment is split on its first colon, so IPv6 hosts (`host:::1`) work.
    """
    fields: dict[str, str] = {}
    for segment in text.split(","):
        key, sep, value = segment.strip().partition(":")
        if not sep or not value:
            raise ProtocolError(f"zmq address {text!r:.300}: segment {segment!r:.80} is not key:value")
        if key not in _KEYS:
            raise ProtocolError(f"zmq address {text!r:.300}: unknown key {key!r:.40} (expected {', '.join(_KEYS)})")
        if key in fields:
            raise ProtocolError(f"zmq address {text!r:.300}: key {key!r} given twice")
        fields[key] = value
    missing = [k for k in _KEYS if k not in fields]
    if missing:
        raise ProtocolError(f"zmq address {text!r:.300}: missing {', '.join(missing)}")
    host = check_host(fields["host"].strip("[]"), f"zmq address {text!r:.300}")
    return PeerAddress(host, _port(text, fields["handshake"]), _port(text, fields["notify"]))


def format_zmq_address(peer: PeerAddress) -> str:
    return f"host:{peer.host},handshake:{peer.handshake_port},notify:{peer.notify_port}"


def parse_request_id(request_id: str) -> tuple[PeerAddress, PeerAddress] | None:
    """(prefill, decode) addresses from a vllm-router request id.

    Returns None when the id does not carry router addresses at all (a request that did not come
    through vllm-router's MoRIIO mode); raises ProtocolError when it does but an address is malformed,
    or the id is longer than any router id (MAX_REQUEST_ID_CHARS).
    """
    if not isinstance(request_id, str) or _MARKER not in request_id:
        return None
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ProtocolError(f"request id of {len(request_id)} characters carries router addresses (max {MAX_REQUEST_ID_CHARS})")
    match = _REQUEST_ID.search(request_id)
    if match is None:
        return None
    return parse_zmq_address(match.group("prefill")), parse_zmq_address(match.group("decode"))


def _port(text: str, value: str) -> int:
    if not _PORT.match(value) or not 0 < int(value) < 65536:
        raise ProtocolError(f"zmq address {text!r:.300}: bad port {value!r:.40}")
    return int(value)
