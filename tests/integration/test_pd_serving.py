"""PD disaggregation through vllm-router, both modes, real vLLM: correctness, KV reuse, chunked
prefill, bad input, client disconnect, and finally P killed under D (the survivor keeps serving).

The shared write and read deployments (pool.py) serve every test here, in order; the last test
kills P, which the deployment's supervisor restarts before the next module gets it.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests
import zmq

from pdserve.compare import compare_greedy
from pdserve.control.codec import Codec
from pdserve.control.endpoint import Client
from pdserve.control.messages import HandshakeRefused, HandshakeRequest, Release, WriteDone
from pdserve.control.secret import load_secret
from pdserve.launch.pd_modes import secret_file
from tests.integration.pd_helpers import (
    CHUNK_TOKENS,
    TIMEOUTS,
    check_decode_after_prefill_died,
    collocated_reference,
    greedy,
    metric,
    metrics,
    model_name,
    prompts,
    wait_idle,
)
from tests.integration.pool import DeploymentName, shared
from tests.integration.request_shapes import check_n_choices
from tests.integration.seeded_requests import check_seeded_requests

pytestmark = pytest.mark.integration

PROMPTS = prompts()


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return collocated_reference(greedy_reference, "pd40", PROMPTS)


pd = shared("pd-write", "pd-read")


def test_disaggregated_output_equals_collocated(pd, reference):
    before_p, before_d = metrics(pd.prefill_url), metrics(pd.decode_url)
    output = greedy(pd.endpoint, pd, PROMPTS)
    result = compare_greedy(reference, output)
    print(pd.mode, result.summary())
    assert result.ok, result.mismatches()
    after_p, after_d = metrics(pd.prefill_url), metrics(pd.decode_url)
    # every request really went P -> D: one completed transfer per prompt on each side, no failure
    for before, after in ((before_p, after_p), (before_d, after_d)):
        done = metric(after, "pdserve:kv_transfers_completed_total") - metric(before, "pdserve:kv_transfers_completed_total")
        assert done == len(PROMPTS)
        assert metric(after, "pdserve:kv_transfers_failed_total") == metric(before, "pdserve:kv_transfers_failed_total")
    # ... and the KV was used, not recomputed: D computed one token per prompt (the last one)
    computed = (metric(after_d, "vllm:prompt_tokens_by_source_total", source="local_compute")
                - metric(before_d, "vllm:prompt_tokens_by_source_total", source="local_compute"))
    transferred = (metric(after_d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
                   - metric(before_d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"))
    assert computed <= len(PROMPTS), f"D computed {computed} prompt tokens for {len(PROMPTS)} prompts"
    assert transferred >= sum(map(len, PROMPTS)) - len(PROMPTS)
    moved = metric(after_d, "pdserve:kv_transfer_bytes_total") - metric(before_d, "pdserve:kv_transfer_bytes_total")
    assert moved > 0


def test_chunked_prefill_on_p_was_exercised(pd):
    """P ran with a 512-token budget per step, so every prompt above 512 tokens that just passed
    the correctness check was prefilled on P in several chunks (vLLM cannot schedule more)."""
    assert sum(len(p) > CHUNK_TOKENS for p in PROMPTS) >= 10
    assert max(map(len, PROMPTS)) > 3 * CHUNK_TOKENS
    assert f"Chunked prefill is enabled with max_num_batched_tokens={CHUNK_TOKENS}" in _log(pd, "prefill")


def test_streaming_and_chat_through_router(pd):
    model = model_name(pd)
    body = {"model": model, "prompt": "The river", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chunks = []
    with requests.post(f"{pd.endpoint}/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 4
    chat = requests.post(f"{pd.endpoint}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Tell me about the harbor"}], "max_tokens": 8})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] > 0


def _plain_text(pd, prompt: list[int], max_tokens: int = 4) -> str:
    """What D itself generates for `prompt` with no transfer at all: the recompute reference."""
    response = requests.post(f"{pd.decode_url}/v1/completions", timeout=120, json={
        "model": model_name(pd), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("params, why", [
    ({"do_remote_prefill": True, "transfer_id": 7, "remote_host": "127.0.0.1",
      "remote_handshake_port": 1, "remote_notify_port": 2}, "transfer_id"),
    ({"do_remote_prefill": True, "transfer_id": "tx-no-peer"}, "names no peer"),
    ({"do_remote_prefill": "yes", "transfer_id": "tx-1"}, "do_remote_prefill"),
])
def test_malformed_kv_transfer_params_are_recomputed_and_named(pd, params, why):
    """load_failure_policy recompute (pdserve's default): the request is served by D's own prefill
    (the tokens it would give without any transfer), D's log names the bad field, and the
    recompute is counted. Never a 200 with tokens it could not have."""
    model = model_name(pd)
    prompt = [11, 12, 13, 14]
    mark = log_marks(pd)
    before = metric(metrics(pd.decode_url), "pdserve:kv_recomputed_total")
    started = time.monotonic()
    bad = requests.post(f"{pd.decode_url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": params})
    assert time.monotonic() - started < 30
    assert bad.status_code == 200, bad.text
    assert bad.json()["choices"][0]["text"] == _plain_text(pd, prompt)
    assert why in _log(pd, "decode", mark), f"D's log does not say what was wrong ({why!r})"
    deadline = time.monotonic() + 15
    while metric(metrics(pd.decode_url), "pdserve:kv_recomputed_total") <= before:
        assert time.monotonic() < deadline, "the recompute was not counted"
        time.sleep(0.5)


def test_forged_or_unknown_transfer_is_recomputed_never_wrong(pd):
    """A D leg whose transfer P never had: READ - blocks P never held for that id; WRITE - an id
    P never sees. Either way D recomputes within the deadlines: a 200 with D's own tokens."""
    model = model_name(pd)
    mark = log_marks(pd)
    prompt = list(range(20, 200))
    params = {"do_remote_prefill": True, "transfer_id": "tx-forged", "remote_host": "127.0.0.1",
              "remote_handshake_port": pd.port + 5, "remote_notify_port": pd.port + 6}
    if pd.mode == "read":
        params["remote_block_ids"] = [1, 2]
    started = time.monotonic()
    response = requests.post(f"{pd.decode_url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": params})
    # WRITE: D waits transfer_timeout for P's copies; P, idle (no engine step runs), still answers
    # D's Release between steps (connector/worker/idle_pump.py), so D need not wait a second transfer_timeout
    limit = TIMEOUTS["transfer_timeout"] + TIMEOUTS["release_grace"] + 15
    assert time.monotonic() - started < limit
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == _plain_text(pd, prompt)
    expected = "prompt_hash" if pd.mode == "read" else "timed out"
    assert expected in _log(pd, "decode", mark)
    wait_idle(pd.decode_url, timeout=30)


