"""Shared pieces of the xPyD and prefix-caching checks (tests and scripts/xpyd_check.py):
N prefill + M decode clusters, the shared-prefix and multi-turn workloads, counters per instance."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import requests

from pdserve.compare import Generation, Step, compare_greedy
from pdserve.launch import Cluster
from pdserve.launch.pd_modes import pd_deployment
from pdserve.launch.process import group_members
from tests.integration.pd_helpers import (
    LOG_DIR,
    TIMEOUTS,
    _segments,
    greedy,
    metric,
    metrics,
    model_name,
    options,
    wait_idle,
    wait_routable,
)
from tests.integration.port_check import still_bound

BLOCK_TOKENS = 128  # vLLM's CPU KV block size
PREFIX_TOKENS = 1000
PREFIX_BLOCKS = PREFIX_TOKENS // BLOCK_TOKENS  # full blocks of the shared prefix
CHAT_TOKENS = 16  # answer length per conversation turn
NUM_TURNS = 3
# Instances of one role share a core on a 2-core box, so a request may queue on P for longer than
# the 30 s the failure tests allow a transfer; D's transfer_timeout counts from its announcement.
XPYD_TIMEOUTS = {**TIMEOUTS, "transfer_timeout": 120, "defer_timeout": 180}
WORDS = ("harbor rope lantern bread river mountain village king sailor apple morning chapter quiet golden "
         "north tower garden winter letter window market silver forest candle bridge").split()


@contextmanager
def xpyd_cluster(mode: str, port: int, num_prefill: int, num_decode: int, **connector_extra) -> Iterator[Cluster]:
    """N prefill and M decode instances with PDConnector behind vllm-router (prefix caching on,
    as by default); `prefill_urls` / `decode_urls` are set on the cluster. After the block,
    nothing of it may remain."""
    opts = dataclasses.replace(options(mode, port), num_prefill=num_prefill, num_decode=num_decode)
    deployment = pd_deployment(opts, mode, connector_extra={**XPYD_TIMEOUTS, **connector_extra})
    segments_before = _segments()
    cluster = Cluster(deployment, log_dir=LOG_DIR / f"xpyd-{mode}-{num_prefill}p{num_decode}d-{port}")
    cluster.start()
    pids: list[int] = []
    try:
        cluster.wait_healthy(900)
        pids = [p.pid for p in cluster.processes]
        wait_routable(cluster, timeout=120)
        cluster.mode = mode
        cluster.prefill_urls = {i.name: i.url for i in deployment.instances if i.role == "prefill"}
        cluster.decode_urls = {i.name: i.url for i in deployment.instances if i.role == "decode"}
        yield cluster
    finally:
        cluster.stop()
    assert all(group_members(pid) == [] for pid in pids), "a process of the launch survived stop()"
    bound = still_bound(deployment.ports)
    assert not bound, bound
    leftovers = _segments() - segments_before
    assert not leftovers, f"shared memory left behind: {sorted(leftovers)}"


# ---- workloads -----------------------------------------------------------------------------

def shared_prefix_prompts(count: int = 40, seed: int = 77) -> list[list[int]]:
    """Token-id prompts: one 1,000-token prefix (7 full blocks and part of an 8th), then a
    suffix of 1 to ~300 tokens of its own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 4000) for _ in range(PREFIX_TOKENS)]
    lengths = [1, 24, 152, 280] + [rng.randrange(1, 300) for _ in range(count - 4)]
    return [prefix + [rng.randrange(10, 4000) for _ in range(n)] for n in lengths[:count]]


def conversations(count: int = 40, seed: int = 99) -> list[list[str]]:
    """`count` conversations of NUM_TURNS user messages (a shared system-like opening, then
    sentences of their own, some long enough to span blocks)."""
    rng = random.Random(seed)
    opening = "You are a careful storyteller. Answer in short sentences. " * 4
    out = []
    for c in range(count):
        turns = []
        for t in range(NUM_TURNS):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(5, 120)))
            turns.append((opening if t == 0 else "") + f"Part {t + 1} of story {c}: {words}.")
        out.append(turns)
    return out


@dataclass
class Turn:
    """One chat completion: the prompt vLLM rendered, the greedy steps, the answer text."""

    prompt_token_ids: list[int]
    generation: Generation
    text: str


def chat_turn(url: str, model: str, messages: list[dict], max_tokens: int = CHAT_TOKENS) -> Turn:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    assert data["usage"]["completion_tokens"] == max_tokens, data["usage"]
    steps = []
    for token_id, entry in zip(choice["token_ids"], choice["logprobs"]["content"]):
        best = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True) + [-math.inf, -math.inf]
        steps.append(Step(int(token_id), float(entry["logprob"]), (float(best[0]), float(best[1]))))
    return Turn(list(data.get("prompt_token_ids") or ()), steps, choice["message"]["content"])


