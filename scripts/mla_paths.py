"""Does vLLM's MLA backend on this machine agree with itself? One collocated instance of the
DeepSeek-V2-style tiny model, one request at a time: for each prompt, the second greedy token as
the decode path computes it (attention over the cached latents) beside the same position computed
by the prefill path (the prompt and the first token sent as one prompt). PD serving of MLA can
equal plain serving only where the two agree (connector/support.py says why MLA is refused).

    .venv/bin/python scripts/mla_paths.py [--dtype float32] [--port 28960]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.compare import fetch_greedy  # noqa: E402
from pdserve.launch import Cluster, Deployment, UpOptions  # noqa: E402
from pdserve.launch.modes import plain_instance  # noqa: E402
from pdserve.model.build import resolve_model  # noqa: E402
from tests.integration.matrix_helpers import matrix_prompts  # noqa: E402
from tests.integration.pd_helpers import LOG_DIR  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--port", type=int, default=28960)
    args = parser.parse_args()
    prompts = matrix_prompts()[:12]
    options = UpOptions(mode="write", model=str(resolve_model("deepseek-v2-tiny")), port=args.port,
                        enforce_eager=True, extra_vllm_args=("--dtype", args.dtype))
    deployment = Deployment((plain_instance(options, "vllm", args.port, options.cores, role="decode"),))
    with Cluster(deployment, log_dir=LOG_DIR / f"mla-paths-{args.dtype}") as cluster:
        cluster.wait_healthy(900)
        first = fetch_greedy(cluster.endpoint, prompts, max_tokens=2, concurrency=1)
        again = fetch_greedy(cluster.endpoint, [p + [g[0].token_id] for p, g in zip(prompts, first)],
                             max_tokens=1, concurrency=1)
    diffs = []
    for prompt, decode, prefill in zip(prompts, first, again):
        d, p = decode[1], prefill[0]
        diffs.append(abs(d.logprob - p.logprob))
        print(f"{len(prompt):5d} tokens: decode path {d.token_id} ({d.logprob:.4f}), prefill path {p.token_id} "
              f"({p.logprob:.4f}){'' if d.token_id == p.token_id else '  different token'}")
    parted = sum(d[1].token_id != p[0].token_id for d, p in zip(first, again))
    print(f"{args.dtype}: max |logprob difference| {max(diffs):.4f}, {parted} of {len(prompts)} tokens differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