def test_unknown_transfer_ids_and_garbage_control_messages_are_rejected(pd, reference):
    mark = log_marks(pd)
    urls = (pd.prefill_url, pd.decode_url)
    rejected_before = [metric(metrics(url), "pdserve:control_messages_rejected_total") for url in urls]
    codec = Codec(load_secret(secret_file()), "test-peer")
    with Client(codec) as client:
        for port in (pd.port + 6, pd.port + 8):  # P's and D's notify ports
            client.send("127.0.0.1", port, WriteDone("tx-unknown", True))
            client.send("127.0.0.1", port, Release("tx-unknown"))
        refused = client.request("127.0.0.1", pd.port + 5,
                                 HandshakeRequest("test-peer", {"block_size": 64}), timeout_s=10)
    assert isinstance(refused, HandshakeRefused) and "block_size" in refused.reason
    context = zmq.Context()
    try:
        for port in (pd.port + 5, pd.port + 8):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)  # deliver before close
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(b"\x00garbage that is not a message")
            forged = Codec(b"wrong secret", "intruder").encode(Release("tx-1"))
            sock.send(forged)
            sock.close()
    finally:
        context.term()
    time.sleep(1.0)
    # both instances keep serving, correctly
    output = greedy(pd.endpoint, pd, PROMPTS[:4])
    assert compare_greedy(reference[:4], output).ok
    assert "rejected a message" in _log(pd, "decode", mark) and "rejected a message" in _log(pd, "prefill", mark)
    rejected = [metric(metrics(url), "pdserve:control_messages_rejected_total") - before
                for url, before in zip(urls, rejected_before)]
    assert all(count >= 2 for count in rejected), rejected


