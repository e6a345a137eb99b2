"""Transfer time, bandwidth and TTFT added by PD for each transport, beside a memcpy, in one run.

Configurations (one brought up at a time, P on core 0, D on core 1, vllm-router in front):
  shm            one host, transport shm
  nixl-local     one host, transport nixl (UCX picks CMA between the two processes)
  nixl-two-host  P and router on host a, D on host b (network + PID namespaces, pdserve/bench/hosts/two_host.py),
                 transport auto, which must pick NIXL (UCX over TCP on the veth pair)
For each: a warm-up, then N requests of fresh random 2,000-token prompts, one at a time, each with a
plain twin sent straight to P (bench_pd_transfer.py's method): PD TTFT vs plain TTFT, P's prefill
time, the bytes this side's transport copied and for how long (kv_copy_* counters). The TTFT added
by PD is the paired PD - plain TTFT. The memcpy baseline copies one request's KV bytes in this
process, scattered by KV block and contiguous.

    python scripts/bench_transports.py [--requests 8] [--modes write] [--configs shm,nixl-local,nixl-two-host]

Needs root for nixl-two-host. Writes a JSON line per configuration to --out as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_pd_transfer import (  # noqa: E402
    COPY_SIDE,
    SETTLE_TIMEOUT,
    Prompts,
    Sample,
    block_bytes,
    block_size,
    delta,
    mean_prefill,
    memcpy_gbs,
    ratio,
    scrape,
    settled,
    spread,
    stream_ttft,
    wait_routable,
)

CONFIGS = ("shm", "nixl-local", "nixl-two-host")
PORT = 30300


def measure(mode: str, router: str, p_url: str, d_url: str, prompts: Prompts, num_requests: int,
            max_tokens: int) -> tuple[list[Sample], int]:
    """bench_pd_transfer's per-request loop against a running deployment."""
    model = requests.get(f"{p_url}/v1/models", timeout=30).json()["data"][0]["id"]
    kv_block_size = block_size(p_url)
    wait_routable(router, model, prompts, max_tokens)
    stream_ttft(p_url, model, prompts.next(), max_tokens)
    copier = p_url if COPY_SIDE[mode] == "prefill" else d_url
    samples = []
    for _ in range(num_requests):
        time.sleep(0.5)
        p0, d0 = scrape(p_url), scrape(d_url)
        pd_ttft = stream_ttft(router, model, prompts.next(), max_tokens)
        deadline = time.monotonic() + SETTLE_TIMEOUT
        settled(copier, p0 if copier == p_url else d0, "copy_bytes", deadline)
        p1 = settled(p_url, p0, "prefill_count", deadline)
        d1 = settled(d_url, d0, "completed", deadline)
        p1 = settled(p_url, p0, "completed", deadline) if p1["completed"] <= p0["completed"] else p1
        p, d = delta(p1, p0), delta(d1, d0)
        plain = stream_ttft(p_url, model, prompts.next(), max_tokens)
        p2 = settled(p_url, p1, "prefill_count", time.monotonic() + SETTLE_TIMEOUT)
        samples.append(Sample(pd_ttft, plain, mean_prefill(p), mean_prefill(delta(p2, p1)), p, d))
    return samples, kv_block_size


def same_host(config: str, mode: str, args, prompts: Prompts) -> tuple[list[Sample], int]:
    from pdserve.launch import Cluster, UpOptions
    from pdserve.launch.pd_modes import pd_deployment

    options = UpOptions(mode=mode, model=str(args.model_dir), port=PORT, enforce_eager=args.enforce_eager)
    transport = "shm" if config == "shm" else "nixl"
    cluster = Cluster(pd_deployment(options, mode, connector_extra={"transport": transport}))
    cluster.start()
    try:
        cluster.wait_healthy(600)
        urls = cluster.instance_urls
        return measure(mode, cluster.endpoint, urls["prefill"], urls["decode"], prompts, args.requests, args.max_tokens)
    finally:
        cluster.stop()


def two_host(mode: str, args, prompts: Prompts) -> tuple[list[Sample], int]:
    from pdserve.bench.hosts.two_host import TwoHostPD

    with TwoHostPD(mode, model=args.model, enforce_eager=args.enforce_eager) as pd:
        out = pd.client_script(str(Path(__file__).resolve()), "measure", "--mode", mode, "--router", pd.router_url,
                               "--prefill", pd.url("prefill"), "--decode", pd.url("decode"),
                               "--seed", str(args.seed), "--tokens", str(args.tokens),
                               "--vocab", str(prompts.vocab_size), "--requests", str(args.requests),
                               "--max-tokens", str(args.max_tokens))
    rows = json.loads(out)
    return [Sample(**row) for row in rows["samples"]], rows["block_size"]


