"""PD faults, both modes, real vLLM: bytes corrupted in flight change the output (so the KV really
is used, and the correctness check can fail), and D killed during transfers leaves P clean.

One cluster per mode, started with the test-only `test_corrupt_transfers` switch; the last test
kills D.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from pdserve.compare import compare_greedy
from tests.integration.pd_helpers import TIMEOUTS, greedy, metric, metrics, model_name, pd_cluster, prompts, wait_idle

pytestmark = pytest.mark.integration

PORTS = {"write": 28400, "read": 28500}
PROMPTS = prompts(8, seed=99)


@pytest.fixture(scope="module")
def reference():
    with pd_cluster("collocated", 28600) as cluster:
        return greedy(cluster.endpoint, cluster, PROMPTS)


@pytest.fixture(scope="module", params=["write", "read"])
def corrupted(request, reference):
    with pd_cluster(request.param, PORTS[request.param], test_corrupt_transfers=True) as cluster:
        cluster.mode = request.param
        cluster.prefill_url = cluster.instance_urls["prefill"]
        cluster.decode_url = cluster.instance_urls["decode"]
        yield cluster


def test_corrupted_bytes_change_the_output(corrupted, reference):
    before = metrics(corrupted.decode_url)
    output = greedy(corrupted.endpoint, corrupted, PROMPTS)
    result = compare_greedy(reference, output)
    print(corrupted.mode, result.summary())
    assert not result.ok, "the output did not change although every transferred byte was corrupted"
    after = metrics(corrupted.decode_url)
    done = metric(after, "pdserve:kv_transfers_completed_total") - metric(before, "pdserve:kv_transfers_completed_total")
    assert done == len(PROMPTS)  # the transfers "succeeded": only the bytes were wrong


def test_decode_killed_during_transfers_leaves_prefill_clean(corrupted, reference):
    """Last test of the module: kill D (SIGKILL) while requests are in flight; P frees every
    block within its deadline and serves the next request correctly."""
    decode = next(p for p in corrupted.instances if p.spec.name == "decode")
    model = model_name(corrupted)
    errors: list[object] = []

    def send(prompt):
        try:
            requests.post(f"{corrupted.endpoint}/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 64, "ignore_eos": True})
        except requests.RequestException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(p,)) for p in prompts(6, seed=7)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    os.killpg(decode.pid, signal.SIGKILL)
    for thread in threads:
        thread.join(90)
    took = wait_idle(corrupted.prefill_url, timeout=TIMEOUTS["defer_timeout"] + 20)
    print(f"{corrupted.mode}: P idle {took:.1f} s after D died")
    plain = greedy(corrupted.prefill_url, corrupted, PROMPTS[:3], concurrency=1)
    assert compare_greedy(reference[:3], plain).ok