def run_conversations(url: str, model: str, convs: list[list[str]], answers: list[list[str]] | None = None,
                      concurrency: int = 8) -> list[list[Turn]]:
    """Each conversation turn by turn through /v1/chat/completions; the next turn carries the
    previous user messages and answers. The answers are the endpoint's own, or `answers` (the
    reference's real answers, so both runs see the same prompts even where they part at a
    near-tie)."""

    def one(index: int) -> list[Turn]:
        messages, turns = [], []
        for t, user in enumerate(convs[index]):
            messages.append({"role": "user", "content": user})
            turn = chat_turn(url, model, messages)
            turns.append(turn)
            messages.append({"role": "assistant", "content": answers[index][t] if answers else turn.text})
        return turns

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(convs))))


def by_turn(results: list[list[Turn]]) -> list[Generation]:
    """Generations in one list, conversation by conversation, turn by turn."""
    return [turn.generation for conv in results for turn in conv]


def references(cache, batches: dict[str, list], port: int | None = None) -> dict:
    """Collocated reference outputs for the named batches (token-id prompts, or conversations
    under a key starting with "chat"), computed on the session's reference deployment for those
    not yet in `cache` (a ReferenceCache: the session's greedy_reference)."""
    from tests.integration.pd_helpers import REFERENCE_PORT, reference_server

    missing = [key for key in batches if key not in cache]
    if missing:
        cluster = reference_server(cache, port or REFERENCE_PORT)
        for key in missing:
            if key.startswith("chat"):
                cache[key] = run_conversations(cluster.endpoint, model_name(cluster), batches[key])
            else:
                cache[key] = greedy(cluster.endpoint, cluster, batches[key])
    return {key: cache[key] for key in batches}


# ---- counters ------------------------------------------------------------------------------

COUNTERS = {
    "transfers": ("pdserve:kv_transfers_completed_total", {}),
    "failed": ("pdserve:kv_transfers_failed_total", {}),
    "bytes": ("pdserve:kv_transfer_bytes_total", {}),
    "requests": ("vllm:request_success_total", {}),
    "computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "local_hit": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "external": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
}


def counters(url: str) -> dict[str, float]:
    samples = metrics(url)
    return {key: metric(samples, name, **labels) for key, (name, labels) in COUNTERS.items()}


def snapshot(cluster: Cluster) -> dict[str, dict[str, float]]:
    return {name: counters(url) for name, url in cluster.instance_urls.items()}


def delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {name: {k: after[name][k] - before[name][k] for k in after[name]} for name in after}


def role_total(moved: dict[str, dict[str, float]], names, key: str) -> float:
    return sum(moved[name][key] for name in names)


def wait_all_idle(cluster: Cluster, timeout: float = 60) -> None:
    """No request running and no KV block held on any instance: none leaked by a transfer."""
    for url in cluster.instance_urls.values():
        wait_idle(url, timeout)


def num_blocks(prompt_tokens: int) -> int:
    return math.ceil(prompt_tokens / BLOCK_TOKENS)


def check_agrees(reference: list[Generation], output: list[Generation], label: str) -> str:
    result = compare_greedy(reference, output)
    assert result.ok, f"{label}: {result.mismatches}"
    return f"{label}: {result.summary()}"


# ---- the checks (each returns its numbers; an AssertionError names what failed) ----------------

def measured(cluster: Cluster, work):
    """Run `work()`; then wait until no instance holds a block (every transfer over, none
    leaked); return its output and every instance's counter deltas."""
    before = snapshot(cluster)
    output = work()
    wait_all_idle(cluster)
    return output, delta(before, snapshot(cluster))


