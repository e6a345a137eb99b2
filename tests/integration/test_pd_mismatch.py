"""P and D whose KV layouts differ (D runs with 64-token blocks, P with 128): the handshake is
refused with a message naming the difference, every request is recomputed by D at once (correct
tokens, never tokens from misread KV), P lets go of the prompts' blocks at once (not at
defer_timeout), and both instances stay clean and keep serving plain requests. Both modes:
in WRITE, P is the one that handshakes; in READ, D is. These instances load the connector by its
bare name, through pdserve's vLLM plugin entry point.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve.compare import compare_greedy
from pdserve.launch import Cluster
from pdserve.launch.pd_modes import pd_deployment
from tests.integration.pd_helpers import (
    LOG_DIR,
    TIMEOUTS,
    collocated_reference,
    greedy,
    options,
    prompts,
    wait_idle,
    wait_registered,
)

pytestmark = pytest.mark.integration

PORTS = {"write": 28800, "read": 28900}
RELEASED_WITHIN_S = 10
PROMPTS = prompts(8, seed=99)  # the fault tests' prompts: their collocated reference is reused


@pytest.fixture(scope="module")
def reference(greedy_reference):
    return collocated_reference(greedy_reference, "faults8", PROMPTS)[:3]


@pytest.mark.parametrize("mode", ["write", "read"])
def test_incompatible_peers_refuse_and_both_keep_serving(mode, reference):
    opts = options(mode, PORTS[mode])
    deployment = pd_deployment(opts, mode, connector_extra=TIMEOUTS, by_name=True)  # via the vLLM plugin
    prefill, decode = deployment.instances
    decode = dataclasses.replace(decode, extra_args=(*decode.extra_args, "--block-size", "64"))
    cluster = Cluster(dataclasses.replace(deployment, instances=(prefill, decode)), log_dir=LOG_DIR / f"mismatch-{mode}")
    cluster.start()
    try:
        cluster.wait_healthy(600)
        wait_registered(cluster)
        started = time.monotonic()
        served = greedy(cluster.endpoint, cluster, PROMPTS[:3], concurrency=1)
        took = time.monotonic() - started
        assert compare_greedy(reference, served).ok, "a refused handshake must end in D's own prefill"
        assert took < TIMEOUTS["handshake_timeout"] + 30, f"took {took:.1f} s: the refusal should be fast"
        logs = {name: cluster.log_path(name).read_text(errors="replace") for name in ("prefill", "decode")}
        assert any("incompatible KV cache" in text and "block_size" in text for text in logs.values())
        for name, url in cluster.instance_urls.items():
            # well inside defer_timeout (40 s): the refusal itself frees P's blocks
            wait_idle(url, timeout=RELEASED_WITHIN_S)
            plain = greedy(url, cluster, PROMPTS[:3], concurrency=1)
            assert compare_greedy(reference, plain).ok, name
    finally:
        cluster.stop()
