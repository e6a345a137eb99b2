"""Would P and D do better sharing both cores than holding one each?

A PD pair on a two-core machine pins P to one core and D to the other (launch/cores.py), so each
prompt is prefilled by one core and every decode step runs on one core, while collocated serving
puts both cores on every step. This probe asks whether letting both instances use both cores (each
with two OpenMP threads) recovers that. Two plain instances of the small model: A decodes STREAMS
concurrent streams (its mean ITL, as D's streams see it), B prefills 512-token prompts (one-token
answers, as P's legs are) in a loop that computes for DUTY of the time. Layouts:

* ``pinned``: A on core 1, B on core 0, one thread each (what pdserve deploys);
* ``shared``: both on cores 0-1, two threads each, OpenMP's default waits;
* ``shared-passive``: the same with passive OpenMP waits (``OMP_WAIT_POLICY=PASSIVE``,
  ``GOMP_SPINCOUNT=0``, ``KMP_BLOCKTIME=0``), so a waiting thread yields its core.

Each layout measures A alone, B alone, then A beside B at each duty. Every prompt is distinct, so
the prefix cache never serves one. Prints medians and 90th percentiles. Needs the two cores free;
~5 min a layout.

    python scripts/shared_cores_probe.py [--layouts pinned,shared,shared-passive] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

from pdserve import launch
from pdserve.model.build import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead_probe import TIMEOUT_S, round_itl  # noqa: E402

PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
LAYOUTS = ("pinned", "shared", "shared-passive")
PROMPT_TOKENS = 512


class Prompts:
    """Distinct 512-token prompts, so no prefill is a prefix-cache hit."""

    def __init__(self):
        self._seeds = itertools.count(1)

    def next(self) -> list[int]:
        seed = next(self._seeds)
        return [100 + (seed * 7919 + k * 131 + (seed * k) % 97) % 7000 for k in range(PROMPT_TOKENS)]


def prefill(url: str, model: str, prompts: Prompts) -> float:
    body = {"model": model, "prompt": prompts.next(), "max_tokens": 1, "temperature": 0}
    start = time.monotonic()
    requests.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S).raise_for_status()
    return time.monotonic() - start


def prefill_loop(url: str, model: str, prompts: Prompts, duty: float, stop: threading.Event, out: list) -> None:
    """Prefill, then idle so that prefills fill `duty` of the time, until stopped."""
    while not stop.is_set():
        took = prefill(url, model, prompts)
        out.append(took)
        stop.wait(took * (1 - duty) / duty)


def instances(layout: str, port: int):
    options = launch.UpOptions(mode="round-robin", model="small", restart="never", port=port)
    options = dataclasses.replace(options, model=str(resolve_model(options.model)))
    first, second = launch.plan(options).instances  # two plain instances, on cores 0 and 1
    decode, prefill_ = second, first
    if layout != "pinned":
        env = PASSIVE_ENV if layout == "shared-passive" else {}
        decode, prefill_ = (dataclasses.replace(spec, cores=(0, 1), extra_env={**spec.extra_env, **env})
                            for spec in (decode, prefill_))
    return decode, prefill_


def measure(layout: str, duties: list[float], rounds: int, streams: int, tokens: int, port: int) -> dict:
    decode, prefill_ = instances(layout, port)
    prompts = Prompts()
    result: dict[str, list[float]] = {}
    with launch.Cluster(launch.Deployment((decode, prefill_), None), restart="never", startup_timeout=600) as cluster:
        cluster.wait_healthy(600)
        model = requests.get(decode.url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
        round_itl(decode.url, model, streams, 32, seed=0)  # warm-up
        for _ in range(2):
            prefill(prefill_.url, model, prompts)
        result["itl_alone"] = [round_itl(decode.url, model, streams, tokens, seed=100 * r) for r in range(rounds)]
        result["prefill_alone"] = [prefill(prefill_.url, model, prompts) for _ in range(2 * rounds)]
        for duty in duties:
            stop, took = threading.Event(), []
            loop = threading.Thread(target=prefill_loop, args=(prefill_.url, model, prompts, duty, stop, took))
            loop.start()
            try:
                time.sleep(1.0)
                result[f"itl_beside_prefill_{duty:g}"] = [
                    round_itl(decode.url, model, streams, tokens, seed=1000 * (r + 1)) for r in range(rounds)]
            finally:
                stop.set()
                loop.join(TIMEOUT_S)
            result[f"prefill_beside_decode_{duty:g}"] = took
    return {key: summarize(values) for key, values in result.items()}


def summarize(seconds: list[float]) -> dict:
    ms = sorted(1000 * s for s in seconds)
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 1),
            "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 1), "max_ms": round(ms[-1], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of " + ", ".join(LAYOUTS))
    parser.add_argument("--duties", default="0.5,0.9", help="shares of time the prefill loop computes")
    parser.add_argument("--rounds", type=int, default=3, help="decode rounds per measurement")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--port", type=int, default=19300)
    parser.add_argument("--out", type=Path, help="directory for result.json")
    args = parser.parse_args()
    duties = [float(d) for d in args.duties.split(",")]
    if any(not 0 < d < 1 for d in duties):
        parser.error("--duties: each share must be between 0 and 1")
    result = {"streams": args.streams, "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS, "layouts": {}}
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            parser.error(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
        result["layouts"][layout] = measure(layout, duties, args.rounds, args.streams, args.tokens, args.port)
        print(f"{layout}:", flush=True)
        for key, s in result["layouts"][layout].items():
            print(f"  {key:26s} median {s['median_ms']:7.1f} ms  p90 {s['p90_ms']:7.1f}  max {s['max_ms']:7.1f}"
                  f"  ({s['n']})", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