def min_prefix_hits(num_requests: int, num_instances: int) -> int:
    """Shared-prefix tokens a role must at least have found in its own caches: all but the first
    requests on each instance (up to 8 run at once) hit the prefix's full blocks; half of that."""
    return max(0, (num_requests - 8 * num_instances) * PREFIX_BLOCKS * BLOCK_TOKENS // 2)


def prompt_blocks(prompt_lengths) -> int:
    return sum(num_blocks(n) for n in prompt_lengths)


def check_correctness(cluster: Cluster, reference: list[Generation], batch: list[list[int]]) -> dict:
    """The connector correctness check: `batch` agrees with collocated serving, every instance
    took part, one transfer per prompt on each side, D computed only each prompt's last token.
    Sets `cluster.block_bytes`: the bytes D receives per block it lacks."""
    output, moved = measured(cluster, lambda: greedy(cluster.endpoint, cluster, batch))
    summary = check_agrees(reference, output, f"{len(batch)} prompts")
    for name in cluster.instance_urls:
        assert moved[name]["transfers"] > 0 and moved[name]["requests"] > 0, f"{name} took no part: {moved[name]}"
        assert moved[name]["failed"] == 0, f"{name}: {moved[name]}"
    for role in (cluster.prefill_urls, cluster.decode_urls):
        assert role_total(moved, role, "transfers") == len(batch), moved
    assert role_total(moved, cluster.decode_urls, "computed") <= len(batch), moved
    lacked = prompt_blocks(map(len, batch)) - role_total(moved, cluster.decode_urls, "local_hit") / BLOCK_TOKENS
    cluster.block_bytes = role_total(moved, cluster.decode_urls, "bytes") / lacked
    assert cluster.block_bytes > 0 and cluster.block_bytes == int(cluster.block_bytes), moved
    return {"summary": summary, "counters": moved, "block_bytes": cluster.block_bytes}


def check_moved_only_missing_blocks(cluster: Cluster, moved: dict, prompt_lengths: list[int]) -> dict:
    """D's counters: prompt tokens = local hits + external + computed; hits are whole blocks;
    D received exactly the blocks it lacked (full transfer minus its hits); no failure."""
    decode = cluster.decode_urls
    hit = role_total(moved, decode, "local_hit")
    external = role_total(moved, decode, "external")
    computed = role_total(moved, decode, "computed")
    assert hit % BLOCK_TOKENS == 0 and hit + external + computed == sum(prompt_lengths), moved
    assert computed <= len(prompt_lengths), moved
    full_bytes = prompt_blocks(prompt_lengths) * cluster.block_bytes
    received = role_total(moved, decode, "bytes")
    assert received == full_bytes - hit / BLOCK_TOKENS * cluster.block_bytes, \
        f"D received {received} bytes, not the {full_bytes} of a full transfer less its {hit} hit tokens: {moved}"
    if cluster.mode == "write":  # P wrote exactly what D received
        assert role_total(moved, cluster.prefill_urls, "bytes") == received, moved
    assert all(moved[n]["failed"] == 0 for n in cluster.instance_urls), moved
    return {"prompt_tokens": sum(prompt_lengths), "decode_local_hit_tokens": hit, "decode_external_tokens": external,
            "decode_computed_tokens": computed, "bytes_received": received, "bytes_full_transfer": full_bytes,
            "prefill_local_hit_tokens": role_total(moved, cluster.prefill_urls, "local_hit")}


def check_shared_prefix(cluster: Cluster, reference: list[Generation], batch: list[list[int]]) -> dict:
    """Prompts sharing a 1,000-token prefix agree with collocated serving; D's and P's own
    prefix caches served the shared blocks, and only the blocks D lacked were moved."""
    output, moved = measured(cluster, lambda: greedy(cluster.endpoint, cluster, batch))
    summary = check_agrees(reference, output, "shared 1,000-token prefix")
    numbers = check_moved_only_missing_blocks(cluster, moved, [len(p) for p in batch])
    assert numbers["decode_local_hit_tokens"] >= min_prefix_hits(len(batch), len(cluster.decode_urls)), numbers
    assert numbers["prefill_local_hit_tokens"] >= min_prefix_hits(len(batch), len(cluster.prefill_urls)), numbers
    return {"summary": summary, **numbers}


def check_multi_turn(cluster: Cluster, reference: list[list[Turn]], convs: list[list[str]]) -> dict:
    """Conversations through /v1/chat/completions agree with collocated serving turn by turn
    (same rendered prompts); D reused blocks of earlier turns and received only the rest."""
    answers = [[turn.text for turn in conv] for conv in reference]
    output, moved = measured(cluster, lambda: run_conversations(cluster.endpoint, model_name(cluster), convs, answers))
    summary = check_agrees(by_turn(reference), by_turn(output), f"{len(convs)} conversations x {NUM_TURNS} turns")
    for ref_conv, conv in zip(reference, output):
        assert [t.prompt_token_ids for t in conv] == [t.prompt_token_ids for t in ref_conv]
    numbers = check_moved_only_missing_blocks(cluster, moved, [len(t.prompt_token_ids) for c in output for t in c])
    assert numbers["decode_local_hit_tokens"] > 0, f"D reused no block of an earlier turn: {numbers}"
    assert role_total(moved, cluster.decode_urls, "transfers") == len(convs) * NUM_TURNS, moved
    return {"summary": summary, **numbers}


