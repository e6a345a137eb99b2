"""The model × layout × mode correctness matrix on real vLLM (tests/integration/matrix_helpers.py):
architectures {llama, sliding-window, hybrid, mla} × layouts {1p1d, P TP2 -> D TP1, P TP1 -> D TP2,
2p1d} × {write, read}, 40 prompts each through vllm-router, every answer compared with collocated
serving of the same model, the KV bytes D received beside a full transfer's. After each cell it
updates benchmarks/model-matrix/results.json (cells run again replace their earlier result) and
results.md. A configuration PDConnector refuses at startup is recorded with its refusal.

    .venv/bin/python scripts/model_matrix.py [--archs llama sliding-window] [--layouts 1p1d ...]
        [--modes write read] [--port 28400]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.matrix_helpers import ARCHS, LAYOUTS, MODES, matrix_prompts, reference, run_cell  # noqa: E402

OUT = ROOT / "benchmarks" / "model-matrix"


def write_markdown(results: list[dict], path: Path) -> None:
    lines = ["| architecture | layout | mode | result | KV bytes to D: moved / full transfer (window bound) | "
             "transfers (failed, recomputed) |", "|---|---|---|---|---|---|"]
    for cell in results:
        if "bytes_moved" in cell:
            result = ("pass: " if cell["ok"] else "FAIL: ") + cell["summary"]
            moved = (f"{cell['bytes_moved'] / 2**20:.1f} / {cell['bytes_full'] / 2**20:.1f} MiB "
                     f"({cell['bytes_window_bound'] / 2**20:.1f})")
            transfers = f"{cell['transfers']} ({cell['transfers_failed']}, {cell['recomputed']})"
        else:
            result = ("refused at startup: " if cell.get("refused") else "ERROR: ") + cell["error"]
            moved = transfers = "-"
        lines.append(f"| {cell['arch']} | {cell['layout']} | {cell['mode']} | {result} | {moved} | {transfers} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--port", type=int, default=28400)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results_path = OUT / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    prompts = matrix_prompts()
    failed = 0
    for arch in args.archs:
        refs = reference(arch, prompts, args.port)
        for layout in args.layouts:
            for mode in args.modes:
                cell = run_cell(arch, layout, mode, args.port + 20, prompts, refs)
                failed += not cell["ok"] and not cell.get("refused")
                print(json.dumps(cell), flush=True)
                key = (arch, layout, mode)
                results = [c for c in results if (c["arch"], c["layout"], c["mode"]) != key] + [cell]
                results.sort(key=lambda c: (list(ARCHS).index(c["arch"]), list(LAYOUTS).index(c["layout"]),
                                            MODES.index(c["mode"])))
                results_path.write_text(json.dumps(results, indent=1) + "\n")
                write_markdown(results, OUT / "results.md")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
