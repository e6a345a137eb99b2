"""`pdserve up --mode write` as users run it (the CLI, in its own session): the official `openai`
client and error shapes, then SIGTERM during a 16-request burst. Every request that had started
finishes with 200 and the tokens the same deployment gave for the same prompts before; a request
sent during the drain is refused with an OpenAI-shaped 503; nothing of the launch is left."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import requests

from pdserve.compare import compare_greedy, fetch_greedy, parse_choice
from pdserve.launch.env import runs_dir
from pdserve.launch.process import group_members
from tests.integration.conftest import PROMPTS
from tests.integration.openai_checks import check_error_shapes, check_openai_client, wait_routable
from tests.integration.pd_helpers import LOG_DIR
from tests.integration.port_check import still_bound

pytestmark = pytest.mark.integration

PORT = 27200  # 27200-27209
MODEL = "tiny"  # `pdserve up --model tiny` serves the built-in model under the name it was given
BURST = PROMPTS + [f"Story {i}: the lantern and the river" for i in range(6)]  # 16 prompts
BURST_TOKENS = 160  # long enough that the burst is still decoding when SIGTERM arrives
DRAIN_TIMEOUT = 180


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (the launch's process-group leaders)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`pdserve up --mode write`, healthy and routable; the test module stops it (last test)."""
    ready = tmp_path_factory.mktemp("drain") / "ready"
    before = set(runs_dir().glob(f"{PORT}-*")) if runs_dir().exists() else set()
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--mode", "write", "--port", str(PORT), "--enforce-eager",
         "--kv-cache", "256MiB", "--drain-timeout", str(DRAIN_TIMEOUT), "--log-dir", str(LOG_DIR / "drain"),
         "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate(timeout=60)
            time.sleep(0.5)
        process.endpoint = ready.read_text().strip()
        process.groups = children(process.pid)
        wait_routable(process.endpoint, MODEL)
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.communicate(timeout=DRAIN_TIMEOUT + 120)
    assert all(group_members(g) == [] for g in process.groups), "a process of the launch survived"
    bound = still_bound(range(PORT, PORT + 10))
    assert not bound, bound
    assert set(runs_dir().glob(f"{PORT}-*")) == before, "the run directory was left behind"


def test_openai_client_lists_the_model_and_streams_max_tokens(up):
    check_openai_client(up.endpoint, MODEL)


def test_errors_are_openai_shaped_and_name_the_cause(up):
    check_error_shapes(up.endpoint, MODEL)


@dataclass
class Streamed:
    """One streamed greedy completion: when its first token came, its merged choice, its status."""

    status: int = 0
    first_token_at: float | None = None
    choice: dict = field(default_factory=lambda: {"token_ids": [], "logprobs": {"token_logprobs": [],
                                                                                 "top_logprobs": []}})
    done: bool = False
    error: str | None = None


def stream_greedy(endpoint: str, model: str, prompt: str, out: Streamed) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": BURST_TOKENS, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, "ignore_eos": True, "stream": True}
    try:
        with requests.post(f"{endpoint}/v1/completions", json=body, stream=True, timeout=300) as response:
            out.status = response.status_code
            for line in response.iter_lines(chunk_size=None):
                if line == b"data: [DONE]":
                    out.done = True
                elif line.startswith(b"data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    out.choice["token_ids"] += choice.get("token_ids") or []
                    if choice.get("logprobs"):
                        out.choice["logprobs"]["token_logprobs"] += choice["logprobs"]["token_logprobs"]
                        out.choice["logprobs"]["top_logprobs"] += choice["logprobs"]["top_logprobs"]
                    if out.first_token_at is None and choice.get("token_ids"):
                        out.first_token_at = time.monotonic()
    except requests.RequestException as exc:
        out.error = repr(exc)


def test_sigterm_during_a_burst_finishes_what_started_and_stops_everything(up):
    model = MODEL
    reference = fetch_greedy(up.endpoint, BURST, max_tokens=BURST_TOKENS, concurrency=4, model=model)
    results = [Streamed() for _ in BURST]
    threads = [threading.Thread(target=stream_greedy, args=(up.endpoint, model, p, r)) for p, r in zip(BURST, results)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 300
    while not all(r.first_token_at or r.error for r in results):  # every request has started
        assert time.monotonic() < deadline, "the burst did not start"
        time.sleep(0.05)
    assert not any(r.error for r in results), [r.error for r in results]
    signalled = time.monotonic()
    up.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert not all(r.done for r in results), "the burst ended before SIGTERM: the test proves nothing"
    refused = requests.post(f"{up.endpoint}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4},
                            timeout=60)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"], refused.text
    for thread in threads:
        thread.join(DRAIN_TIMEOUT + 60)
    stdout, stderr = up.communicate(timeout=DRAIN_TIMEOUT + 120)
    print(f"\ndrain: {time.monotonic() - signalled:.1f} s from SIGTERM to exit")
    assert up.returncode == 0, stderr
    assert "draining" in stderr and "pdserve: stopped" in stderr, stderr
    for r in results:
        assert r.status == 200 and r.done and r.error is None, r
    candidate = [parse_choice(r.choice) for r in results]
    assert all(len(c) == BURST_TOKENS for c in candidate), [len(c) for c in candidate]
    result = compare_greedy(reference, candidate)
    print(f"burst through the drain vs the same prompts before: {result.summary()}")
    assert result.ok, result.summary()
