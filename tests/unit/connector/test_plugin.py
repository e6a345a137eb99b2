"""The `pdserve` vLLM plugin entry point registers PDConnector's bare name."""

from importlib.metadata import entry_points


def test_entry_point_is_installed_and_names_the_register_function():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("pdserve") == "pdserve.connector.plugin:register"


def test_register_makes_the_bare_name_resolvable_and_is_idempotent():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from pdserve.connector.plugin import register

    register()
    register()
    assert "PDConnector" in KVConnectorFactory._registry
    cls = KVConnectorFactory._registry["PDConnector"]()
    assert cls.__name__ == "PDConnector" and cls.__module__ == "pdserve.connector.connector"
