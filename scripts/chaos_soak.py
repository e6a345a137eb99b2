"""Chaos soak: PD in WRITE mode (tiny model) behind the front, as `pdserve up` runs it, under steady
Poisson load while P and D are SIGKILLed alternately every few minutes (the cluster's supervisor
restarts them), every response checked against collocated serving: half the requests streamed
(a stream broken by a death is continued by the front; its tokens are checked whole), half not.

The load is placed from a calibration on this machine: a closed-loop burst through the router
measures the sustainable rate, and the soak runs at 70% of it (the goodput rate of write mode is
bounded by that rate). Writes benchmarks/chaos-soak/results.json and README.md.

    .venv/bin/python scripts/chaos_soak.py [--minutes 30] [--restart-every 180]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.compare import compare_greedy, fetch_greedy, parse_choice, parse_stream  # noqa: E402
from pdserve.faults.matrix import TIMEOUTS, metrics_by_name  # noqa: E402
from pdserve.launch import Cluster, UpOptions, plan  # noqa: E402
from pdserve.launch.modes import with_front  # noqa: E402
from pdserve.launch.pd_modes import pd_deployment  # noqa: E402
from pdserve.launch.process import group_members  # noqa: E402
from pdserve.model.build import resolve_model  # noqa: E402

PORTS = {"write": 29500, "collocated": 29600}
MAX_TOKENS = 32
POOL = 48


def options(mode: str) -> UpOptions:
    return UpOptions(mode=mode, model=str(resolve_model("tiny")), port=PORTS[mode], enforce_eager=True,
                     extra_vllm_args=("--max-num-batched-tokens", "512"))


def prompt_pool(seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(rng.randrange(16, 1024))] for _ in range(POOL)]


def shm_entries() -> dict[str, int]:
    out = {}
    for name in os.listdir("/dev/shm"):
        try:
            out[name] = os.stat(f"/dev/shm/{name}").st_size
        except OSError:
            pass
    return out


def rss_mib(pids: list[int]) -> float:
    total = 0
    for group in pids:
        for pid in group_members(group):
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            except (OSError, StopIteration, ValueError):
                pass
    return round(total / 1024, 1)


class Counters:
    """pdserve/vLLM counters summed over instance restarts (a restarted instance starts from 0)."""

    NAMES = ("pdserve:kv_recomputed_total", "pdserve:kv_transfers_completed_total", "pdserve:kv_transfers_failed_total",
             "pdserve:kv_transfers_fenced_total")

    def __init__(self, urls: dict[str, str]):
        self.urls, self.last, self.total = urls, {}, {}

    def poll(self) -> None:
        for name, url in self.urls.items():
            try:
                text = requests.get(f"{url}/metrics", timeout=5).text
            except requests.RequestException:
                continue
            for metric in self.NAMES:
                value = sum(float(l.rpartition(" ")[2]) for l in text.splitlines() if l.startswith(metric))
                key = (name, metric)
                previous = self.last.get(key, 0.0)
                self.total[key] = self.total.get(key, 0.0) + (value - previous if value >= previous else value)
                self.last[key] = value

    def get(self, name: str, metric: str) -> float:
        return self.total.get((name, metric), 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--restart-every", type=float, default=180)
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the calibrated rate")
    parser.add_argument("--max-error-rate", type=float, default=0.005, help="share of requests allowed to fail")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "chaos-soak"))
    args = parser.parse_args()
    pool = prompt_pool()
    shm_before = shm_entries()
    with Cluster(plan(options("collocated"))) as cluster:
        cluster.wait_healthy(600)
        reference = fetch_greedy(cluster.endpoint, pool, max_tokens=MAX_TOKENS, concurrency=4)
    rng = random.Random(3)
    records: list[dict] = []
    windows: list[tuple[float, float, str]] = []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-"):
        deployment = with_front(pd_deployment(options("write"), "write", connector_extra=dict(TIMEOUTS)), 5.0)
        with Cluster(deployment, restart="on-failure") as cluster:
            cluster.wait_healthy(600)
            urls = {"prefill": cluster.instance_urls["prefill"], "decode": cluster.instance_urls["decode"]}
            model = requests.get(f"{urls['prefill']}/v1/models", timeout=30).json()["data"][0]["id"]
            endpoint = cluster.endpoint
            _wait_routable(endpoint, model)

            def one(index: int, stream: bool = False) -> dict:
                started, status = time.time(), 0
                body = {"model": model, "prompt": pool[index], "max_tokens": MAX_TOKENS, "temperature": 0,
                        "logprobs": 2, "return_token_ids": True, "ignore_eos": True, "stream": stream}
                try:
                    with requests.post(f"{endpoint}/v1/completions", json=body, timeout=120, stream=stream) as response:
                        status = response.status_code
                        if status == 200 and stream:
                            events, error = streamed(response)
                            ok = not error and compare_greedy([reference[index]], [parse_stream(events)]).ok
                        elif status == 200:
                            ok, error = compare_greedy([reference[index]], [parse_choice(response.json()["choices"][0])]).ok, ""
                        else:
                            ok, error = False, response.text[:200]
                except (requests.RequestException, ValueError, KeyError) as exc:
                    ok, error = False, f"{type(exc).__name__}"
                if status == 200 and error:
                    status = 0  # broke off, ended in an error event, or unreadable: not served
                return {"start": started, "end": time.time(), "status": status, "correct": ok, "error": error,
                        "stream": stream}

            # calibration: closed loop, 4 at a time, 20 s
            cal_end = time.monotonic() + 20
            done = [0]

            def closed_loop():
                while time.monotonic() < cal_end:
                    one(rng.randrange(POOL))
                    with lock:
                        done[0] += 1

            threads = [threading.Thread(target=closed_loop) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            capacity = done[0] / 20.0
            rate = args.load * capacity
            print(f"calibration: {capacity:.2f} req/s closed-loop (4 at a time); soak at {rate:.2f} req/s", flush=True)
            counters = Counters(urls)
            counters.poll()
            front_before = front_counters(endpoint)
            groups = [p.pid for p in cluster.processes]
            rss_start = rss_mib(groups)
            soak_start = time.time()
            soak_end = time.monotonic() + args.minutes * 60
            next_restart = time.monotonic() + args.restart_every
            victim = "prefill"
            futures = []
            with ThreadPoolExecutor(64) as executor:
                next_poll = time.monotonic()
                while time.monotonic() < soak_end:
                    now = time.monotonic()
                    if now >= next_restart:
                        process = next(p for p in cluster.instances if p.spec.name == victim)
                        killed = time.time()
                        try:
                            os.killpg(process.pid, signal.SIGKILL)
                        except (ProcessLookupError, TypeError):
                            pass
                        threading.Thread(target=_record_window, args=(windows, victim, killed, urls[victim], endpoint,
                                                                      model), daemon=True).start()
                        victim = "decode" if victim == "prefill" else "prefill"
                        next_restart = now + args.restart_every
                    if now >= next_poll:
                        counters.poll()
                        next_poll = now + 5
                    futures.append(executor.submit(one, rng.randrange(POOL), rng.random() < 0.5))
                    time.sleep(rng.expovariate(rate))
                records = [f.result() for f in futures]
            counters.poll()
            front_after = front_counters(endpoint)
            groups = [p.pid for p in cluster.processes]
            rss_end = rss_mib(groups)
            restarts = dict(cluster.restarts)
        all_groups = groups
    time.sleep(2)
    shm_after = shm_entries()
    left_shm = {n: s for n, s in shm_after.items() if n not in shm_before}
    left_procs = [pid for g in all_groups for pid in group_members(g)]

    def in_window(record) -> bool:
        margin = TIMEOUTS["transfer_timeout"] + TIMEOUTS["release_grace"] + 5
        return any(start - 1 <= record["end"] and record["start"] <= end + margin for start, end, _ in windows)

    served = [r for r in records if r["status"] == 200]
    errors = [r for r in records if r["status"] != 200]
    result = {
        "minutes": args.minutes, "restart_every_s": args.restart_every, "calibrated_rate": round(capacity, 2),
        "rate": round(rate, 2), "requests": len(records), "served_200": len(served),
        "wrong_token_200": sum(1 for r in served if not r["correct"]),
        "streamed": sum(r["stream"] for r in records),
        "errors": len(errors), "error_rate": round(len(errors) / max(len(records), 1), 4),
        "errors_outside_restart_windows": sum(1 for r in errors if not in_window(r)),
        "front": {name: front_after.get(name, 0.0) - front_before.get(name, 0.0) for name in front_after},
        "restart_windows": [{"victim": v, "killed_at_s": round(s - soak_start, 1), "routable_after_s": round(e - s, 1)}
                            for s, e, v in windows],
        "restarts": restarts,
        "recomputed": counters.get("decode", "pdserve:kv_recomputed_total"),
        "transfers_completed_d": counters.get("decode", "pdserve:kv_transfers_completed_total"),
        "transfers_failed_d": counters.get("decode", "pdserve:kv_transfers_failed_total"),
        "fenced": counters.get("decode", "pdserve:kv_transfers_fenced_total") + counters.get("prefill", "pdserve:kv_transfers_fenced_total"),
        "rss_mib_start": rss_start, "rss_mib_end": rss_end,
        "shm_entries_left": left_shm, "processes_left": left_procs,
        "error_samples": sorted({r["error"] for r in errors})[:10],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = ["# Chaos soak (write mode, tiny model)", ""] + [f"- **{k}**: {v}" for k, v in result.items()]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result, indent=1))
    bad = (result["wrong_token_200"] or result["errors_outside_restart_windows"] or left_shm or left_procs
           or result["error_rate"] > args.max_error_rate)
    return 1 if bad else 0


def streamed(response) -> tuple[list[dict], str]:
    """The events of a streamed completion, and what went wrong ("" if it ended with [DONE])."""
    events = []
    for line in response.iter_lines(chunk_size=None):
        if line == b"data: [DONE]":
            return events, ""
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            if "error" in event:
                return events, f"error event: {str(event['error'])[:160]}"
            events.append(event)
    return events, "the stream ended without [DONE]"


def front_counters(endpoint: str) -> dict[str, float]:
    """The front's request counters (pdserve:requests_*), summed over their labels."""
    return {name: value for name, value in metrics_by_name(endpoint).items() if name.startswith("pdserve:requests_")}


def _wait_routable(endpoint: str, model: str, timeout: float = 240) -> float:
    started = time.time()
    while time.time() - started < timeout:
        try:
            body = {"model": model, "prompt": [11, 12, 13], "max_tokens": 1}
            if requests.post(f"{endpoint}/v1/completions", json=body, timeout=30).status_code == 200:
                return time.time()
        except requests.RequestException:
            pass
        time.sleep(0.5)
    return time.time()


def _record_window(windows, victim, killed, url, endpoint, model) -> None:
    time.sleep(2)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(1)
    windows.append((killed, _wait_routable(endpoint, model), victim))


if __name__ == "__main__":
    raise SystemExit(main())
