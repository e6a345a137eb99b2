"""LocalChunk: D's local prefill chunk follows its running streams."""

from __future__ import annotations

import math

from pdserve.placement.chunk_size import MIN_CHUNK, STEP_HEADROOM, chunk_tokens, threshold
from pdserve.placement.step_costs import Coefficients

COSTS = Coefficients(overhead_s=0.010, per_prefill_token_s=0.002, per_decode_s=0.001)


def test_with_no_stream_running_a_prompt_takes_the_whole_cap():
    assert chunk_tokens(COSTS, 0, 0.050, 512) == 512
    assert chunk_tokens(None, 0, 0.050, 512) == 512  # nobody to protect, nothing to measure


def test_with_streams_running_a_chunk_step_stays_within_the_bound_with_headroom():
    # 20 decodes: 10 + 20 = 30 ms; 0.8 x 50 ms leaves 10 ms, 5 tokens at 2 ms
    assert chunk_tokens(COSTS, 20, 0.050, 512) == 5
    chunk = chunk_tokens(COSTS, 5, 0.100, 512)  # 80 - 15 = 65 ms: 32 tokens
    assert chunk == 32 and COSTS.step_seconds(chunk, 5) <= STEP_HEADROOM * 0.100 < COSTS.step_seconds(chunk + 1, 5)
    assert chunk_tokens(COSTS, 5, 10.0, 512) == 512  # never past the cap
    assert chunk_tokens(COSTS, 50, 0.050, 512) == 0  # the decodes alone fill the step
    assert chunk_tokens(None, 5, 0.050, 512) == 0  # unmeasured: no bound can be kept


def test_prompts_in_progress_share_the_chunk_and_always_progress():
    assert threshold(512, 1) == 512 and threshold(512, 0) == 512
    assert threshold(100, 2) == 50
    assert threshold(20, 4) == MIN_CHUNK and threshold(0, 1) == MIN_CHUNK


def test_without_a_step_bound_a_prompt_takes_the_whole_cap_beside_streams():
    assert chunk_tokens(COSTS, 20, math.inf, 512) == 512
    assert chunk_tokens(None, 20, math.inf, 512) == 512  # nothing to keep, nothing to measure


def test_the_response_bound_holds_every_step_with_or_without_streams():
    # no stream: 0.8 x 100 ms - 10 ms overhead leaves 70 ms, 35 tokens at 2 ms
    assert chunk_tokens(COSTS, 0, 0.050, 512, response_s=0.100) == 35
    assert chunk_tokens(COSTS, 0, math.inf, 512, response_s=0.100) == 35
    # with streams the tighter of the two bounds holds
    assert chunk_tokens(COSTS, 5, 0.100, 512, response_s=0.050) == chunk_tokens(COSTS, 5, 0.050, 512)
    assert chunk_tokens(COSTS, 5, 0.050, 512, response_s=0.100) == chunk_tokens(COSTS, 5, 0.050, 512)
    # with no stream it never stops a prompt, and never passes the cap
    assert chunk_tokens(COSTS, 0, math.inf, 512, response_s=0.010) == MIN_CHUNK
    assert chunk_tokens(COSTS, 0, math.inf, 20, response_s=10.0) == 20
    assert chunk_tokens(None, 0, math.inf, 512, response_s=0.100) == 512  # unmeasured: the first prompt runs whole


def test_the_headroom_sets_how_full_of_its_bound_a_chunk_step_is_planned():
    tight = chunk_tokens(COSTS, 5, 0.100, 512, headroom=0.5)
    loose = chunk_tokens(COSTS, 5, 0.100, 512, headroom=0.9)
    assert tight < chunk_tokens(COSTS, 5, 0.100, 512) < loose
    assert COSTS.step_seconds(tight, 5) <= 0.5 * 0.100 < COSTS.step_seconds(tight + 1, 5)
    assert COSTS.step_seconds(loose, 5) <= 0.9 * 0.100 < COSTS.step_seconds(loose + 1, 5)
    assert chunk_tokens(COSTS, 0, math.inf, 512, headroom=0.5) == 512  # no bound: the headroom has nothing to fill
