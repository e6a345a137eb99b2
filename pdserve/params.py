"""A request's `kv_transfer_params`, parsed once at the edge into a frozen `TransferParams`.

Producer (P) legs carry `do_remote_decode: true`; consumer (D) legs carry `do_remote_prefill:
true`. The peer's address comes from explicit `remote_host`/`remote_handshake_port`/
`remote_notify_port` fields, or else from the `X-Request-ID` that vllm-router sends
(`___prefill_addr_<zmq>___decode_addr_<zmq>_<hex>`), which vLLM keeps inside its request id.
Unknown keys (vllm-router adds `remote_dp_size`, `remote_tp_size`, ...) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.config import Role
from pdserve.control.address import PeerAddress, parse_request_id
from pdserve.errors import ProtocolError


@dataclass(frozen=True)
class TransferParams:
    transfer_id: str
    peer: PeerAddress | None  # None when neither explicit fields nor the request id name one
    remote_block_ids: tuple[int, ...] | None  # READ: P's blocks, sent back by P
    hold_expires_at: float | None  # READ: unix time after which P may free its blocks

    def require_peer(self) -> PeerAddress:
        if self.peer is None:
            raise ProtocolError(
                "kv_transfer_params names no peer: give remote_host, remote_handshake_port and "
                "remote_notify_port, or route through vllm-router (moriio mode), whose X-Request-ID "
                "carries both addresses"
            )
        return self.peer


def _flag(raw: Mapping[str, Any], key: str) -> bool:
    value = raw.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ProtocolError(f"kv_transfer_params.{key} must be a boolean, got {value!r}")
    return value


def _port(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ProtocolError(f"kv_transfer_params.{key} must be a port number, got {value!r}")
    return value


def _peer(raw: Mapping[str, Any], request_id: str, role: Role) -> PeerAddress | None:
    if raw.get("remote_host") is not None:
        host = raw["remote_host"]
        if not isinstance(host, str) or not host:
            raise ProtocolError(f"kv_transfer_params.remote_host must be a host name, got {host!r}")
        return PeerAddress(host, _port(raw, "remote_handshake_port"), _port(raw, "remote_notify_port"))
    pair = parse_request_id(request_id)
    if pair is None:
        return None
    prefill, decode = pair
    return decode if role is Role.PRODUCER else prefill


def parse_transfer_params(
    raw: Mapping[str, Any] | None, request_id: str, role: Role
) -> TransferParams | None:
    """Returns None for a request that is not disaggregated on this side; raises ProtocolError
    (with a message naming the field) when the params are malformed."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ProtocolError(f"kv_transfer_params must be an object, got {type(raw).__name__}")
    wanted = "do_remote_decode" if role is Role.PRODUCER else "do_remote_prefill"
    if not _flag(raw, wanted):
        return None
    transfer_id = raw.get("transfer_id")
    if not isinstance(transfer_id, str) or not transfer_id or len(transfer_id) > 256:
        raise ProtocolError(f"kv_transfer_params.transfer_id must be a non-empty string, got {transfer_id!r}")
    block_ids = raw.get("remote_block_ids")
    if block_ids is not None:
        if not isinstance(block_ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids
        ):
            raise ProtocolError("kv_transfer_params.remote_block_ids must be a list of block numbers")
        block_ids = tuple(block_ids)
    expires = raw.get("hold_expires_at")
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, (int, float))):
        raise ProtocolError(f"kv_transfer_params.hold_expires_at must be a unix time, got {expires!r}")
    return TransferParams(
        transfer_id=transfer_id,
        peer=_peer(raw, request_id, role),
        remote_block_ids=block_ids,
        hold_expires_at=float(expires) if expires is not None else None,
    )
