"""PD faults, real vLLM: bytes corrupted in flight are caught by the KV digest in both modes (none
served, every one recomputed, the output equal to collocated serving), and D killed during transfers leaves P clean (WRITE,
where P holds a prompt's KV longest: until D's block ids come; READ's D-killed cell runs in
scripts/fault_matrix.py, its results in benchmarks/fault-matrix/).

The shared write and read deployments (pool.py), corruption switched on through their fault plan
for the first test only; the last test kills D, which the supervisor restarts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from pdserve.compare import compare_greedy
from tests.integration.pd_helpers import (
    TIMEOUTS,
    collocated_reference,
    greedy,
    metric,
    metrics,
    model_name,
    prompts,
    wait_idle,
)
from tests.integration.pool import DeploymentName, shared

pytestmark = pytest.mark.integration

PORTS = {"write": 28400, "read": 28500}
PROMPTS = prompts(8, seed=99)


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return collocated_reference(greedy_reference, "faults8", PROMPTS)


corrupted = shared("pd-write", "pd-read")


def test_corrupted_copies_are_caught_by_the_digest_and_recomputed(corrupted, reference):
    """Every copied batch is corrupted where it lands (fault plan `corrupt_copy`); with the digest
    on (kv_verify's default), D catches every transfer, serves none of them and recomputes each:
    the output equals collocated serving. test_pd_serving shows D otherwise uses the KV it gets."""
    before = metrics(corrupted.decode_url)
    corrupted.fault_plan.write_text(json.dumps({"rules": [{"action": "corrupt_copy"}]}))
    time.sleep(0.6)  # the workers re-read the plan every 0.2 s
    try:
        output = greedy(corrupted.endpoint, corrupted, PROMPTS)
    finally:
        corrupted.fault_plan.write_text(json.dumps({"rules": []}))
    result = compare_greedy(reference, output)
    print(corrupted.mode, result.summary())
    after = metrics(corrupted.decode_url)

    def delta(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    mode = corrupted.mode.lower()
    assert delta("pdserve:kv_digest_mismatch_total", transport="shm", mode=mode) == len(PROMPTS)
    assert delta("pdserve:kv_transfers_completed_total") == 0  # none served from the corrupted KV
    assert delta("pdserve:kv_recomputed_total") == len(PROMPTS)
    assert result.ok, result.summary()


@pytest.mark.parametrize("corrupted", [DeploymentName("pd-write")], ids=["pd-write"], indirect=True)
def test_decode_killed_during_transfers_leaves_prefill_clean(corrupted, reference):
    """Last test of the module: D is frozen (SIGSTOP) while requests arrive, so P prefills them and
    holds their KV for D (WRITE: waiting for D's block ids; READ: waiting for D's read); then D is
    killed (SIGKILL). P must free every block within its deadline and serve the next request."""
    decode = next(p for p in corrupted.instances if p.spec.name == "decode")
    model = model_name(corrupted)

    def send(prompt):
        try:
            requests.post(f"{corrupted.endpoint}/v1/completions", timeout=120, json={
                "model": model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True})
        except requests.RequestException:
            pass  # D dies under this request: any error is fine, a hang is not

    os.killpg(decode.pid, signal.SIGSTOP)
    threads = [threading.Thread(target=send, args=(p,)) for p in prompts(4, seed=7)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while metric(metrics(corrupted.prefill_url), "vllm:kv_cache_usage_perc") == 0:
        assert time.monotonic() < deadline, "P never took the requests"
        time.sleep(0.2)
    time.sleep(1.0)
    held = metric(metrics(corrupted.prefill_url), "vllm:kv_cache_usage_perc")
    os.killpg(decode.pid, signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(150)
    assert not any(t.is_alive() for t in threads), "a client is still waiting"
    wait_idle(corrupted.prefill_url, timeout=TIMEOUTS["defer_timeout"] + 30)
    idle_after = time.monotonic() - killed
    print(f"{corrupted.mode}: P held {held:.4f} of its KV cache for the dead D; idle "
          f"{idle_after:.1f} s after the kill (defer_timeout {TIMEOUTS['defer_timeout']} s)")
    assert held > 0
    assert idle_after <= TIMEOUTS["defer_timeout"] + 10, "P held the dead D's KV past its deadline"
    plain = greedy(corrupted.prefill_url, corrupted, PROMPTS[:3], concurrency=1)
    assert compare_greedy(reference[:3], plain).ok
