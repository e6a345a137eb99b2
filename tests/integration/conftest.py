"""Helpers for integration tests that bring up real vLLM: one launch per module, checked, stopped, verified gone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from pdserve import launch
from pdserve.launch import Cluster, UpOptions
from pdserve.launch.process import group_members
from tests.integration.pool import POOL, DeploymentPool, deployment_of
from tests.integration.port_check import still_bound

STARTUP_TIMEOUT = 600
# ten prompts of varied length, token-id prompts included through fetch_greedy callers
PROMPTS = [
    "The old sailor carried the rope to the harbor",
    "Once upon a time the king",
    "def compute_tensor(cache):\n    ",
    "| name | item | count |\n|---|---|---|\n",
    "Lodi said: \"Where is the bread?\"",
    "A quiet morning in the village. " * 20,
    "1 + 2 = 3; 4 * 5 = ",
    "Recipe: golden apple pie\nIngredients:\n",
    "The river flows north and the mountain",
    "Chapter 9: The Hidden Lantern\n\n" + "The lantern shone. " * 60,
]


@contextmanager
def launched(options: UpOptions) -> Iterator[Cluster]:
    """Bring a deployment up; after the block, stop it and assert nothing of it is left."""
    cluster = launch.up(options)
    try:
        cluster.wait_healthy(STARTUP_TIMEOUT)
        groups = [p.pid for p in cluster.processes]
        yield cluster
    finally:
        cluster.stop()
    assert all(group_members(g) == [] for g in groups), "a process of the launch survived stop()"
    bound = still_bound(cluster.deployment.ports)
    assert not bound, bound
    assert not cluster.run_dir.exists()


def model_of(cluster: Cluster) -> str:
    return requests.get(f"{cluster.endpoint}/v1/models", timeout=30).json()["data"][0]["id"]


def post(cluster: Cluster, path: str, body: dict) -> dict:
    response = requests.post(f"{cluster.endpoint}{path}", json={"model": model_of(cluster), **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream(cluster: Cluster, path: str, body: dict) -> list[dict]:
    """The SSE chunks of a streaming request; asserts the stream ends with [DONE]."""
    chunks, done = [], False
    with requests.post(f"{cluster.endpoint}{path}", json={"model": model_of(cluster), "stream": True, **body},
                       stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines(chunk_size=None):
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                chunks.append(json.loads(line[6:]))
    assert done
    return chunks


def check_serving(cluster: Cluster) -> None:
    """Completions and chat completions, streaming and not, through the launch's endpoint."""
    completion = post(cluster, "/v1/completions", {"prompt": "The river", "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True})
    assert completion["usage"]["completion_tokens"] == 8 and completion["choices"][0]["text"]
    chunks = stream(cluster, "/v1/completions", {"prompt": "The river", "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True})
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 4
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    messages = [{"role": "user", "content": "Where is the bread?"}]
    chat = post(cluster, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True})
    assert chat["choices"][0]["message"]["content"] and chat["usage"]["completion_tokens"] == 8
    chunks = stream(cluster, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"


def requests_served(instance_url: str) -> float:
    """vllm:request_success_total summed over labels, from the instance's own /metrics."""
    text = requests.get(f"{instance_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


# ---- the shared deployments (pool.py) ---------------------------------------------------------

def pytest_itemcollected(item):
    """Every test here is an integration test (`-m "not integration"` is the fast loop)."""
    if Path(__file__).parent in item.path.parents:
        item.add_marker(pytest.mark.integration)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Put the tests of each shared deployment next to each other (in file order, where its first
    test was), and tell the pool where each deployment's last test is."""
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        name = deployment_of(item)
        if name is not None:
            first.setdefault(name, index)
    position = {id(item): (first[n] if (n := deployment_of(item)) else index, index) for index, item in enumerate(items)}
    items.sort(key=lambda item: position[id(item)])
    last_use = {name: index for index, item in enumerate(items) if (name := deployment_of(item))}
    pool = DeploymentPool()
    pool.plan(last_use)
    config.stash[POOL] = pool
    config.stash[ORDER] = {item.nodeid: index for index, item in enumerate(items)}


def pytest_runtest_teardown(item, nextitem):
    """After a shared deployment's last test, stop it."""
    if POOL in item.config.stash:
        item.config.stash[POOL].finished(item.config.stash[ORDER].get(item.nodeid, -1))


@pytest.fixture(scope="session", autouse=True)
def deployment_pool(request):
    """Stops whatever shared deployment still runs when the session ends (a failed or stopped run)."""
    yield
    if POOL in request.config.stash:
        request.config.stash[POOL].close()


ORDER = pytest.StashKey[dict]()
