"""`Handshake`: how this worker meets a peer, both ways, and every check a handshake makes.

Asking (`meet`, the engine's handshake callable, on a handshake thread): send our identity, KV
fingerprint and host claim to the peer's handshake port; a peer that refuses, answers with
anything else, has another KV cache (`check_compatible`), another number of layers or KV heads,
or another tensor-parallel size while our blocks are not head-major, fails the result (refused by
the incarnation that answered, when one did). An accepted reply gives the peer's incarnation
(its pid and boot id only when it shares our host), regions, layout, route and ranks.

Answering (`answer`, on the handshake server's thread): refuse a peer with another KV cache;
else reply with our identity, fingerprint, regions, layout, liveness and transport endpoint.
"""

from __future__ import annotations

import logging
import time

from pdserve.config import ConnectorConfig
from pdserve.connector.worker.kv_memory import KvMemory
from pdserve.connector.worker.worker_stats import WorkerStats
from pdserve.control.address import PeerAddress
from pdserve.control.endpoint import Client
from pdserve.control.messages import HandshakeRefused, HandshakeReply, HandshakeRequest
from pdserve.errors import IncompatiblePeerError, PDServeError, ProtocolError
from pdserve.transfer.incarnation import Incarnation
from pdserve.transfer.layout import KvLayout
from pdserve.transfer.peers import HandshakeResult
from pdserve.transfer.ranks import SINGLE, Ranks
from pdserve.transport.base import RegionDescriptor, Transport
from pdserve.transport.nixl_auto import PeerRoute
from pdserve.transport.nixl_host import HostClaim, HostProof, verify

logger = logging.getLogger("pdserve.connector")

NOT_COMPARED = ("tp",)  # differs between peers by design: the pairing is derived from it (ranks.py)
# named first when they differ: the cause, where other fields differ only because of it (a state
# split between other numbers of ranks has other shapes)
NAMED_FIRST = ("state_tensor_parallel_size",)


def check_compatible(local: dict, remote: dict, peer: str) -> None:
    """Raise IncompatiblePeerError naming every differing fingerprint field."""
    keys = sorted((set(local) | set(remote)) - set(NOT_COMPARED), key=lambda k: (k not in NAMED_FIRST, k))
    diffs = [f"{k}: ours {local.get(k)!r}, theirs {remote.get(k)!r}" for k in keys if local.get(k) != remote.get(k)]
    if diffs:
        raise IncompatiblePeerError(f"peer {peer} has an incompatible KV cache ({'; '.join(diffs)})")


class Handshake:
    def __init__(self, config: ConnectorConfig, identity: str, token: str, ranks: Ranks, kv: KvMemory, client: Client,
                 stats: WorkerStats):
        """`identity`: this worker's incarnation's name; `token`: its process token (the host proof's)."""
        self.identity = identity
        self.incarnation = Incarnation.this_process(self.identity)
        self._timeout = config.handshake_timeout
        self._ranks = ranks
        self._kv = kv
        self._client = client
        self._stats = stats
        self._host_proof = HostProof(token)

    def answer(self, message: HandshakeRequest, sender: str, transport: Transport) -> HandshakeReply | HandshakeRefused:
        """Answer a peer's handshake request."""
        try:
            check_compatible(self._kv.fingerprint, message.fingerprint, sender)
        except IncompatiblePeerError as exc:
            logger.error("pdserve: refusing handshake: %s", exc)
            return HandshakeRefused(str(exc))
        peer_here = verify(HostClaim(message.host_proof, message.host_proof_digest)) is None
        return HandshakeReply(
            self.identity, self._kv.fingerprint,
            [d.to_wire() for d in transport.local_descriptors()], self._kv.layout.to_wire(),
            self.incarnation.pid, self.incarnation.start_time, self.incarnation.boot_id,
            transport.local_endpoint(peer_here), *self._host_proof.claim,
        )

    def meet(self, address: PeerAddress) -> HandshakeResult:
        """Handshake the peer listening at `address`."""
        where = f"{address.host}:{address.handshake_port}"
        answered_by = ""  # the incarnation that answered, when it did: it stays reachable for a Release
        try:
            started = time.monotonic()
            envelope = self._client.exchange(
                address.host, address.handshake_port,
                HandshakeRequest(self.identity, self._kv.fingerprint, *self._host_proof.claim), self._timeout,
            )
            self._stats.on_handshake(time.monotonic() - started)  # answered, accepted or not
            reply, answered_by = envelope.message, envelope.sender
            if isinstance(reply, HandshakeRefused):
                raise IncompatiblePeerError(f"peer {where} refused the handshake: {reply.reason}")
            if not isinstance(reply, HandshakeReply):
                raise ProtocolError(f"peer {where} answered the handshake with {type(reply).__name__}")
            regions, layout, ranks = self._check_reply(reply, where)
        except IncompatiblePeerError as exc:
            return HandshakeResult(address, error=str(exc), refused_by=answered_by)
        except PDServeError as exc:
            return HandshakeResult(address, error=str(exc))
        not_here = verify(HostClaim(reply.host_proof, reply.host_proof_digest))
        route = PeerRoute(not_here is None, reply.nixl_metadata, not_here or "")
        # pid and boot id prove a death only to a peer that shares our host (and PID namespace)
        incarnation = Incarnation(reply.engine_id, reply.pid, reply.start_time, reply.boot_id if route.same_host else "")
        return HandshakeResult(address, incarnation, regions, layout, route=route, ranks=ranks)

    def _check_reply(self, reply: HandshakeReply, where: str
                     ) -> tuple[tuple[RegionDescriptor, ...], KvLayout, Ranks]:
        """The peer's regions, layout and ranks, once its KV cache can be moved to or from ours."""
        check_compatible(self._kv.fingerprint, reply.fingerprint, where)
        regions = tuple(RegionDescriptor.from_wire(r) for r in reply.regions)
        layout = KvLayout.from_wire(reply.layers, region_sizes={d.region_id: d.size for d in regions})
        if len(layout.layers) != len(self._kv.layout.layers):
            raise IncompatiblePeerError(f"peer {where} has {len(layout.layers)} KV layers, we have {len(self._kv.layout.layers)}")
        ranks = Ranks.from_wire(reply.fingerprint.get("tp", SINGLE.to_wire()))
        if ranks.total_heads != self._ranks.total_heads:
            raise IncompatiblePeerError(f"peer {where} counts {ranks.total_heads} KV heads, we count "
                                        f"{self._ranks.total_heads}")
        if ranks.size != self._ranks.size and not self._kv.head_major:
            raise IncompatiblePeerError(f"peer {where} runs tensor-parallel size {ranks.size}, we run "
                                        f"{self._ranks.size}, and our KV blocks are not head-major "
                                        f"({self._kv.fingerprint.get('kv_block_format')}): a head range of a "
                                        "block is not one range of bytes")
        return regions, layout, ranks

    def close(self) -> None:
        self._host_proof.close()
