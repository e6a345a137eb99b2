"""The NIXL/transport-auto matrix on real vLLM, beyond what CI runs (tests/integration/test_two_host.py).

Cells (40 prompts each, greedy output compared with one collocated instance's):
  same-host-auto-write   P and D on one host, transport auto: shm must be chosen (counters)
  same-host-nixl-read    one host, transport nixl forced on both: NIXL (CMA) carries the KV
  two-host-auto-read     P on host a, D on host b (netns + PID ns), auto: NIXL must be chosen
  two-host-nixl-write    two hosts, transport nixl forced on D's host only, auto on P's
  two-host-p-killed      two hosts, READ mode: P SIGKILLed while D reads a burst of long prompts
                         (its NIXL agent dies mid-transfer): every request ends (200 or error) within
                         the deadlines, D then serves alone, nothing is left
  two-host-d-killed      two hosts, WRITE mode: D SIGKILLed mid-burst; P's blocks are freed
  two-host-mismatch      two hosts, D with another KV block size: handshake refused, D recomputes
Writes one JSON line per cell to benchmarks/nixl/check.jsonl (or --out) and prints a summary.
Run as root, under the machine's vLLM slot: python scripts/nixl_check.py [--cells a,b]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.compare import compare_greedy  # noqa: E402
from pdserve.errors import LaunchError  # noqa: E402
from pdserve.launch.two_host import TwoHostPD, metric  # noqa: E402
from tests.integration.pd_helpers import greedy, metrics, pd_cluster, pd_pair, prompts  # noqa: E402

PROMPTS = prompts()
REFERENCE_PORT, SAME_HOST_PORT = 30900, 30100


def attached(samples: dict, transport: str) -> float:
    return metric(samples, "pdserve:kv_peers_attached_total", transport=transport)


def transfer_counts(samples: dict) -> dict:
    return {"completed": metric(samples, "pdserve:kv_transfers_completed_total"),
            "failed": metric(samples, "pdserve:kv_transfers_failed_total"),
            "copy_bytes": metric(samples, "pdserve:kv_copy_bytes_total"),
            "copy_seconds": round(metric(samples, "pdserve:kv_copy_seconds_total"), 4),
            "attached_shm": attached(samples, "shm"), "attached_nixl": attached(samples, "nixl")}


def same_host(mode: str, transport: str, expect: str, reference: list) -> dict:
    with pd_pair(mode, SAME_HOST_PORT, transport=transport) as pd:
        result = compare_greedy(reference, greedy(pd.endpoint, pd, PROMPTS))
        p, d = transfer_counts(metrics(pd.prefill_url)), transfer_counts(metrics(pd.decode_url))
    copier = p if mode == "write" else d
    ok = result.ok and copier[f"attached_{expect}"] >= 1 and copier["attached_" + ("nixl" if expect == "shm" else "shm")] == 0
    return {"ok": ok, "output": result.summary(), "prefill": p, "decode": d}


def two_host(mode: str, transports: dict, reference: list) -> dict:
    with TwoHostPD(mode, transports) as pd:
        result = compare_greedy(reference, pd.greedy(PROMPTS))
        p, d = transfer_counts(pd.metrics("prefill")), transfer_counts(pd.metrics("decode"))
        hosts = pd.hosts
    copier = p if mode == "write" else d
    ok = result.ok and copier["attached_nixl"] >= 1 and copier["attached_shm"] == 0 and not hosts.leftovers()
    return {"ok": ok, "output": result.summary(), "prefill": p, "decode": d, "leftovers": hosts.leftovers()}


def two_host_p_killed(reference: list) -> dict:
    long_prompts = [p for p in PROMPTS if len(p) > 1000] * 4
    with TwoHostPD("read") as pd:
        outcome: dict = {}

        def burst():
            started = time.monotonic()
            try:
                outcome["outputs"] = len(pd.greedy(long_prompts, concurrency=8))
            except LaunchError as exc:
                outcome["error"] = str(exc)[-300:]
            outcome["seconds"] = round(time.monotonic() - started, 1)

        thread = threading.Thread(target=burst)
        thread.start()
        time.sleep(4.0)
        pd.hosts.stop(pd.processes["prefill"], signal.SIGKILL)
        thread.join(300)
        d = transfer_counts(pd.metrics("decode"))
        # D alone still answers, from its own prefill (the router cannot reach P any more)
        alone = compare_greedy(reference[:4], pd.greedy(PROMPTS[:4], url=pd.url("decode")))
        hosts = pd.hosts
    ok = not thread.is_alive() and outcome.get("seconds", 999) < 120 and alone.ok and not hosts.leftovers()
    return {"ok": ok, "burst": outcome, "decode": d, "decode_alone": alone.summary(), "leftovers": hosts.leftovers()}


def two_host_mismatch(reference: list) -> dict:
    """D with another KV block size: the handshake is refused, D recomputes every prompt itself."""
    with TwoHostPD("write", vllm_args={"decode": ("--block-size", "64")}) as pd:
        result = compare_greedy(reference, pd.greedy(PROMPTS))
        d = pd.metrics("decode")
        counts = {**transfer_counts(d), "recomputed": metric(d, "pdserve:kv_recomputed_total")}
        hosts = pd.hosts
    ok = result.ok and counts["completed"] == 0 and not hosts.leftovers()
    return {"ok": ok, "output": result.summary(), "decode": counts, "leftovers": hosts.leftovers()}


def two_host_d_killed(reference: list) -> dict:
    """D SIGKILLed during a WRITE-mode burst: P's held blocks are freed within defer_timeout."""
    long_prompts = [p for p in PROMPTS if len(p) > 1000] * 4
    with TwoHostPD("write") as pd:
        outcome: dict = {}

        def burst():
            try:
                outcome["outputs"] = len(pd.greedy(long_prompts, concurrency=8))
            except LaunchError as exc:
                outcome["error"] = str(exc)[-300:]

        thread = threading.Thread(target=burst)
        thread.start()
        time.sleep(4.0)
        pd.hosts.stop(pd.processes["decode"], signal.SIGKILL)
        killed = time.monotonic()
        thread.join(300)
        usage = 1.0
        while time.monotonic() - killed < 90:
            samples = pd.metrics("prefill")
            usage = metric(samples, "vllm:kv_cache_usage_perc") + metric(samples, "vllm:num_requests_running")
            if usage == 0:
                break
            time.sleep(2)
        freed_after = round(time.monotonic() - killed, 1)
        p = transfer_counts(pd.metrics("prefill"))
        hosts = pd.hosts
    ok = not thread.is_alive() and usage == 0 and not hosts.leftovers()
    return {"ok": ok, "burst": outcome, "prefill": p, "p_idle_after_s": freed_after, "leftovers": hosts.leftovers()}


CELLS = {
    "same-host-auto-write": lambda ref: same_host("write", "auto", "shm", ref),
    "same-host-nixl-read": lambda ref: same_host("read", "nixl", "nixl", ref),
    "two-host-auto-read": lambda ref: two_host("read", {}, ref),
    "two-host-nixl-write": lambda ref: two_host("write", {"decode": "nixl"}, ref),
    "two-host-p-killed": two_host_p_killed,
    "two-host-d-killed": two_host_d_killed,
    "two-host-mismatch": two_host_mismatch,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "nixl" / "check.jsonl")
    args = parser.parse_args()
    with pd_cluster("collocated", REFERENCE_PORT) as cluster:
        reference = greedy(cluster.endpoint, cluster, PROMPTS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.cells.split(","):
        started = time.monotonic()
        try:
            row = CELLS[name](reference)
        except Exception as exc:  # noqa: BLE001 - one cell's crash is that cell's result
            row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-1000:]}
        row = {"cell": name, **row, "seconds": round(time.monotonic() - started, 1)}
        failed += not row["ok"]
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"{len(args.cells.split(',')) - failed} of {len(args.cells.split(','))} cells ok")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
