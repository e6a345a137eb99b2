"""Peer addresses as vllm-router carries them: `host:<ip>,handshake:<port>,notify:<port>`.

In MoRIIO mode vllm-router (0.1.17) puts both instances' registered zmq addresses into the
request id: `___prefill_addr_<zmq>___decode_addr_<zmq>_<32 hex>`, to which vLLM may add a prefix
(`cmpl-`) and suffixes (`-0-abcdef12`, `-abcdef12`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.errors import ProtocolError

_REQUEST_ID = re.compile(
    r"___prefill_addr_(?P<prefill>.+?)___decode_addr_(?P<decode>.+?)_(?P<uid>[0-9a-fA-F]{32})(?:-[0-9A-Za-z-]*)?$"
)
_KEYS = ("host", "handshake", "notify")


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
            raise ProtocolError(f"zmq address {text!r}: segment {segment!r} is not key:value")
        if key not in _KEYS:
            raise ProtocolError(f"zmq address {text!r}: unknown key {key!r} (expected {', '.join(_KEYS)})")
        if key in fields:
            raise ProtocolError(f"zmq address {text!r}: key {key!r} given twice")
        fields[key] = value
    missing = [k for k in _KEYS if k not in fields]
    if missing:
        raise ProtocolError(f"zmq address {text!r}: missing {', '.join(missing)}")
    host = fields["host"].strip("[]")
    return PeerAddress(host, _port(text, fields["handshake"]), _port(text, fields["notify"]))


def format_zmq_address(peer: PeerAddress) -> str:
    return f"host:{peer.host},handshake:{peer.handshake_port},notify:{peer.notify_port}"


def parse_request_id(request_id: str) -> tuple[PeerAddress, PeerAddress] | None:
    """(prefill, decode) addresses from a vllm-router request id.

    Returns None when the id does not carry router addresses at all (a request that did not come
    through vllm-router's MoRIIO mode); raises ProtocolError when it does but an address is malformed.
    """
    match = _REQUEST_ID.search(request_id)
    if match is None:
        return None
    return parse_zmq_address(match.group("prefill")), parse_zmq_address(match.group("decode"))


def _port(text: str, value: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ProtocolError(f"zmq address {text!r}: bad port {value!r}")
    return int(value)
