"""The model × layout × mode correctness matrix on real vLLM (tests/integration/matrix_helpers.py):
architectures {llama, sliding-window, hybrid, mamba2, mla} × layouts {1p1d, P TP2 -> D TP1,
P TP1 -> D TP2, P TP2 -> D TP2, 2p1d} × {write, read}, 40 prompts each through vllm-router, every answer compared with collocated
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.matrix_helpers import (  # noqa: E402
    ARCHS,
    LAYOUTS,
    MODES,
    decode_tp,
    matrix_prompts,
    reference,
    run_cell,
)

OUT = ROOT / "benchmarks" / "model-matrix"


HEADER = """# Model x layout x mode matrix (real vLLM, through vllm-router)

`scripts/model_matrix.py`: each cell deploys P and D of one architecture's tiny model in one layout
(prefix caching on, except where vLLM's CPU backend needs it off: Mamba-2, and MLA, whose CPU backend
turns it off itself), sends 40 prompts (1 to 2,000 tokens: shorter than a block, on block edges,
past the 128-token window) and compares every answer with collocated serving at D's
tensor-parallel size under the comparison rule (pdserve/compare.py): 16 greedy tokens, 4 requests
at a time. KV bytes to D: what D's ranks received, beside what moving every block of every
layer would (to each of D's ranks that holds it: where D has more ranks than KV heads, as MLA's one
latent at D TP 2, every rank holds a whole copy), and, in brackets, the most that moving only each sliding-window layer's window
(cdiv(window, block) + 1 blocks) allows; for a model with mamba/linear-attention state, a full
transfer is every attention block of the prompt and each state layer's state once, of which P
computes (and D takes) the prompt up to a 64-token chunk edge that leaves D two tokens or more
(docs/architecture.md). Transfers count sub-transfers (one per rank pair). A configuration
PDConnector refuses at startup is recorded with its refusal; a pair it refuses at the handshake
too, and as D then computes those prompts itself, its answers are still compared. Last run (of
the cells last run): {date}, {cpu}, 2 cores (P and D a core each; ranks of one role share it).
"""


def write_markdown(results: list[dict], path: Path) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    lines = [HEADER.format(date=time.strftime("%Y-%m-%d"), cpu=cpu),
             "| architecture | layout | mode | result | KV bytes to D: moved / full transfer (window bound) | "
             "transfers (failed, recomputed) |", "|---|---|---|---|---|---|"]
    for cell in results:
        if "bytes_moved" in cell:
            result = ("pass: " if cell["ok"] else "FAIL: ") + cell["summary"]
            if cell.get("refused"):  # at the handshake: D computed every prompt itself
                result = f"refused at handshake: {cell['error']}; D recomputed, answers {result}"
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
        refs = {}  # D's tensor-parallel size -> collocated serving's answers at that size
        for layout in args.layouts:
            tp = decode_tp(layout)
            if tp not in refs:
                refs[tp] = reference(arch, prompts, args.port, tp)
            for mode in args.modes:
                cell = run_cell(arch, layout, mode, args.port + 20, prompts, refs[tp])
                failed += not cell["ok"] and not (cell.get("refused") and "bytes_moved" not in cell)
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
