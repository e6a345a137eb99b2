"""transport auto: the host proof, and which backend each peer gets."""

import multiprocessing
import os

import pytest

from pdserve.config import SECRET_FILE_ENV, parse_connector_config
from pdserve.errors import ConfigError, TransferError
from pdserve.transport import CopyOp, Direction, RegionOps, ShmTransport, TransferStatus
from pdserve.transport.nixl_agent import nixl_installed
from pdserve.transport.nixl_auto import PeerRoute, RoutedTransport, build_transport
from pdserve.transport.nixl_host import HostClaim, HostProof, verify


def _offer_proof(conn) -> None:
    proof = HostProof("childproof")
    conn.send(tuple(proof.claim))
    conn.recv()
    proof.close()


def test_a_token_of_this_host_verifies_and_a_forged_or_foreign_one_does_not():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_offer_proof, args=(child,))
    process.start()
    try:
        assert parent.poll(20)
        claim = HostClaim(*parent.recv())
        assert claim.path.startswith(f"/proc/{process.pid}/fd/")
        assert verify(claim) is None, "a process on this host proved nothing"
        assert "another token" in verify(HostClaim(claim.path, "0" * 64))
        assert "cannot open" in verify(HostClaim(f"/proc/{os.getpid()}/fd/0", claim.digest))
        assert verify(HostClaim("", "")) == "the peer offered no host proof"
    finally:
        parent.send("done")
        process.join(20)
    assert "cannot open" in verify(claim), "the token outlived its process"


class _FakeNixl(ShmTransport):
    """Stands in for NixlTransport here (unit test of the routing only): records attaches."""

    def __init__(self):
        super().__init__(name="fakenixl")
        self.attached = {}
        self.regions = []

    def register_region(self, region_id, address, size, shm_name=None):
        self.regions.append(region_id)
        return super().register_region(region_id, address, size, shm_name)

    def local_endpoint(self) -> bytes:
        return b"md"

    def attach_peer(self, peer_id, descriptors, endpoint=None):
        self.attached[peer_id] = endpoint


def test_auto_sends_proven_same_host_peers_to_shm_and_the_rest_to_nixl():
    nixl = _FakeNixl()
    with RoutedTransport("auto", ShmTransport(), nixl) as routed:
        assert routed.choose(PeerRoute(True, b"md")) == "shm"
        assert routed.choose(PeerRoute(False, b"md")) == "nixl"
        routed.attach_peer("far", [], PeerRoute(False, b"peer-md"))
        assert routed.transport_of("far") == "nixl" and nixl.attached == {"far": b"peer-md"}
        with pytest.raises(TransferError, match="no NIXL agent metadata"):
            routed.choose(PeerRoute(False, b""))
        handle = routed.submit("nobody", Direction.READ, [RegionOps(0, (CopyOp(0, 0, 8),))])
        assert handle.status is TransferStatus.FAILED and "not attached" in handle.error
        assert routed.local_endpoint() == b"md" and routed.local_endpoint(peer_here=True) == b""


def test_policies_shm_and_nixl_ignore_the_proof_and_auto_without_nixl_reaches_only_this_host():
    with RoutedTransport("shm", ShmTransport(), _FakeNixl()) as routed:
        assert routed.choose(PeerRoute(False, b"md")) == "shm" and routed.local_endpoint() == b""
    with RoutedTransport("nixl", ShmTransport(), _FakeNixl()) as routed:
        assert routed.choose(PeerRoute(True, b"md")) == "nixl"
    with RoutedTransport("auto", ShmTransport(), None) as routed:
        assert routed.choose(PeerRoute(True)) == "shm"
        with pytest.raises(TransferError, match="pdserve\\[nixl\\]"):
            routed.choose(PeerRoute(False, b"md", "cannot open the peer's host proof"))
    with pytest.raises(ConfigError, match="nixl-cu12"):
        RoutedTransport("nixl", ShmTransport(), None)


@pytest.mark.parametrize("value", ["auto", "shm", "nixl"])
def test_the_transport_key_takes_auto_shm_nixl(value):
    config = parse_connector_config("kv_producer", {"transport": value}, env={SECRET_FILE_ENV: "/s"})
    assert config.transport == value
    assert parse_connector_config("kv_producer", {}, env={SECRET_FILE_ENV: "/s"}).transport == "auto"


class _Starts:
    """A NIXL factory that counts its starts (and fails with `error`, when set)."""

    def __init__(self, error: Exception | None = None):
        self.started: list[_FakeNixl] = []
        self.error = error

    def __call__(self):
        if self.error is not None:
            raise self.error
        self.started.append(_FakeNixl())
        return self.started[-1]


def test_auto_starts_nixl_only_for_the_first_peer_not_on_this_host_with_every_region_registered():
    starts = _Starts()
    with RoutedTransport("auto", ShmTransport(), start_nixl=starts) as routed:
        routed.register_region(0, 4096, 4096)
        routed.attach_peer("near", [], PeerRoute(True))
        assert routed.local_endpoint(peer_here=True) == b""
        assert not starts.started and not routed.nixl_running, "NIXL started for peers on this host"
        assert routed.local_endpoint(peer_here=False) == b"md"  # a replier to a peer that proved nothing
        assert len(starts.started) == 1 and starts.started[0].regions == [0], "the late agent lacks a region"
        routed.register_region(1, 8192, 4096)
        routed.attach_peer("far", [], PeerRoute(False, b"peer-md", "cannot open the peer's host proof"))
        assert len(starts.started) == 1 and starts.started[0].regions == [0, 1]
        assert routed.transport_of("far") == "nixl" and routed.transport_of("near") == "shm"
    with RoutedTransport("auto", ShmTransport(), start_nixl=starts) as routed:  # a requester first
        routed.attach_peer("far", [], PeerRoute(False, b"peer-md"))
        assert len(starts.started) == 2 and starts.started[1].attached == {"far": b"peer-md"}


def test_a_nixl_that_fails_to_start_is_a_clear_error_for_the_peer_that_needed_it():
    with RoutedTransport("auto", ShmTransport(), start_nixl=_Starts(ConfigError("no UCX here"))) as routed:
        assert routed.local_endpoint(peer_here=False) == b""  # logged; the peer reports no metadata
        with pytest.raises(TransferError, match="NIXL did not start: no UCX here"):
            routed.attach_peer("far", [], PeerRoute(False, b"peer-md"))
        routed.attach_peer("near", [], PeerRoute(True))  # peers on this host are unaffected
        assert routed.transport_of("near") == "shm" and routed.transport_of("far") is None


def test_build_transport_starts_no_agent_under_auto_until_a_peer_needs_one():
    routed = build_transport("auto", ShmTransport(), "lazy-agent", 5.0)
    try:
        assert routed.policy == "auto" and not routed.nixl_running
        if nixl_installed():  # the base install has it (bootstrap installs pdserve[nixl])
            assert routed.choose(PeerRoute(False, b"md")) == "nixl"
        assert not routed.nixl_running, "choosing a backend must not start it"
    finally:
        routed.close()
    assert not build_transport("shm", ShmTransport(), "shm-agent", 5.0).nixl_running
