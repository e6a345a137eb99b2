"""The full xPyD matrix on real vLLM (tiny model, prefix caching on): WRITE and READ mode, each
with 2 prefill + 1 decode and 1 prefill + 2 decode behind vllm-router. Every cell runs the
checks of tests/integration/test_xpyd.py (which runs two of the four cells in CI): the connector
correctness check (40 prompts vs collocated, every instance took part), 40 prompts sharing a
1,000-token prefix and 40 three-turn chat conversations (agree with collocated serving; D
received only the blocks it lacked). Prints one line per check; after each cell it updates
benchmarks/xpyd/results.json (cells run again replace their earlier result, the others stay)
and results.md.

    .venv/bin/python scripts/xpyd_check.py [--cells write-2p1d read-1p2d ...] [--port 29400]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.pd_helpers import prompts  # noqa: E402
from tests.integration.xpyd_helpers import (  # noqa: E402
    check_correctness,
    check_multi_turn,
    check_shared_prefix,
    conversations,
    references,
    shared_prefix_prompts,
    xpyd_cluster,
)
from tests.reference_cache import ReferenceCache  # noqa: E402

CELLS = {f"{mode}-{n}p{m}d": (mode, n, m) for mode in ("write", "read") for n, m in ((2, 1), (1, 2))}
OUT = ROOT / "benchmarks" / "xpyd"


def run_cell(name: str, port: int, refs: dict, batches: dict) -> dict:
    mode, num_prefill, num_decode = CELLS[name]
    cell = {"cell": name, "mode": mode, "num_prefill": num_prefill, "num_decode": num_decode, "checks": {}}
    started = time.monotonic()
    try:
        with xpyd_cluster(mode, port, num_prefill, num_decode) as cluster:
            cell["startup_s"] = round(time.monotonic() - started, 1)
            for check, run in (("correctness", lambda: check_correctness(cluster, refs["pd40"], batches["pd40"])),
                               ("shared_prefix", lambda: check_shared_prefix(cluster, refs["shared1000"],
                                                                             batches["shared1000"])),
                               ("multi_turn", lambda: check_multi_turn(cluster, refs["chat40x3"], batches["chat40x3"]))):
                check_start = time.monotonic()
                try:
                    result = {"ok": True, **run()}
                except AssertionError as exc:
                    result = {"ok": False, "error": str(exc)[:2000]}
                result["seconds"] = round(time.monotonic() - check_start, 1)
                cell["checks"][check] = result
                print(f"{name} {check}: {'PASS' if result['ok'] else 'FAIL'} ({result['seconds']} s) "
                      f"{result.get('summary') or result.get('error')}", flush=True)
    except Exception as exc:  # a cell that cannot start or stop cleanly is a failed cell, the others still run
        cell["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    cell["ok"] = "error" not in cell and len(cell["checks"]) == 3 and all(c["ok"] for c in cell["checks"].values())
    cell["seconds"] = round(time.monotonic() - started, 1)
    return cell


def write_markdown(results: list[dict], path: Path) -> None:
    lines = ["| cell | correctness | shared prefix | multi-turn | D hit tokens (prefix / chat) | "
             "bytes to D: moved / full transfer (prefix) | (chat) | wall s |", "|---|---|---|---|---|---|---|---|"]
    for cell in results:
        checks = cell["checks"]

        def state(key: str) -> str:
            return "pass" if checks.get(key, {}).get("ok") else "FAIL"  # noqa: B023  called in this iteration

        def ratio(key: str) -> str:
            c = checks.get(key, {})  # noqa: B023  called in this iteration
            if "bytes_received" not in c:
                return "-"
            return f"{c['bytes_received'] / 2**20:.1f} / {c['bytes_full_transfer'] / 2**20:.1f} MiB"

        hits = " / ".join(str(int(checks.get(k, {}).get("decode_local_hit_tokens", 0))) for k in ("shared_prefix", "multi_turn"))
        lines.append(f"| {cell['cell']} | {state('correctness')} | {state('shared_prefix')} | {state('multi_turn')} | "
                     f"{hits} | {ratio('shared_prefix')} | {ratio('multi_turn')} | {cell['seconds']} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", choices=sorted(CELLS), default=list(CELLS))
    parser.add_argument("--port", type=int, default=29400, help="base port; each cell uses 20 from its own base")
    args = parser.parse_args()
    batches = {"pd40": prompts(), "shared1000": shared_prefix_prompts(), "chat40x3": conversations()}
    started = time.monotonic()
    cache = ReferenceCache()  # the reference deployment is stopped before the cells start
    try:
        refs = references(cache, batches, args.port + 20 * len(CELLS))
    finally:
        cache.close()
    print(f"collocated reference: {time.monotonic() - started:.0f} s", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "results.json"
    saved = {c["cell"]: c for c in json.loads(path.read_text())} if path.exists() else {}
    results = []
    for i, name in enumerate(args.cells):
        results.append(run_cell(name, args.port + 20 * i, refs, batches))
        saved[name] = results[-1]
        ordered = [saved[c] for c in CELLS if c in saved]
        path.write_text(json.dumps(ordered, indent=1, default=float) + "\n")
        write_markdown(ordered, OUT / "results.md")
    passed = sum(c["ok"] for c in results)
    print(f"xpyd matrix: {passed}/{len(results)} cells pass in {time.monotonic() - started:.0f} s")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
