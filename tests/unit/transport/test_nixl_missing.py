"""Without the nixl extra, asking for the nixl transport fails with one line naming the package."""

import pytest

from pdserve.errors import ConfigError
from pdserve.transport import nixl_agent


def test_a_missing_nixl_package_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr(nixl_agent, "_MODULES", ("pdserve_no_such_module._bindings",))
    with pytest.raises(ConfigError) as caught:
        nixl_agent.NixlAgent("nobody")
    message = str(caught.value)
    assert "\n" not in message and "nixl-cu12" in message and "pdserve[nixl]" in message
