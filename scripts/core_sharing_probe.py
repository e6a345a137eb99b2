"""Two plain vLLM instances on the same cores: do they share them well enough for PD?

A PD pair on two cores gives P one core, so a prompt's prefill takes about twice as long as on one
collocated instance using both. This probe asks whether both instances could instead run on both
cores (each with one OpenMP thread per core, equal priority), letting the OS share them:

* instance A computes 512-token prompts one after another (what P does);
* instance B decodes 1 or 8 streams (what D does);

first each alone, then both at once. It prints A's median prefill time (its TTFT with one output
token) and B's mean inter-token latency. Run it with each layout and compare within one run of the
machine:

    python scripts/core_sharing_probe.py split            # A on core 0, B on core 1 (what pdserve does)
    python scripts/core_sharing_probe.py shared           # both on cores 0,1, OpenMP threads spin-wait
    python scripts/core_sharing_probe.py shared-passive   # both on cores 0,1, OMP_WAIT_POLICY=PASSIVE

Results: benchmarks/adaptive/core-sharing.md. Needs two free cores (nothing else running).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import threading
import time

import requests

from pdserve import launch
from pdserve.launch.modes import Deployment
from pdserve.model.build import resolve_model

LAYOUTS = ("split", "shared", "shared-passive")
PROMPT_TOKENS = 512
TIMEOUT_S = 120


class Client:
    def __init__(self, url: str, seed: int):
        self.url = url
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.model = requests.get(url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]

    def _prompt(self, tokens: int) -> list[int]:
        with self._lock:  # fresh token ids every time: no prefix-cache hit
            return [self._rng.randrange(100, 8000) for _ in range(tokens)]

    def run(self, prompt_tokens: int, output_tokens: int) -> tuple[float, float | None]:
        """(TTFT, mean ITL over the stream, None for one output token), from the streamed chunks.
        The mean ITL is (last chunk - first chunk) / (tokens - 1): a chunk whose text is empty
        (incomplete UTF-8) is not sent, so chunks are not tokens but the span is."""
        start = time.monotonic()
        chunks = []
        body = {"model": self.model, "prompt": self._prompt(prompt_tokens), "max_tokens": output_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with requests.post(self.url + "/v1/completions", json=body, stream=True, timeout=TIMEOUT_S) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunks.append(time.monotonic())
        if not chunks:
            raise RuntimeError(f"{self.url}: no token streamed")
        itl = (chunks[-1] - chunks[0]) / (output_tokens - 1) if output_tokens > 1 else None
        return chunks[0] - start, itl


def streams(client: Client, count: int, output_tokens: int) -> float:
    """Mean ITL of `count` concurrent 16-token prompts decoding `output_tokens` each."""
    itls: list[float] = []
    threads = [threading.Thread(target=lambda: itls.append(client.run(16, output_tokens)[1])) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    if len(itls) != count:
        raise RuntimeError("a stream failed or did not finish in time")
    return statistics.fmean(itls)


def measure(a: Client, b: Client) -> dict[str, float]:
    for client in (a, b):
        client.run(PROMPT_TOKENS, 4)  # warm-up
    out = {"A prefill alone": statistics.median(a.run(PROMPT_TOKENS, 1)[0] for _ in range(5))}
    for count in (1, 8):
        out[f"B ITL, {count} streams alone"] = streams(b, count, 64)
    for count in (1, 8):
        prefills: list[float] = []
        stop = threading.Event()

        def prefill_loop() -> None:
            while not stop.is_set():  # noqa: B023  joined in this iteration
                prefills.append(a.run(PROMPT_TOKENS, 1)[0])  # noqa: B023

        loop = threading.Thread(target=prefill_loop)
        loop.start()
        time.sleep(0.3)  # A is computing when B's streams start
        out[f"B ITL, {count} streams, A prefilling"] = streams(b, count, 200)
        stop.set()
        loop.join(TIMEOUT_S)
        out[f"A prefill while B runs {count} streams"] = statistics.median(prefills)
        out[f"A prefills completed meanwhile ({count} streams)"] = len(prefills)
    return out


def deployment(layout: str, port: int) -> Deployment:
    options = launch.UpOptions(mode="round-robin", model="small", restart="never", port=port)
    options = dataclasses.replace(options, model=str(resolve_model(options.model)))
    instances = launch.plan(options).instances  # two plain instances, one per core
    if layout != "split":
        env = {"OMP_WAIT_POLICY": "PASSIVE"} if layout == "shared-passive" else {}
        instances = tuple(dataclasses.replace(i, cores=(0, 1), extra_env={**i.extra_env, **env}) for i in instances)
    return Deployment(tuple(instances), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layout", choices=LAYOUTS)
    parser.add_argument("--port", type=int, default=19100)
    args = parser.parse_args()
    plan = deployment(args.layout, args.port)
    with launch.Cluster(plan, restart="never", startup_timeout=600) as cluster:
        cluster.wait_healthy(600)
        a, b = (Client(spec.url, seed) for seed, spec in enumerate(plan.instances))
        result = measure(a, b)
    print(json.dumps({"layout": args.layout, **{k: round(v * 1000, 1) if isinstance(v, float) else v
                                                for k, v in result.items()}}, indent=1))


if __name__ == "__main__":
    main()
