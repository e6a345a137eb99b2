"""vLLM's KV cache groups as PDConnector moves them.

With vLLM's hybrid KV cache manager a model's layers fall into groups (full attention, sliding
window, mamba or linear-attention state), each with its own block table: a request has one block
list per group. Messages, specs and transfers carry them end to end as one flat list, group after
group, each run as long as the prompt's block count, so P and D compare lengths as before; the
layer's group picks its run. vLLM's null block (id 0) in a run means "nothing moves here":

- a sliding-window group holds it where a block left the window;
- a state group (mamba, Gated DeltaNet: `MambaSpec`) keeps one recurrent state per request, not
  one block per token range, so its run is null except the last entry, the block holding the
  state after the prompt's computed tokens. vLLM keeps that state in the block of the last
  computed token's column with prefix caching on (`mamba_cache_mode` "align"), in the request's
  one block otherwise ("none"); either way the run names it last, so peers of either mode pair.

A state holds every token before it, so P computes the prompt up to a chunk edge of the state
kernel and D computes the rest, at least two tokens, from the state (leg_truncation.py
`truncate_prompt`); with attention alone D takes the whole prompt's KV. Why: vLLM's chunked
kernels (Gated DeltaNet's chunked delta rule, Mamba2's SSD) round a prompt computed in two pieces
differently from one computed at once unless the pieces meet on a chunk edge, and a one-token
rest runs vLLM's recurrent decode kernel, which rounds differently from the chunked one collocated
serving computes that token with. Measured on a bf16 Qwen3-Next-style model (22 prompts, 1P1D):
with P computing all but the last token, answers up to 0.22 apart in logprob from collocated
serving; with P stopping on a 64-token edge, 20 of 22 equal to the last bit and the two whose rest
was one token up to 0.06 apart; with this rule, 40 of 40 equal to the last bit in every layout
(benchmarks/model-matrix). D computes at most one chunk and a token (65 for Gated DeltaNet) more
than with attention alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError, ProtocolError

NULL_BLOCK = 0  # vLLM's null block


@dataclass(frozen=True)
class KvGroups:
    layer_group: Mapping[str, int]  # vLLM layer name -> its group; empty: one group of every layer
    windowed: tuple[bool, ...]  # per group: sliding window
    described: tuple[str, ...]  # per group, compared in the handshake: "full", "mla", "sliding_window:160", "state:..."
    state: tuple[str | None, ...] = ()  # per group: vLLM's mamba_cache_mode of a state group, None for KV
    state_chunk: int = 1  # tokens: P's share of a prompt ends on a multiple of it (module docstring)

    @property
    def num_groups(self) -> int:
        return len(self.windowed)

    @property
    def has_state(self) -> bool:
        return any(mode is not None for mode in self.state)

    @property
    def sparse(self) -> tuple[bool, ...]:
        """Per group: its runs may hold the null block, where nothing moves (module docstring)."""
        return tuple(w or self.state_mode(g) is not None for g, w in enumerate(self.windowed))

    def state_mode(self, group: int) -> str | None:
        return self.state[group] if self.state else None

    def group_of(self, layer_name: str) -> int:
        return self.layer_group.get(layer_name, 0)

    def moved_tokens(self, num_prompt_tokens: int) -> int:
        """How many of a prompt's tokens P computes and D takes: all, or with a state group the
        whole state chunks that leave D two tokens or more (none of a prompt shorter than a chunk
        and two tokens: D computes it)."""
        if not self.has_state:
            return num_prompt_tokens
        return max(num_prompt_tokens - 2, 0) // self.state_chunk * self.state_chunk

    def prompt_blocks(self, block_ids: Sequence[Sequence[int]], num_blocks: int) -> tuple[int, ...]:
        """The runs of `num_blocks` block ids of every group, group after group (module docstring)."""
        if len(block_ids) != self.num_groups:
            raise ProtocolError(f"{len(block_ids)} block lists for {self.num_groups} KV cache groups")
        out: list[int] = []
        for index, group in enumerate(block_ids):
            mode = self.state_mode(index)
            needed = 1 if mode == "none" else num_blocks
            if len(group) < needed:
                raise ProtocolError(f"KV cache group {index} holds {len(group)} blocks; the prompt needs {needed}")
            if mode is None:
                out.extend(group[:num_blocks])
            elif num_blocks:
                out.extend([NULL_BLOCK] * (num_blocks - 1))
                out.append(group[0] if mode == "none" else group[num_blocks - 1])
        return tuple(out)

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config, block_size: int, mamba_chunk: int | None = None) -> KvGroups:
        """From vLLM's KVCacheConfig (None: one group); `mamba_chunk`: the model's Mamba2 chunk
        size (vLLM's `get_mamba_chunk_size`). ConfigError for a group PDConnector cannot move."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if not groups:
            return ONE_GROUP
        layer_group, windowed, described, state, chunks = {}, [], [], [], [1]
        for index, group in enumerate(groups):
            spec = group.kv_cache_spec
            kind = type(spec).__name__
            if kind not in MOVABLE:
                raise ConfigError(f"PDConnector cannot move KV cache group {index} ({kind}): only full-attention, "
                                  "MLA, sliding-window and mamba/linear-attention state groups")
            mode = _state_mode(index, spec) if kind == "MambaSpec" else None
            if mode is not None:
                chunks.append(_state_chunk(index, spec, mamba_chunk))
            if mode != "none" and spec.block_size != block_size:
                raise ConfigError(f"KV cache group {index} has {spec.block_size}-token blocks, the cache "
                                  f"{block_size}: PDConnector moves groups of one block size")
            window = getattr(spec, "sliding_window", None) if kind == "SlidingWindowSpec" else None
            windowed.append(window is not None)
            state.append(mode)
            if window is not None:
                described.append(f"sliding_window:{window}")
            elif mode is not None:
                shapes = ",".join(f"{list(s)}:{str(d).removeprefix('torch.')}" for s, d in zip(spec.shapes, spec.dtypes))
                described.append(f"state:{shapes}")
            else:
                described.append(MOVABLE[kind])
            for name in group.layer_names:
                layer_group[name] = index
        return cls(layer_group, tuple(windowed), tuple(described), tuple(state) if any(state) else (),
                   math.lcm(*chunks))


def _state_mode(index: int, spec) -> str:
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode not in ("align", "none"):
        raise ConfigError(f"KV cache group {index} keeps mamba state with mamba_cache_mode {mode!r}; PDConnector "
                          "moves the modes 'align' (prefix caching on) and 'none'")
    if getattr(spec, "num_speculative_blocks", 0):
        raise ConfigError(f"KV cache group {index} keeps state blocks for speculative decoding, which PDConnector "
                          "does not move")
    return mode


# tokens per chunk of vLLM's chunked Gated DeltaNet kernels (FLA's on GPUs, vLLM's own on CPUs)
GDN_CHUNK = 64


def _state_chunk(index: int, spec, mamba_chunk: int | None) -> int:
    """The chunk of the kernel computing a state group's prefill (module docstring)."""
    kind = getattr(getattr(spec, "mamba_type", None), "name", None)
    if kind == "GDN_ATTN":
        return GDN_CHUNK
    if kind == "MAMBA2" and mamba_chunk:
        return mamba_chunk
    raise ConfigError(f"KV cache group {index} keeps state of {kind or 'an unknown'} layers; PDConnector moves the "
                      "state of Gated DeltaNet and Mamba2 layers")


ONE_GROUP = KvGroups({}, (False,), ("full",))
# vLLM's KV cache spec classes PDConnector moves, and how the fingerprint names each
# (MLA's group, one latent per token that every head shares, moves as full attention does)
MOVABLE = {"FullAttentionSpec": "full", "MLAAttentionSpec": "mla", "SlidingWindowSpec": "sliding_window",
           "MambaSpec": "state"}
