"""Warm a fresh deployment up before its first measured point (first-request compile, caches).

Warm-up prompts are plain words tagged with their index, so they share no prefix with the
random-token prompts of the measured points.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pdserve.bench.deployment import Endpoint
from pdserve.bench.plan import Workload
from pdserve.errors import LaunchError


def warm_up(endpoint: Endpoint, workload: Workload, num_prompts: int, timeout_s: float = 180.0) -> None:
    """Send ``num_prompts`` completions, two at a time; raise LaunchError if any fails.

    503 answers are retried until ``timeout_s``: a PD router refuses requests until its
    instances have registered."""
    def one(index: int) -> None:
        words = " ".join(f"warm{index}x{j % 53}" for j in range(workload.input_len // 3))
        body = {"model": endpoint.model_name, "prompt": words, "max_tokens": workload.output_len,
                "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(f"{endpoint.base_url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                    json.load(resp)
                return
            except urllib.error.HTTPError as exc:
                # a PD router answers 503 until both instances have registered (a heartbeat away)
                if exc.code != 503 or time.monotonic() > deadline:
                    raise LaunchError(f"warm-up request {index} to {endpoint.base_url} failed: {exc}") from exc
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise LaunchError(f"warm-up request {index} to {endpoint.base_url} failed: {exc}") from exc
            time.sleep(1.0)

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, range(num_prompts)))
