"""vLLM general-plugin entry point: makes `"kv_connector": "PDConnector"` work by bare name."""

CONNECTOR_NAME = "PDConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "pdserve.connector.connector", "PDConnector")
