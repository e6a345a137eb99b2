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
  two-host-agent-dies    two hosts, WRITE: P (its NIXL agent with it) kills itself after submitting
                         layer 1 of a write: requests end within the deadlines, 200s correct, D holds nothing
  two-host-client-disconnect  two hosts, WRITE: 16 clients give up 0.5 s in; P and D return to idle
Writes one JSON line per cell to benchmarks/nixl/check.jsonl (or --out) and prints a summary.
Run as root, under the machine's vLLM slot: python scripts/nixl_check.py [--cells a,b]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.hosts.two_host import TIMEOUTS, TwoHostPD, metric  # noqa: E402
from pdserve.compare import compare_greedy  # noqa: E402
from pdserve.errors import LaunchError  # noqa: E402
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


def _wait_idle(pd: TwoHostPD, role: str, seconds: float) -> float | None:
    """Seconds until `role`'s instance holds no KV and no request; None if not within `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        samples = pd.metrics(role)
        busy = metric(samples, "vllm:num_requests_running") + metric(samples, "vllm:num_requests_waiting")
        if metric(samples, "vllm:kv_cache_usage_perc") == 0 and busy == 0:
            return round(time.monotonic() - started, 1)
        time.sleep(1.0)
    return None


LONG = [i for i, p in enumerate(PROMPTS) if len(p) > 1000]


def _checked(rows: list[dict], indices: list[int], reference: list) -> dict:
    """Outcomes by status; every 200 compared with the collocated reference of its prompt."""
    served = [(reference[i], row["steps"]) for i, row in zip(indices, rows) if row["status"] == 200]
    result = compare_greedy([r for r, _ in served], [s for _, s in served]) if served else None
    statuses: dict = {}
    for row in rows:
        statuses[str(row["status"])] = statuses.get(str(row["status"]), 0) + 1
    return {"statuses": statuses, "served_ok": result.ok if result else True,
            "served": result.summary() if result else "none", "longest_s": max(r["seconds"] for r in rows)}


def two_host_agent_dies(reference: list) -> dict:
    """WRITE across the hosts: P's instance, and its NIXL agent with it, SIGKILLs itself right after it
    submitted layer 1 of a request's NIXL writes into D (layers 2.. never come; whether layer 1's bytes
    are still on the wire at that instant is not controlled). Every request ends within the deadlines
    (a 200 only with correct tokens), D holds nothing afterwards and serves alone, nothing is left."""
    indices = LONG[:8]
    with tempfile.TemporaryDirectory(prefix="pdserve-nixl-faults-") as tmp:
        plan = Path(tmp) / "faults.json"
        plan.write_text(json.dumps({"rules": []}))
        with TwoHostPD("write", connector_extra={**TIMEOUTS, "test_fault_plan": str(plan)}) as pd:
            warm = compare_greedy(reference[:4], pd.greedy(PROMPTS[:4]))
            plan.write_text(json.dumps({"generation": 1, "rules": [
                {"action": "kill", "at": "after_layer:1", "role": "P", "count": 1}]}))
            time.sleep(1.0)  # the instances re-read the plan every 0.2 s
            rows = pd.outcomes([PROMPTS[i] for i in indices], timeout=TIMEOUTS["transfer_timeout"] + 60)
            plan.write_text(json.dumps({"generation": 2, "rules": []}))  # a restarted P must not kill itself again
            outcome = _checked(rows, indices, reference)
            d_idle = _wait_idle(pd, "decode", TIMEOUTS["transfer_timeout"] + 30)
            d = pd.metrics("decode")
            counts = {**transfer_counts(d), "recomputed": metric(d, "pdserve:kv_recomputed_total")}
            alone = compare_greedy(reference[:4], pd.greedy(PROMPTS[:4], url=pd.url("decode")))
            hosts = pd.hosts
    hit = counts["failed"] + counts["recomputed"] >= 1
    ok = (warm.ok and outcome["served_ok"] and outcome["longest_s"] < TIMEOUTS["transfer_timeout"] + 30
          and d_idle is not None and hit and alone.ok and not hosts.leftovers())
    return {"ok": ok, "burst": outcome, "decode": counts, "d_idle_after_s": d_idle, "fault_hit_a_transfer": hit,
            "decode_alone": alone.summary(), "leftovers": hosts.leftovers()}


def two_host_client_disconnect(reference: list) -> dict:
    """WRITE across the hosts: 16 clients give up 0.5 s into long prompts (they close their
    connections mid-prefill or mid-transfer): P and D both return to holding nothing within the
    deadlines, and then serve 8 prompts correctly."""
    indices = (LONG * 2)[:16]
    with TwoHostPD("write") as pd:
        rows = pd.outcomes([PROMPTS[i] for i in indices], timeout=0.5)
        outcome = _checked(rows, indices, reference)
        idle = {role: _wait_idle(pd, role, TIMEOUTS["defer_timeout"] + 30) for role in ("prefill", "decode")}
        after = compare_greedy(reference[:8], pd.greedy(PROMPTS[:8]))
        p, d = transfer_counts(pd.metrics("prefill")), transfer_counts(pd.metrics("decode"))
        hosts = pd.hosts
    gave_up = outcome["statuses"].get("timeout", 0)
    ok = (gave_up >= 1 and outcome["served_ok"] and None not in idle.values() and after.ok
          and p["attached_nixl"] >= 1 and not hosts.leftovers())
    return {"ok": ok, "burst": outcome, "clients_gave_up": gave_up, "idle_after_s": idle, "after": after.summary(),
            "prefill": p, "decode": d, "leftovers": hosts.leftovers()}


CELLS = {
    "same-host-auto-write": lambda ref: same_host("write", "auto", "shm", ref),
    "same-host-nixl-read": lambda ref: same_host("read", "nixl", "nixl", ref),
    "two-host-auto-read": lambda ref: two_host("read", {}, ref),
    "two-host-nixl-write": lambda ref: two_host("write", {"decode": "nixl"}, ref),
    "two-host-p-killed": two_host_p_killed,
    "two-host-d-killed": two_host_d_killed,
    "two-host-mismatch": two_host_mismatch,
    "two-host-agent-dies": two_host_agent_dies,
    "two-host-client-disconnect": two_host_client_disconnect,
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
