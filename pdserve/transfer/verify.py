"""The engine's side of `kv_verify: digest` (kv_digest.py): P digests what it sends, D checks what landed.

P (WRITE) hashes each layer as it submits it and sends the digest in `WriteDone`; P (READ) hashes
the blocks it holds when D's `ReadDone` comes and sends the digest in `ReadAck`. D hashes what it
received once P's word came and compares: a mismatch fails the transfer (D recomputes, or the
request fails per `load_failure_policy`), is counted per transport and mode, logged with the
transfer, the blocks and the peer, and a peer whose KV failed its digest REPORT_EVERY times is
reported.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from pdserve.transfer.completions import TransferStats
from pdserve.transfer.kv_digest import BlockDigests, HostMemory, mismatched, moved_positions
from pdserve.transfer.layout import KvLayout
from pdserve.transfer.record import Transfer
from pdserve.transport.base import Transport
from pdserve.transport.nixl import NixlTransport

logger = logging.getLogger("pdserve.connector")

REPORT_EVERY = 3  # mismatches from one peer incarnation between two reports of it


class Verifier:
    def __init__(self, layout: KvLayout, transport: Transport, host_staging: bool, stats: TransferStats,
                 enabled: bool):
        self._layout = layout
        self._transport = transport
        self._host_staging = host_staging  # the mirror is filled by the copy itself: hashed once copies ended
        self._stats = stats
        self.enabled = enabled
        self._by_peer: Counter[str] = Counter()

    def hash_sent(self, t: Transfer, layers) -> None:
        """P WRITE: hash `layers` of `t`'s blocks, about to be submitted. With host staging the
        mirror is filled by the copy itself, so `sent` hashes it once every copy ended instead."""
        if not self.enabled or self._host_staging:
            return
        if t.digests is None:
            positions = moved_positions(t.local_block_ids, t.first_block, self._layout.group_sparse,
                                        t.remote_block_ids)
            t.digests = BlockDigests(len(t.local_block_ids), positions)
        self._hash(t, t.digests, layers)

    def sent(self, t: Transfer) -> bytes:
        """P WRITE, every copy ended: the digest of every layer sent; b"" when off."""
        if not self.enabled:
            return b""
        if t.digests is None:  # host staging: hash the mirror the copies sent from
            t.digests = BlockDigests(len(t.local_block_ids), moved_positions(
                t.local_block_ids, t.first_block, self._layout.group_sparse, t.remote_block_ids))
            self._hash(t, t.digests, range(len(self._layout.layers)))
        return t.digests.digest(self._layout)

    def held(self, t: Transfer) -> bytes:
        """P READ: the digest of every block `t` holds, as it is now; b"" when off."""
        if not self.enabled:
            return b""
        digests = BlockDigests(len(t.local_block_ids),
                               moved_positions(t.local_block_ids, 0, self._layout.group_sparse, None))
        self._hash(t, digests, range(len(self._layout.layers)))
        return digests.digest(self._layout)

    def check(self, t: Transfer, theirs: bytes) -> str:
        """D: "" when the blocks `t` received match P's digest `theirs` (or verification is
        off), else why not (the mismatch counted, logged and its peer reported)."""
        if not self.enabled:
            return ""
        if not theirs:
            return "prefill sent no KV digest though decode verifies its KV (kv_verify differs between them)"
        positions = moved_positions(t.local_block_ids, t.first_block, self._layout.group_sparse, t.local_block_ids)
        ours = BlockDigests(len(t.local_block_ids), positions)
        self._hash(t, ours, range(len(self._layout.layers)))
        bad = mismatched(ours.digest(self._layout), theirs, positions)
        if bad is None:
            return f"prefill's KV digest covers {len(theirs) // 4} blocks, decode received {len(t.local_block_ids)}"
        if not bad:
            return ""
        peer = t.link.identity or "?"
        transport = self._transport_of(peer)
        self._stats.digest_mismatches.append(f"{transport}:{t.mode.value.lower()}")
        self._by_peer[peer] += 1
        if self._by_peer[peer] % REPORT_EVERY == 0:
            logger.error("pdserve: prefill %s has sent KV that failed its digest in %d transfers: check its host "
                         "and the %s path to it", peer, self._by_peer[peer], transport)
        blocks = [t.local_block_ids[i] for i in bad]
        return (f"KV digest mismatch: {len(bad)} of {sum(map(len, positions))} blocks received from {peer} over "
                f"{transport} differ from what it sent (positions {bad[:16]}, decode blocks {blocks[:16]}); "
                "not served")

    def _hash(self, t: Transfer, digests: BlockDigests, layers) -> None:
        began = time.perf_counter()
        memory = HostMemory(self._transport.local_descriptors())
        digests.add_layers(self._layout, memory, layers, t.local_block_ids, t.slicing)
        self._stats.digest_seconds += time.perf_counter() - began

    def _transport_of(self, peer: str) -> str:
        """"shm", "nixl" or "gpu-ipc": the route to `peer` (transport auto), else the transport's kind."""
        transport = self._transport
        route = getattr(transport, "transport_of", None)
        name = route(peer) if route is not None else None
        if name:
            return name
        inner = getattr(transport, "inner", transport)  # a fault rig's or host staging's wrapper
        return "nixl" if isinstance(inner, NixlTransport) else "shm"

