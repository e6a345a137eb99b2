"""Shrinking a prefill leg on P: to a one-token prompt when decode prefills it itself, or
(`truncate_prompt`) to the part of the prompt P computes for a model with mamba or
linear-attention state (kv_groups.py).

vllm-router 0.1.17 waits for the prefill leg's answer in WRITE mode and fails the client's
request if it is an error, so a leg D took must still end with a 200. It must not run the prompt
(that is the point) and must not leave anything in P's prefix cache. Before vLLM schedules it
again, the leg's request is cut down to its first prompt token: vLLM then computes one token (a
step the size of a decode), caches no block (a one-token prompt fills none) and answers;
vllm-router discards that answer's token (the client's tokens come from D). The request is
changed in place, between two steps, on the scheduler's thread, only while nothing of it has
been computed or allocated; a request of another shape (prompt embeddings, a different vLLM) is
left alone and prefilled as under static placement, which is always safe. So is a request whose
answer needs the whole prompt computed on P (`prompt_logprobs`, which vLLM's completions API sets
for `echo` with `logprobs`): cut, it would answer with one prompt logprob for a longer prompt.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("pdserve.connector")

_warned = False


def needs_whole_prompt(request) -> bool:
    """Whether `request`'s answer is built from every prompt position (prompt logprobs)."""
    return getattr(getattr(request, "sampling_params", None), "prompt_logprobs", None) is not None


def _cuttable(request, longer_than: int) -> bool:
    """Whether `request` is a token prompt of more than `longer_than` tokens, nothing computed,
    whose answer does not need the whole prompt: one `_cut` may shorten."""
    if needs_whole_prompt(request):
        return False
    try:
        prompt, tokens = request.prompt_token_ids, request._all_token_ids
        return (isinstance(prompt, list) and isinstance(tokens, list) and len(prompt) > longer_than
                and getattr(request, "prompt_embeds", None) is None
                and request.num_computed_tokens == 0 and len(tokens) == len(prompt) == request.num_prompt_tokens)
    except AttributeError:
        return False


def _cut(request, keep: int) -> None:
    del request.prompt_token_ids[keep:]
    del request._all_token_ids[keep:]
    request.num_prompt_tokens = keep


def truncate_to_one_token(request) -> bool:
    """Cut `request` (a vLLM Request waiting with nothing computed) to its first prompt token;
    False, and `request` untouched, when that cannot be done safely."""
    global _warned
    ok = (_cuttable(request, 0) and getattr(request, "prompt_is_token_ids", None) is None
          and isinstance(getattr(request, "block_hashes", None), list))
    if not ok:
        if not _warned:
            _warned = True
            logger.warning("pdserve: cannot shrink prefill leg %s (unexpected request shape): prefilling it",
                           getattr(request, "request_id", "?"))
        return False
    _cut(request, 1)
    request.block_hashes.clear()
    return True


def truncate_prompt(request, keep: int) -> bool:
    """Cut `request` (a new prefill leg of a model with mamba or linear-attention state, nothing
    computed) to its first `keep` prompt tokens: P computes the state after them and D the rest
    (kv_groups.py); `keep` 0 cuts it to one token (`truncate_to_one_token`): D computes it all.
    False, and `request` untouched, for a request of another shape; D then finds the digest of
    P's tokens differing from its own and computes the prompt itself. The prompt's block hashes
    stay: a block past `keep` is never computed here, so never cached."""
    if keep <= 0:
        return truncate_to_one_token(request)
    if not _cuttable(request, keep):
        return False
    _cut(request, keep)
    return True
