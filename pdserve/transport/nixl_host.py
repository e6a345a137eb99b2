"""Proof that a peer shares our host: a token only a process on the owner's host can read back.

The handshake replier creates a tiny shared-memory segment holding 32 random bytes, drops its
name, and offers the path `/proc/<its pid>/fd/<n>` plus the token's SHA-256. A peer that can open
that path and finds a token with that digest runs on the same kernel, in the same PID namespace,
as the same user: exactly what the shm transport needs to map the replier's KV memory. A peer on
another host (or in another PID namespace) cannot open it, so an address never decides this.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import NamedTuple

from pdserve.errors import TransferError
from pdserve.transport.shared_segment import SharedSegment, segment_name

TOKEN_BYTES = 32


class HostClaim(NamedTuple):
    """What a handshake reply carries: where the token is, and its digest."""

    path: str
    digest: str


class HostProof:
    """Owns the token segment for the life of the process (closed by `close`)."""

    def __init__(self, token_suffix: str):
        token = secrets.token_bytes(TOKEN_BYTES)
        self._segment = SharedSegment.create(segment_name(token_suffix, "host"), TOKEN_BYTES)
        self._segment.mmap[:TOKEN_BYTES] = token
        self.claim = HostClaim(self._segment.unlink_name(), hashlib.sha256(token).hexdigest())

    def close(self) -> None:
        self._segment.close()


def verify(claim: HostClaim) -> str | None:
    """None when the claimed token is readable here and matches its digest, else why not."""
    if not claim.path or not claim.digest:
        return "the peer offered no host proof"
    try:
        segment = SharedSegment.attach(claim.path, TOKEN_BYTES)
    except (TransferError, OSError) as exc:
        return f"cannot open the peer's host proof: {exc}"
    try:
        token = bytes(segment.mmap[:TOKEN_BYTES])
    finally:
        segment.close(unlink=False)
    if not hmac.compare_digest(hashlib.sha256(token).hexdigest(), claim.digest):
        return f"{claim.path} holds another token (a different process of that pid)"
    return None
