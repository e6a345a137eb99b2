"""Does vLLM serve the MLA test model right on this machine? One collocated instance of the
DeepSeek-V2-style tiny model, one request at a time: each prompt's first three greedy tokens,
held against (1) the same model written out in plain PyTorch (float32, the whole sequence at once)
and (2) the second token computed again by vLLM's prefill path (the prompt and the first token sent
as one prompt) where it came from the decode path (attention over the cached latents). PD serving of
MLA can equal plain serving only where both agree: D computes a prompt's last token by the decode
path. Without pdserve's patch of vLLM's CPU rotary kernel (pdserve/vllm_patches/cpu_rope.py) both
part (float32: up to 1.29 apart between the paths); with it, they agree to rounding.

    .venv/bin/python scripts/mla_paths.py [--dtype float32] [--port 28960]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.compare import fetch_greedy  # noqa: E402
from pdserve.launch import Cluster, Deployment, UpOptions  # noqa: E402
from pdserve.launch.modes import plain_instance  # noqa: E402
from pdserve.model.build import resolve_model  # noqa: E402
from tests.integration.matrix_helpers import matrix_prompts  # noqa: E402
from tests.integration.pd_helpers import LOG_DIR  # noqa: E402


class Reference:
    """DeepSeek-V2 with MLA and dense MLPs as vLLM computes it: interleaved (GPT-J) rotary on the
    64-wide rotary parts, scores scaled by 1/sqrt(nope + rope), RMS norms, SiLU-gated MLPs."""

    def __init__(self, model_dir: Path):
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}

    def _norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]) * weight

    def _rotate(self, x, positions):
        dim = x.shape[-1]
        inv = 1.0 / self.cfg["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angle = positions[:, None].double() * inv[None]
        cos, sin = angle.cos().float(), angle.sin().float()
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, odd * cos + even * sin
        return out

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        c, w, n = self.cfg, self.w, len(ids)
        heads, nope, rope, v_dim, rank = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                          c["v_head_dim"], c["kv_lora_rank"])
        positions, x = torch.arange(n), w["model.embed_tokens.weight"][torch.tensor(ids)]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, nope + rope)
            latent = h @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
            kv = self._norm(latent[:, :rank], w[p + "self_attn.kv_a_layernorm.weight"]) @ w[p + "self_attn.kv_b_proj.weight"].T
            kv = kv.view(n, heads, nope + v_dim)
            k_rope = self._rotate(latent[:, rank:], positions)[:, None].expand(n, heads, rope)
            q = torch.cat([q[..., :nope], self._rotate(q[..., nope:], positions)], -1)
            k = torch.cat([kv[..., :nope], k_rope], -1)
            scores = torch.einsum("thd,shd->hts", q, k) * (nope + rope) ** -0.5
            attn = torch.einsum("hts,shd->thd", scores.masked_fill(causal, float("-inf")).softmax(-1), kv[..., nope:])
            x = x + attn.reshape(n, heads * v_dim) @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + gate @ w[p + "mlp.down_proj.weight"].T
        return (self._norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T).log_softmax(-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--port", type=int, default=28960)
    args = parser.parse_args()
    prompts = matrix_prompts()[:12]
    model_dir = resolve_model("deepseek-v2-tiny")
    options = UpOptions(mode="write", model=str(model_dir), port=args.port,
                        enforce_eager=True, extra_vllm_args=("--dtype", args.dtype))
    deployment = Deployment((plain_instance(options, "vllm", args.port, options.cores, role="decode"),))
    with Cluster(deployment, log_dir=LOG_DIR / f"mla-paths-{args.dtype}") as cluster:
        cluster.wait_healthy(900)
        served = fetch_greedy(cluster.endpoint, prompts, max_tokens=3, concurrency=1)
        again = fetch_greedy(cluster.endpoint, [p + [s[0].token_id] for p, s in zip(prompts, served)],
                             max_tokens=1, concurrency=1)
    reference = Reference(model_dir)
    paths, to_reference, parted = [], [], 0
    for prompt, steps, prefill in zip(prompts, served, again):
        ids = prompt + [s.token_id for s in steps]
        logprobs = reference.logprobs(ids)
        gaps = [abs(s.logprob - logprobs[len(prompt) - 1 + k, s.token_id].item()) for k, s in enumerate(steps)]
        to_reference.append(max(gaps))
        decode, again_step = steps[1], prefill[0]
        paths.append(abs(decode.logprob - again_step.logprob))
        parted += decode.token_id != again_step.token_id
        print(f"{len(prompt):5d} tokens: against the reference {max(gaps):.4f}; second token by the decode path "
              f"{decode.token_id} ({decode.logprob:.4f}), by the prefill path {again_step.token_id} "
              f"({again_step.logprob:.4f})")
    print(f"{args.dtype}: served against the plain PyTorch reference: max |logprob difference| {max(to_reference):.4f}; "
          f"decode path against prefill path: max {max(paths):.4f}, {parted} of {len(prompts)} tokens differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
