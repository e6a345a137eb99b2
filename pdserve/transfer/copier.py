"""`Copier`: starts the copies of a transfer's blocks (layer by layer with a peer; the land from
the host mirror to the device with host staging), each bounded by the transfer's deadline."""

from __future__ import annotations

import dataclasses

from pdserve.errors import PDServeError
from pdserve.transfer.endings import Endings
from pdserve.transfer.layout import KvLayout
from pdserve.transfer.peers import Peer
from pdserve.transfer.record import Transfer
from pdserve.transfer.verify import Verifier
from pdserve.transport.base import Direction, Transport
from pdserve.transport.staged import StagedTransport


class Copier:
    def __init__(self, layout: KvLayout, transport: Transport, staging: StagedTransport | None, verifier: Verifier,
                 endings: Endings):
        self._layout = layout
        self._transport = transport
        self._staging = staging
        self._verifier = verifier
        self._endings = endings

    def submit(self, t: Transfer, peer: Peer, direction: Direction, layers) -> None:
        """Start copying `layers` of `t`'s block pairs with `peer`, bounded by `t.copies.not_after`."""
        try:
            batch = self._layout.layer_ops(peer.layout, layers, t.group_pairs(self._layout.group_sparse), t.slicing)
        except PDServeError as exc:
            self._endings.stop(t, str(exc), tell_peer=True)
            return
        if direction is Direction.WRITE:
            self._verifier.hash_sent(t, layers)
        t.start_copying()
        handle = self._transport.submit(peer.key, direction, batch, not_after=t.copies.not_after)
        t.copies.handles.append(handle)
        t.copies.num_bytes += handle.num_bytes

    def land(self, t: Transfer) -> None:
        """D WRITE, host staging: copy the blocks P wrote into our mirror on to the device (from
        `first_block` on, as P wrote them), bounded by `t`'s deadline."""
        try:
            pairs = dataclasses.replace(t, remote_block_ids=t.local_block_ids).group_pairs(self._layout.group_sparse)
            batch = self._layout.layer_ops(self._layout, range(len(self._layout.layers)), pairs)
        except PDServeError as exc:
            self._endings.stop(t, str(exc), tell_peer=True)
            return
        t.copies.handles.append(self._staging.land(batch, not_after=t.deadline))

    def bytes_to_move(self, t: Transfer) -> int:
        """Bytes `t`'s copies move, over every layer (only its heads, only blocks in the window)."""
        if t.remote_block_ids is None:  # D WRITE: P's blocks are P's business; D's decide what lands
            t = dataclasses.replace(t, remote_block_ids=t.local_block_ids)
        return self._layout.bytes_moved(t.group_pairs(self._layout.group_sparse), t.slicing)