def test_client_disconnect_mid_stream_leaks_nothing(pd, reference):
    model = model_name(pd)
    body = {"model": model, "prompt": PROMPTS[7], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with requests.post(f"{pd.endpoint}/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # the connection is closed: D aborts the request, P has already let go of its blocks
    for url in (pd.prefill_url, pd.decode_url):
        wait_idle(url, timeout=TIMEOUTS["defer_timeout"] + 10)
    output = greedy(pd.endpoint, pd, PROMPTS[:2])
    assert compare_greedy(reference[:2], output).ok


def test_transfer_histograms_count_every_completed_transfer(pd):
    """Each instance's /metrics has the histograms beside the counters: one duration and one size
    observation per completed transfer, cumulative buckets, D's handshake with P; and every series
    the Grafana dashboard queries is there."""
    import re

    from tests.unit.test_dashboard import load, queried_series

    urls = (pd.prefill_url, pd.decode_url)
    before = {url: metrics(url) for url in urls}
    greedy(pd.endpoint, pd, PROMPTS[:6])

    def delta(samples, url, name):
        return metric(samples, name) - metric(before[url], name)

    for url in urls:
        deadline = time.monotonic() + 10  # the counters and histograms move in the same observe()
        while True:
            after = metrics(url)
            done = delta(after, url, "pdserve:kv_transfers_completed_total")
            counts = [delta(after, url, f"pdserve:kv_transfer_{h}_count") for h in ("duration_seconds", "size_bytes")]
            if (done == 6 and counts == [done, done]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (done, counts) == (6, [6, 6]), url
        assert delta(after, url, "pdserve:kv_transfer_size_bytes_sum") == delta(after, url, "pdserve:kv_transfer_bytes_total")
        assert delta(after, url, "pdserve:kv_transfer_duration_seconds_sum") == pytest.approx(
            delta(after, url, "pdserve:kv_transfer_seconds_total"), abs=1e-6)
        for histogram in ("kv_transfer_duration_seconds", "kv_transfer_size_bytes", "kv_handshake_duration_seconds"):
            name = f"pdserve:{histogram}"
            bounds = sorted((float(re.search(r'le="([^"]+)"', key).group(1)), value)
                            for key, value in after.items() if key.startswith(f"{name}_bucket{{"))
            assert len(bounds) > 10 and bounds[-1][0] == float("inf"), name
            counts_by_bound = [count for _, count in bounds]
            assert counts_by_bound == sorted(counts_by_bound), f"{name} buckets not cumulative: {bounds}"
            assert counts_by_bound[-1] == metric(after, f"{name}_count"), name
        missing = {s for s in queried_series(load()) if not any(k.partition("{")[0] == s for k in after)}
        assert not missing, f"{url} lacks series the dashboard queries: {sorted(missing)}"
    d_after = metrics(pd.decode_url)
    handshakes = metric(d_after, "pdserve:kv_handshake_duration_seconds_count")
    assert handshakes >= 1, "D's handshake with P was not timed"
    assert 0 < metric(d_after, "pdserve:kv_handshake_duration_seconds_sum") <= handshakes * TIMEOUTS["handshake_timeout"]
    print(pd.mode, "handshakes timed: P", metric(metrics(pd.prefill_url), "pdserve:kv_handshake_duration_seconds_count"),
          "D", handshakes)


def test_seeded_prompt_longer_than_a_chunk_leaves_prefill_serving(pd):
    check_seeded_requests(pd)


def test_idle_after_all_traffic(pd):
    for url in (pd.prefill_url, pd.decode_url):
        wait_idle(url, timeout=TIMEOUTS["defer_timeout"] + 10)


def test_n_children_move_their_kv_once_and_equal_collocated(pd, reference):
    index = next(i for i, prompt in enumerate(PROMPTS) if 200 <= len(prompt) <= 600)
    check_n_choices(pd, PROMPTS[index], reference[index])


@pytest.mark.parametrize("pd", [DeploymentName("pd-read")], ids=["pd-read"], indirect=True)
def test_prefill_killed_before_decode_has_the_kv(pd, reference):
    """Last test of the module: P prefilled and holds the blocks; it dies (SIGKILL) before D reads
    them. D must answer with an error, not hang past its deadline, free everything, and serve the
    next request correctly. (WRITE's case, D announcing its blocks to a dead P, runs where the write
    deployment's P dies anyway: test_availability.)"""
    prefill = next(p for p in pd.instances if p.spec.name == "prefill")
    params = requests.post(f"{pd.prefill_url}/v1/completions", timeout=120, json={
        "model": model_name(pd), "prompt": PROMPTS[5], "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "tx-kill-p"}}).json()["kv_transfer_params"]
    os.killpg(prefill.pid, signal.SIGKILL)
    check_decode_after_prefill_died(pd, params, PROMPTS[5], reference[5], reference)


def log_marks(cluster) -> dict[str, int]:
    """Where each instance's log ends now: what a test finds after it, the test caused."""
    return {name: cluster.log_path(name).stat().st_size for name in ("prefill", "decode")}


def _log(cluster, name: str, since: dict[str, int] | None = None) -> str:
    with open(cluster.log_path(name), "rb") as f:
        f.seek((since or {}).get(name, 0))
        return f.read().decode(errors="replace")
