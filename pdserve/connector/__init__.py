"""PDConnector, pdserve's vLLM KV connector. Importing this package does not import vLLM;
`pdserve.connector.PDConnector` does (vLLM's `kv_connector_module_path` loads it that way)."""


def __getattr__(name: str):
    if name == "PDConnector":
        from pdserve.connector.connector import PDConnector  # lazy: it imports vLLM, which this package must not

        return PDConnector
    raise AttributeError(name)
