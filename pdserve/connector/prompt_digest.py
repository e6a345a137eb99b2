"""The digest of a prompt's token ids that travels with its KV transfer.

P and D each compute it from their own request; a transfer whose two sides disagree fails
instead of delivering another prompt's KV (two prompts of equal length but different tokens,
a mixed-up transfer id, a buggy peer).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence


def prompt_digest(token_ids: Sequence[int]) -> str:
    """32 lowercase hex digits of SHA-256 over the token ids (little-endian int64) and their count."""
    data = array("q", token_ids)
    if data.itemsize != 8:
        raise RuntimeError("array('q') must be 8 bytes")
    if sys.byteorder != "little":
        data.byteswap()
    digest = hashlib.sha256(len(token_ids).to_bytes(8, "little"))
    digest.update(data.tobytes())
    return digest.hexdigest()[:32]
