"""The full fault matrix on real vLLM (tiny model): every cell of pdserve.faults.matrix in WRITE
and READ mode, plus preemption on P and D (a KV cache small enough to force it). Prints one line
per cell and writes benchmarks/fault-matrix/results.json and README.md.

    .venv/bin/python scripts/fault_matrix.py [--modes write read] [--cells "drop read_ack" ...]

With --prefill-tp 2 it runs the cells that kill or restart an instance, plus one that kills a
single rank of P, with P at tensor-parallel size 2 and D at 1 (results in
benchmarks/fault-matrix/p-tp2-d-tp1/ unless --out says otherwise):

    .venv/bin/python scripts/fault_matrix.py --prefill-tp 2 --no-preemption
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.compare import fetch_greedy  # noqa: E402
from pdserve.faults.matrix import (  # noqa: E402
    MAX_TOKENS,
    TIMEOUTS,
    Cell,
    Matrix,
    as_dict,
    cells,
    restart_and_kill_cells,
)
from pdserve.launch import Cluster, UpOptions, plan  # noqa: E402
from pdserve.launch.modes import with_front  # noqa: E402
from pdserve.launch.pd_modes import pd_deployment  # noqa: E402
from pdserve.model.build import resolve_model  # noqa: E402

PORTS = {"write": 29100, "read": 29200, "collocated": 29300}
PREEMPT_KV_BYTES = 16 << 20  # tiny model: ~8k tokens per instance; the long burst below needs ~24k at once


def prompts(lengths=(1, 127, 129, 300, 700, 1025, 1500, 1800), seed: int = 5) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in lengths]


LONG = (1500, 1600, 1700, 1800, 1400, 1300, 1650, 1550)  # 8 at once, 300 tokens each: ~15k tokens > the small cache
PREEMPT_TOKENS = 300


def options(mode: str, kv_cache_bytes: int | None = None, prefill_tp: int = 1) -> UpOptions:
    extra = {"kv_cache_bytes": kv_cache_bytes} if kv_cache_bytes else {}
    if prefill_tp > 1:
        extra["prefill_tp"] = prefill_tp
    return UpOptions(mode=mode, model=str(resolve_model("tiny")), port=PORTS[mode], enforce_eager=True,
                     extra_vllm_args=("--max-num-batched-tokens", "512"), **extra)


def reference(*batches: tuple[list, int]) -> list[list]:
    with Cluster(plan(options("collocated"))) as cluster:
        cluster.wait_healthy(600)
        return [fetch_greedy(cluster.endpoint, batch, max_tokens=tokens, concurrency=4) for batch, tokens in batches]


LOG_DIR: Path | None = None


def run_mode(mode: str, batch, ref, selected: set[str] | None, kv_cache_bytes: int | None = None,
             chosen: list[Cell] | None = None, concurrency: int = 4, prefill_tp: int = 1) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="pdserve-faults-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps({"rules": []}))
        deployment = with_front(pd_deployment(options(mode, kv_cache_bytes, prefill_tp), mode,
                                              connector_extra={**TIMEOUTS, "test_fault_plan": str(plan_path)}), 5.0)
        log_dir = LOG_DIR / f"{mode}-{kv_cache_bytes or 'default'}-ptp{prefill_tp}" if LOG_DIR else None
        with Cluster(deployment, restart="on-failure", log_dir=log_dir) as cluster:
            cluster.wait_healthy(600)
            model = fetch_model(cluster)
            matrix = Matrix(cluster, mode, plan_path, batch, ref, model, concurrency)
            matrix._wait_back("decode")
            matrix.warm_up(matrix.reference_tokens)
            out = []
            for cell in chosen or (restart_and_kill_cells(mode, prefill_tp) if prefill_tp > 1 else cells(mode)):
                if selected and cell.name not in selected:
                    continue
                started = time.monotonic()
                result = as_dict(matrix.run(cell))
                result["prefill_tp"] = prefill_tp
                result["cell_seconds"] = round(time.monotonic() - started, 1)
                print(json.dumps(result), flush=True)
                out.append(result)
            return out


def fetch_model(cluster) -> str:
    import requests

    url = cluster.instance_urls["prefill"]
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", nargs="+", default=["write", "read"])
    parser.add_argument("--cells", nargs="*", default=None)
    parser.add_argument("--prefill-tp", type=int, default=1,
                        help="P's tensor-parallel size (above 1: only the restart and kill cells, and a rank killed)")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/fault-matrix, "
                        "or its p-tp<N>-d-tp1/ with --prefill-tp N)")
    parser.add_argument("--log-dir", default=None, help="keep the instances' logs here")
    parser.add_argument("--no-preemption", action="store_true")
    parser.add_argument("--update", action="store_true",
                        help="replace only the cells run now in an existing results.json")
    args = parser.parse_args()
    global LOG_DIR
    LOG_DIR = Path(args.log_dir) if args.log_dir else None
    batch, long_batch = prompts(), prompts(LONG, seed=6)
    ref, long_ref = reference((batch, MAX_TOKENS), (long_batch, PREEMPT_TOKENS))
    results = []
    for mode in args.modes:
        results += run_mode(mode, batch, ref, set(args.cells) if args.cells else None, prefill_tp=args.prefill_tp)
        if not args.no_preemption:
            results += run_mode(mode, long_batch, long_ref, None, kv_cache_bytes=PREEMPT_KV_BYTES,
                                chosen=[Cell("preemption (small KV cache on P and D)", max_tokens=PREEMPT_TOKENS)],
                                concurrency=8)
    default_out = ROOT / "benchmarks" / "fault-matrix"
    if args.prefill_tp > 1:
        default_out = default_out / f"p-tp{args.prefill_tp}-d-tp1"
    out = Path(args.out) if args.out else default_out
    out.mkdir(parents=True, exist_ok=True)
    if args.update and (out / "results.json").exists():
        fresh = {(r["mode"], r["cell"]): r for r in results}
        old = json.loads((out / "results.json").read_text())
        results = [fresh.pop((r["mode"], r["cell"]), r) for r in old] + list(fresh.values())
    (out / "results.json").write_text(json.dumps(results, indent=1))
    layout = f", P tensor-parallel size {args.prefill_tp}, D 1" if args.prefill_tp > 1 else ""
    lines = [f"# Fault matrix (tiny model{layout}, real vLLM, through the front and vllm-router)", "",
             f"Deadlines: {TIMEOUTS}; load_failure_policy recompute; {len(batch)} requests per cell, 4 at a time "
             "(kill cells: the prompts 30 times over, the instance SIGKILLed 1 s in, the front resending or continuing "
             "its requests on the live instance; preemption cells: 8 long prompts, 300 tokens each, 8 at a time, "
             "16 MiB of KV cache per instance). A cell passes when no 200 carries tokens that differ from collocated "
             "serving, no request fails, every request ends within its deadline + 5 s, both instances return to "
             "idle, and the next requests are correct. Cells are rerun with --update when what they test changes; "
             "the kill cells last ran on 2026-12-06 with the front's fallback, the others on the rebuilt core.", "",
             "| mode | cell | requests | correct 200 | errors | wrong-token 200 | max s | idle after s | next ok | recomputed | fenced | preemptions | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['cell']} | {r['requests']} | {r['correct']} | {len(r['errors'])} | {r['wrong']} | "
                     f"{r['max_seconds']:.1f} | {r['idle_seconds']} | {r['next_ok']} | {r['recomputed']:.0f} | "
                     f"{r['fenced']:.0f} | {r['preemptions']:.0f} | {'yes' if r['passed'] else 'NO'} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    failed = [f"{r['mode']}/{r['cell']}" for r in results if not r["passed"]]
    print(f"{len(results) - len(failed)}/{len(results)} cells passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
