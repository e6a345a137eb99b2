"""Without the nixl extra, asking for the nixl transport fails with one line naming the package."""

import pytest

from pdserve.errors import ConfigError, TransferError
from pdserve.transport import ShmTransport, nixl_agent
from pdserve.transport.nixl_auto import PeerRoute, build_transport


def test_a_missing_nixl_package_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr(nixl_agent, "BINDING_MODULES", ("pdserve_no_such_module._bindings",))
    with pytest.raises(ConfigError) as caught:
        nixl_agent.NixlAgent("nobody")
    message = str(caught.value)
    assert "\n" not in message and "nixl-cu12" in message and "pdserve[nixl]" in message


def test_auto_without_nixl_reaches_this_host_and_names_the_package_for_a_peer_elsewhere(monkeypatch):
    monkeypatch.setattr(nixl_agent, "BINDING_MODULES", ("pdserve_no_such_module._bindings",))
    assert not nixl_agent.nixl_installed()
    with build_transport("auto", ShmTransport(), "nobody", 5.0) as routed:
        assert routed.local_endpoint(peer_here=False) == b"" and not routed.nixl_running
        with pytest.raises(TransferError, match="pdserve\\[nixl\\]"):
            routed.attach_peer("far", [], PeerRoute(False, b"md", "cannot open the peer's host proof"))
    with pytest.raises(ConfigError, match="nixl-cu12"):
        build_transport("nixl", ShmTransport(), "nobody", 5.0)
