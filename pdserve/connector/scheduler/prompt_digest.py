"""The digest of a prompt that travels with its KV transfer.

P and D each compute it from their own request; a transfer whose two sides disagree fails
instead of delivering another prompt's KV (two prompts of equal length but different tokens,
a mixed-up transfer id, a buggy peer). A prompt given as embeddings (`--enable-prompt-embeds`)
has no token ids: its digest covers the embeddings' values and shape instead.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from pdserve.errors import ProtocolError


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


def embeds_digest(embeds) -> str:
    """32 lowercase hex digits of SHA-256 over a prompt-embeddings tensor's shape and its values as
    float32 (exact for the float16/bfloat16/float32 a model takes), tagged so that no token-id
    prompt shares it."""
    values = embeds.detach().to("cpu").float().contiguous().numpy()
    digest = hashlib.sha256(b"embeds:" + repr(tuple(values.shape)).encode())
    digest.update(values.astype("<f4", copy=False).tobytes())
    return digest.hexdigest()[:32]


def request_digest(request, tokens: int | None = None) -> str:
    """The digest of a vLLM request's prompt (its first `tokens` positions; None: all): its token
    ids, or else its prompt embeddings; ProtocolError for a request with neither."""
    if request.prompt_token_ids is not None:
        return prompt_digest(request.prompt_token_ids[:tokens])
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        raise ProtocolError(f"request {request.request_id} has neither prompt token ids nor prompt embeddings")
    return embeds_digest(embeds[:tokens])
