"""Shared pieces of the PD integration tests: clusters with PDConnector, prompts, metrics."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

import requests

from pdserve.bench.samples import metric, parse_samples  # noqa: F401  (metric: used by the tests through here)
from pdserve.compare import compare_greedy, fetch_greedy, parse_choice
from pdserve.launch import Cluster, UpOptions, plan
from pdserve.launch.env import cache_dir
from pdserve.launch.modes import with_front
from pdserve.launch.options import RestartPolicy
from pdserve.launch.pd_modes import pd_deployment
from pdserve.launch.process import group_members
from pdserve.model.build import resolve_model
from tests.integration.port_check import still_bound

CHUNK_TOKENS = 512  # P's --max-num-batched-tokens: longer prompts are prefilled in chunks
MAX_TOKENS = 32
# Deadlines short enough that a failure test finishes quickly, long enough for a loaded 2-core box.
LOG_DIR = cache_dir() / "test-logs"  # the processes' logs are kept here after each test cluster stops
TIMEOUTS = {"transfer_timeout": 30, "defer_timeout": 40, "handshake_timeout": 10, "release_grace": 2}


def prompts(count: int = 40, seed: int = 1234) -> list[list[int]]:
    """Token-id prompts of 1 to ~1,800 tokens, most not a multiple of the 128-token block."""
    rng = random.Random(seed)
    lengths = [1, 2, 127, 128, 129, 513, 1025, 1800]
    lengths += [rng.randrange(3, 1800) for _ in range(count - len(lengths))]
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in lengths[:count]]


def options(mode: str, port: int) -> UpOptions:
    return UpOptions(mode=mode, model=str(resolve_model("tiny")), port=port, enforce_eager=True,
                     extra_vllm_args=("--max-num-batched-tokens", str(CHUNK_TOKENS)))


@contextmanager
def pd_cluster(mode: str, port: int, *, front: bool = False, restart: RestartPolicy = "never",
               **connector_extra) -> Iterator[Cluster]:
    """P and D with PDConnector behind vllm-router (and the front before it, as `pdserve up` runs
    it, with `front`); after the block, nothing of it may remain."""
    opts = options(mode, port)
    deployment = (pd_deployment(opts, mode, connector_extra={**TIMEOUTS, **connector_extra})
                  if mode in ("write", "read") else plan(opts))
    if front and deployment.front is None:
        deployment = with_front(deployment, drain_timeout=5.0)
    segments_before = _segments()
    cluster = Cluster(deployment, log_dir=LOG_DIR / f"{mode}-{port}", restart=restart)
    cluster.start()
    pids: list[int] = []
    try:
        cluster.wait_healthy(600)
        pids = [p.pid for p in cluster.processes]
        if mode in ("write", "read"):
            wait_routable(cluster)
        yield cluster
    finally:
        pids += [p.pid for p in cluster.processes]  # and those a supervisor restarted meanwhile
        cluster.stop()
    assert all(group_members(pid) == [] for pid in pids), "a process of the launch survived stop()"
    bound = still_bound(deployment.ports)
    assert not bound, bound
    leftovers = _segments() - segments_before
    assert not leftovers, f"shared memory left behind: {sorted(leftovers)}"


@contextmanager
def pd_pair(mode: str, port: int, *, front: bool = False, restart: RestartPolicy = "never",
            **connector_extra) -> Iterator[Cluster]:
    """pd_cluster for write/read, with `mode`, `prefill_url` and `decode_url` set on the cluster."""
    with pd_cluster(mode, port, front=front, restart=restart, **connector_extra) as cluster:
        cluster.mode = mode
        cluster.prefill_url = cluster.instance_urls["prefill"]
        cluster.decode_url = cluster.instance_urls["decode"]
        yield cluster


REFERENCE_PORT = 27600  # the session's collocated reference deployment (and the next few ports)


def reference_server(cache, port: int = REFERENCE_PORT) -> Cluster:
    """The session's collocated instance (tiny model, as `options`): one launch for every module's
    references; `cache` is a ReferenceCache (tests/reference_cache.py)."""
    return cache.server(lambda: pd_cluster("collocated", port))


def collocated_reference(cache, key: str, batch: list) -> list:
    """A collocated single instance's greedy output for `batch` (8 at a time, logprobs on),
    computed once per test session and kept in `cache` (the greedy_reference fixture) under `key`."""
    if key not in cache:
        cluster = reference_server(cache)
        cache[key] = greedy(cluster.endpoint, cluster, batch)
    return cache[key]


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("pdserve-")}


def model_name(cluster: Cluster) -> str:
    """The served model (asked once: later an instance may have been killed on purpose)."""
    if not hasattr(cluster, "model_name"):
        url = next(iter(cluster.instance_urls.values()))
        cluster.model_name = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    return cluster.model_name


def wait_registered(cluster: Cluster, timeout: float = 60) -> None:
    """Until vllm-router has both P and D registered (its /health answers 200)."""
    deadline = time.monotonic() + timeout
    while requests.get(f"{cluster.endpoint}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "P and D never registered with the router"
        time.sleep(0.5)


def wait_routable(cluster: Cluster, timeout: float = 60) -> None:
    """vllm-router learns P and D from their registration heartbeats; wait until a request passes."""
    deadline = time.monotonic() + timeout
    body = {"model": model_name(cluster), "prompt": [11, 12, 13], "max_tokens": 1}
    while True:
        response = requests.post(f"{cluster.endpoint}/v1/completions", json=body, timeout=60)
        if response.status_code == 200:
            return
        assert time.monotonic() < deadline, f"router never routed: {response.status_code} {response.text}"
        time.sleep(0.5)


def greedy(url: str, cluster: Cluster, batch: list, concurrency: int = 8, **kw):
    return fetch_greedy(url, batch, max_tokens=MAX_TOKENS, concurrency=concurrency, model=model_name(cluster), **kw)


def metrics(url: str) -> dict[str, float]:
    """Prometheus samples of an instance, keyed by the sample line's name{labels} (engine label kept)."""
    return parse_samples(requests.get(f"{url}/metrics", timeout=30).text)


