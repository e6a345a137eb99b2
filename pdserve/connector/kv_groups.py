"""vLLM's KV cache groups as PDConnector moves them.

With vLLM's hybrid KV cache manager a model's layers fall into groups (full attention, sliding
window, ...), each with its own block table: a request has one block list per group. Messages,
specs and transfers carry them end to end as one flat list, group after group, each run as long
as the prompt's block count, so P and D compare lengths as before; the layer's group picks its run.
In a sliding-window group vLLM puts its null block where a block left the window: nothing moves
there (transfer.py `group_pairs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError, ProtocolError


@dataclass(frozen=True)
class KvGroups:
    layer_group: Mapping[str, int]  # vLLM layer name -> its group; empty: one group of every layer
    windowed: tuple[bool, ...]  # per group: sliding window
    described: tuple[str, ...]  # per group, compared in the handshake: "full", "sliding_window:160"

    @property
    def num_groups(self) -> int:
        return len(self.windowed)

    def group_of(self, layer_name: str) -> int:
        return self.layer_group.get(layer_name, 0)

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config, block_size: int) -> KvGroups:
        """From vLLM's KVCacheConfig (None: one group). ConfigError for a group PDConnector cannot move."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if not groups:
            return ONE_GROUP
        layer_group, windowed, described = {}, [], []
        for index, group in enumerate(groups):
            spec = group.kv_cache_spec
            kind = type(spec).__name__
            if kind not in MOVABLE:
                raise ConfigError(f"PDConnector cannot move KV cache group {index} ({kind}): only full-attention and "
                                  "sliding-window groups")
            if spec.block_size != block_size:
                raise ConfigError(f"KV cache group {index} has {spec.block_size}-token blocks, the cache "
                                  f"{block_size}: PDConnector moves groups of one block size")
            window = getattr(spec, "sliding_window", None) if kind == "SlidingWindowSpec" else None
            windowed.append(window is not None)
            described.append(f"sliding_window:{window}" if window is not None else MOVABLE[kind])
            for name in group.layer_names:
                layer_group[name] = index
        return cls(layer_group, tuple(windowed), tuple(described))


ONE_GROUP = KvGroups({}, (False,), ("full",))
# vLLM's KV cache spec classes PDConnector moves, and how the fingerprint names each
MOVABLE = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding_window"}


def flat_prompt_blocks(block_ids: Sequence[Sequence[int]], num_blocks: int) -> tuple[int, ...]:
    """The first `num_blocks` block ids of every group, group after group (module docstring)."""
    for index, group in enumerate(block_ids):
        if len(group) < num_blocks:
            raise ProtocolError(f"KV cache group {index} holds {len(group)} blocks; the prompt needs {num_blocks}")
    return tuple(b for group in block_ids for b in group[:num_blocks])
