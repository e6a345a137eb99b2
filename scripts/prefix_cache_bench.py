"""Prefix caching through PD, measured: `pdserve up --mode write|read` with and without prefix
caching, `vllm bench serve` on its prefix_repetition dataset (a few long prefixes, each shared
by many prompts), and per configuration the KV bytes moved per request (PDConnector's counters
on the decode instances) and TTFT mean/p50/p90 (vllm bench serve's). Same seed, prompts and
request schedule in every configuration; each run starts a fresh deployment.
Writes benchmarks/prefix-cache/results.json and results.md.

    .venv/bin/python scripts/prefix_cache_bench.py [--modes write read] [--num-prompts 64] [--port 29600]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.model.build import resolve_model  # noqa: E402
from tests.integration.pd_helpers import metric, metrics  # noqa: E402

OUT = ROOT / "benchmarks" / "prefix-cache"
VENV_BIN = Path(sys.executable).parent
INSTANCE_LINE = re.compile(r"^\s+instance (\S+): (http://\S+) \((prefill|decode|both),")
COUNTERS = {
    "bytes": ("pdserve:kv_transfer_bytes_total", {}),
    "transfers": ("pdserve:kv_transfers_completed_total", {}),
    "failed": ("pdserve:kv_transfers_failed_total", {}),
    "local_hit": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "external": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "computed": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
}


class Up:
    """`pdserve up` as a user runs it (foreground, SIGTERM to stop), with its printed instances."""

    def __init__(self, mode: str, port: int, prefix_caching: bool, log: Path, shape: tuple[int, int]):
        self.ready = log.with_suffix(".ready")
        argv = [sys.executable, "-m", "pdserve.cli", "up", "--mode", mode, "--port", str(port), "--enforce-eager",
                "--prefill", str(shape[0]), "--decode", str(shape[1]), "--restart", "never",
                "--ready-file", str(self.ready)]
        if not prefix_caching:
            argv.append("--no-prefix-caching")
        self.log = log
        self.process = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                        start_new_session=True)
        self.endpoint = ""
        self.instances: dict[str, tuple[str, str]] = {}  # name -> (url, role)

    def wait(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not come up: {self.log.read_text()[-2000:]}")
            time.sleep(1)
        self.endpoint = self.ready.read_text().strip()
        while not self.instances or "Ctrl-C" not in self.log.read_text():
            time.sleep(0.2)
            self.instances = {m[1]: (m[2], m[3]) for m in map(INSTANCE_LINE.match, self.log.read_text().splitlines()) if m}
        body = {"model": self.model, "prompt": [11, 12, 13], "max_tokens": 1}
        while requests.post(f"{self.endpoint}/v1/completions", json=body, timeout=60).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the router never routed a request")
            time.sleep(0.5)

    @property
    def model(self) -> str:
        return requests.get(f"{self.endpoint}/v1/models", timeout=30).json()["data"][0]["id"]

    def urls(self, role: str) -> list[str]:
        return [url for url, r in self.instances.values() if r == role]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


def counters(urls: list[str]) -> dict[str, float]:
    total = dict.fromkeys(COUNTERS, 0.0)
    for url in urls:
        samples = metrics(url)
        for key, (name, labels) in COUNTERS.items():
            total[key] += metric(samples, name, **labels)
    return total


def bench(endpoint: str, model: str, args: argparse.Namespace, result_dir: Path) -> dict:
    argv = [str(VENV_BIN / "vllm"), "bench", "serve", "--base-url", endpoint, "--model", model,
            "--tokenizer", str(resolve_model("tiny")), "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes), "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
            "--ignore-eos", "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,e2el",
            "--metric-percentiles", "50,90", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", "bench.json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {done.stdout[-1500:]} {done.stderr[-1500:]}")
    return json.loads((result_dir / "bench.json").read_text())


def run(mode: str, prefix_caching: bool, port: int, args: argparse.Namespace, tmp: Path) -> dict:
    label = f"{mode} prefix-caching {'on' if prefix_caching else 'off'}"
    up = Up(mode, port, prefix_caching, tmp / f"{mode}-{prefix_caching}.log", (args.prefill, args.decode))
    try:
        up.wait()
        decode, prefill = up.urls("decode"), up.urls("prefill")
        before_d, before_p = counters(decode), counters(prefill)
        result = bench(up.endpoint, up.model, args, tmp)
        after_d, after_p = counters(decode), counters(prefill)
    finally:
        up.stop()
    moved_d = {k: after_d[k] - before_d[k] for k in after_d}
    moved_p = {k: after_p[k] - before_p[k] for k in after_p}
    completed = result["completed"]
    row = {
        "config": label, "mode": mode, "prefix_caching": prefix_caching, "completed": completed,
        "failed_requests": result.get("failed", 0), "transfers": moved_d["transfers"], "failed_transfers": moved_d["failed"],
        "bytes_per_request": moved_d["bytes"] / max(1, completed),
        "decode_hit_fraction": moved_d["local_hit"] / max(1.0, moved_d["local_hit"] + moved_d["external"] + moved_d["computed"]),
        "prefill_hit_fraction": moved_p["local_hit"] / max(1.0, moved_p["local_hit"] + moved_p["computed"]),
        **{k: result[k] for k in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "mean_tpot_ms",
                                  "request_throughput", "duration")},
        "decode_counters": moved_d, "prefill_counters": moved_p,
    }
    print(f"{label}: {completed} requests, {row['bytes_per_request'] / 2**10:.0f} KiB moved per request, "
          f"D hit {row['decode_hit_fraction']:.0%} / P hit {row['prefill_hit_fraction']:.0%} of prompt tokens, "
          f"TTFT mean {row['mean_ttft_ms']:.0f} ms, p50 {row['median_ttft_ms']:.0f} ms, p90 {row['p90_ttft_ms']:.0f} ms",
          flush=True)
    return row


def write_markdown(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    lines = [f"prefix_repetition: {args.num_prefixes} prefixes of {args.prefix_len} tokens, suffix {args.suffix_len}, "
             f"output {args.output_len}, {args.num_prompts} prompts, concurrency {args.concurrency}, "
             f"{args.prefill}P+{args.decode}D, tiny model, seed 0", "",
             "| mode | prefix caching | KiB moved / request | D hit | P hit | TTFT mean ms | p50 | p90 | TPOT mean ms | req/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {'on' if r['prefix_caching'] else 'off'} | {r['bytes_per_request'] / 2**10:.0f} | "
                     f"{r['decode_hit_fraction']:.0%} | {r['prefill_hit_fraction']:.0%} | {r['mean_ttft_ms']:.0f} | "
                     f"{r['median_ttft_ms']:.0f} | {r['p90_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | "
                     f"{r['request_throughput']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=("write", "read"), default=["write", "read"])
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--suffix-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-prefix-bench-") as tmp:
        for mode in args.modes:
            for prefix_caching in (True, False):
                rows.append(run(mode, prefix_caching, args.port, args, Path(tmp)))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1) + "\n")
    write_markdown(rows, args, OUT / "results.md")
    return 0 if all(r["failed_transfers"] == 0 and r["failed_requests"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