def snapshot(cluster: Cluster) -> dict[str, dict[str, float]]:
    """Both instances' samples of a 1P+1D cluster, keyed "p" and "d"."""
    return {"p": metrics(cluster.prefill_url), "d": metrics(cluster.decode_url)}


def moved(before: dict, after: dict, side: str, name: str, **labels) -> float:
    """How far counter `name` (summed over samples matching `labels`) moved on `side` ("p" or "d")."""
    return metric(after[side], name, **labels) - metric(before[side], name, **labels)


def wait_idle(url: str, timeout: float) -> float:
    """Wait until the instance's KV cache usage is back to 0 (no running request, no held block);
    returns the seconds it took, fails the test at the deadline."""
    start = time.monotonic()
    while True:
        samples = metrics(url)
        usage = metric(samples, "vllm:kv_cache_usage_perc")
        running = metric(samples, "vllm:num_requests_running") + metric(samples, "vllm:num_requests_waiting")
        if usage == 0 and running == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"{url}: KV usage {usage}, {running} requests after {timeout} s"
        time.sleep(0.5)


def check_decode_after_prefill_died(pd: Cluster, params: dict, prompt: list[int], expected, reference3: list) -> None:
    """D is asked for `prompt` with `params` naming KV of a P that was SIGKILLed: D must answer with an
    error or the right tokens (only where the KV had fully landed before P died), not wait past its
    deadline, free everything, and serve the next requests (the first three of `reference3`'s
    prompts, PROMPTS[:3] of prompts()) correctly."""
    time.sleep(1.0)
    started = time.monotonic()
    response = requests.post(f"{pd.decode_url}/v1/completions", timeout=120, json={
        "model": model_name(pd), "prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 2,
        "return_token_ids": True, "ignore_eos": True, "kv_transfer_params": params})
    took = time.monotonic() - started
    assert took < TIMEOUTS["transfer_timeout"] + TIMEOUTS["release_grace"] + 15, f"D waited {took:.1f} s"
    if response.status_code == 200:
        # allowed only when the KV had fully landed before P died (READ: P's memory outlives it
        # in D's mapping) - then the tokens must be the right ones
        assert compare_greedy([expected], [parse_choice(response.json()["choices"][0])]).ok
    wait_idle(pd.decode_url, timeout=30)
    plain = greedy(pd.decode_url, pd, prompts()[:3], concurrency=1)
    assert compare_greedy(reference3[:3], plain).ok