def summary(config: str, mode: str, samples: list[Sample], chunk: int, seed: int) -> dict:
    copies = [s.p if COPY_SIDE[mode] == "prefill" else s.d for s in samples]
    gbs = [ratio(c["copy_bytes"], c["copy_seconds"]) / 1e9 for c in copies if c["copy_seconds"]]
    per_request = statistics.median([c["copy_bytes"] for c in copies]) if copies else 0
    scattered, contiguous = memcpy_gbs(int(per_request), chunk, seed) if per_request else (float("nan"),) * 2
    added = [s.pd_ttft - s.plain_ttft for s in samples]
    prefill = statistics.median([s.plain_prefill for s in samples if s.plain_prefill == s.plain_prefill] or [float("nan")])
    row = {"config": config, "mode": mode, "n": len(samples), "mb_per_request": round(per_request / 1e6, 2),
           "copy_ms": round(statistics.median([c["copy_seconds"] for c in copies if c["copy_bytes"]] or [float("nan")]) * 1e3, 2),
           "copy_gbs": round(statistics.median(gbs), 2) if gbs else None,
           "memcpy_scattered_gbs": round(scattered, 2), "memcpy_contiguous_gbs": round(contiguous, 2),
           "pd_ttft_ms": round(statistics.median([s.pd_ttft for s in samples]) * 1e3, 1),
           "plain_ttft_ms": round(statistics.median([s.plain_ttft for s in samples]) * 1e3, 1),
           "ttft_added_ms": round(statistics.median(added) * 1e3, 1),
           "p_prefill_ms": round(prefill * 1e3, 1),
           "failed": sum(s.p["failed"] + s.d["failed"] for s in samples)}
    row["ttft_added_pct_of_prefill"] = round(100 * row["ttft_added_ms"] / row["p_prefill_ms"], 1) if prefill else None
    line = (f"SUMMARY {config:13s} {mode:5s} n={row['n']}: {row['mb_per_request']} MB/req copied in "
            f"{spread([c['copy_seconds'] for c in copies if c['copy_bytes']], 1e3, '.2f')} ms = {spread(gbs, 1, '.2f')} GB/s "
            f"(memcpy scattered {scattered:.2f}, contiguous {contiguous:.2f} GB/s) | PD TTFT "
            f"{spread([s.pd_ttft for s in samples], 1e3, '.0f')} ms vs plain {spread([s.plain_ttft for s in samples], 1e3, '.0f')} ms: "
            f"added {spread(added, 1e3, '+.0f')} ms = {row['ttft_added_pct_of_prefill']}% of P's prefill "
            f"({row['p_prefill_ms']:.0f} ms) | failed {row['failed']:.0f}")
    print(line, flush=True)
    return row


def _measure_command(args) -> int:
    prompts = Prompts(args.seed, args.tokens, args.vocab)
    samples, size = measure(args.mode, args.router, args.prefill, args.decode, prompts, args.requests, args.max_tokens)
    json.dump({"samples": [s.__dict__ for s in samples], "block_size": size}, sys.stdout)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command")
    inner = sub.add_parser("measure", help="(inside a namespace) measure a running deployment")
    for name in ("--mode", "--router", "--prefill", "--decode"):
        inner.add_argument(name, required=True)
    inner.add_argument("--seed", type=int, default=0)
    inner.add_argument("--tokens", type=int, default=2000)
    inner.add_argument("--vocab", type=int, required=True)
    inner.add_argument("--requests", type=int, default=8)
    inner.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="small")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["write"], choices=["write", "read"])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "nixl" / "bench_transports.jsonl")
    args = parser.parse_args()
    if args.command == "measure":
        return _measure_command(args)
    from pdserve.model.build import resolve_model

    args.model_dir = resolve_model(args.model)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    print(f"bench_transports {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: model {args.model}, {args.tokens}-token "
          f"prompts, {args.requests} requests per configuration, {'eager' if args.enforce_eager else 'compiled'}", flush=True)
    rows = []
    for mode in args.modes:
        for index, config in enumerate(args.configs.split(",")):
            prompts = Prompts(args.seed + index, args.tokens, vocab)
            if config == "nixl-two-host":
                samples, size = two_host(mode, args, prompts)
            else:
                samples, size = same_host(config, mode, args, prompts)
            rows.append(summary(config, mode, samples, block_bytes(args.model_dir, size), args.seed))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
