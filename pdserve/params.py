"""A request's `kv_transfer_params`, parsed once at the edge into a frozen `TransferParams`.

Producer (P) legs carry `do_remote_decode: true`; consumer (D) legs carry `do_remote_prefill:
true`. The peer's address comes from explicit `remote_host`/`remote_handshake_port`/
`remote_notify_port` fields, or else from the `X-Request-ID` that vllm-router sends
(`___prefill_addr_<zmq>___decode_addr_<zmq>_<hex>`), which vLLM keeps inside its request id.
Unknown keys (vllm-router adds `remote_dp_size`, `remote_tp_size`, ...) are ignored.

READ mode with adaptive placement: P decides where a prompt is prefilled and says so to D in the
`placement` key of its response ("remote:prefill_idle", "local:local_faster": a decision's label,
pdserve/placement/decision.py). A local one names no blocks: D prefills the prompt itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.config import Role
from pdserve.control.address import PeerAddress, check_host, parse_request_id
from pdserve.errors import ProtocolError
from pdserve.placement.decision import Decision, Placement

MAX_TRANSFER_ID_CHARS = 256
MAX_BLOCK_IDS = 1 << 20  # far above any prompt's blocks
MAX_BLOCK_ID = (1 << 40) - 1

_DIGEST = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class TransferParams:
    transfer_id: str
    peer: PeerAddress | None  # None when neither explicit fields nor the request id name one
    remote_block_ids: tuple[int, ...] | None  # READ: P's blocks, sent back by P
    hold_expires_at: float | None  # READ: unix time after which P may free its blocks
    prompt_hash: str | None = None  # READ: digest of the prompt P computed (prompt_digest.py)
    decision: Decision | None = None  # READ, adaptive placement: where P placed the prompt

    @property
    def local(self) -> bool:
        """READ: P left the prompt to D, which prefills it itself (no blocks to read)."""
        return self.decision is not None and self.decision.placement is Placement.LOCAL

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
        host = check_host(raw["remote_host"], "kv_transfer_params.remote_host")
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
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS:
        raise ProtocolError(
            f"kv_transfer_params.transfer_id must be a string of 1..{MAX_TRANSFER_ID_CHARS} characters, got {transfer_id!r:.80}"
        )
    block_ids = raw.get("remote_block_ids")
    if block_ids is not None:
        if not isinstance(block_ids, list) or len(block_ids) > MAX_BLOCK_IDS or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= MAX_BLOCK_ID for b in block_ids
        ):
            raise ProtocolError(
                f"kv_transfer_params.remote_block_ids must be a list of at most {MAX_BLOCK_IDS} block numbers "
                f"(0..{MAX_BLOCK_ID})"
            )
        block_ids = tuple(block_ids)
    expires = raw.get("hold_expires_at")
    if expires is not None and (
        isinstance(expires, bool) or not isinstance(expires, (int, float)) or not _finite(expires) or expires < 0
    ):
        raise ProtocolError(f"kv_transfer_params.hold_expires_at must be a unix time, got {expires!r:.40}")
    prompt_hash = raw.get("prompt_hash")
    if prompt_hash is not None and (not isinstance(prompt_hash, str) or not _DIGEST.fullmatch(prompt_hash)):
        raise ProtocolError(f"kv_transfer_params.prompt_hash must be 32 lowercase hex digits, got {prompt_hash!r:.40}")
    return TransferParams(
        prompt_hash=prompt_hash,
        decision=_decision(raw),
        transfer_id=transfer_id,
        peer=_peer(raw, request_id, role),
        remote_block_ids=block_ids,
        hold_expires_at=float(expires) if expires is not None else None,
    )


def build_transfer_params(transfer_id: str, engine_id: str, own: PeerAddress, held: "Held | None",
                          decision: Decision | None) -> dict[str, Any]:
    """P, READ: the kv_transfer_params P answers a prefill leg with, which vllm-router hands to the
    decode leg (parse_transfer_params reads them there): this instance's address, and the blocks it
    holds for D to read (`held`), or none where the prompt was left to D (`decision` local)."""
    params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
                              "remote_engine_id": engine_id, "remote_host": own.host,
                              "remote_handshake_port": own.handshake_port, "remote_notify_port": own.notify_port}
    if held is not None:
        params.update(remote_block_ids=list(held.block_ids), hold_expires_at=held.expires_at,
                      prompt_hash=held.prompt_hash)
    if decision is not None:
        params["placement"] = decision.label
    return params


@dataclass(frozen=True)
class Held:
    """P, READ: the blocks P holds for D to read, until `expires_at` (unix time)."""

    block_ids: tuple[int, ...]
    expires_at: float
    prompt_hash: str


def _decision(raw: Mapping[str, Any]) -> Decision | None:
    label = raw.get("placement")
    if label is None:
        return None
    try:
        if not isinstance(label, str) or len(label) > 64:
            raise ValueError
        return Decision.from_label(label)
    except ValueError:
        raise ProtocolError(f"kv_transfer_params.placement must be a placement decision such as 'local:local_faster', "
                            f"got {label!r:.80}") from None


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too big for a float
        return False
