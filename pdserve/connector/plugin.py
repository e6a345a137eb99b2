"""vLLM general-plugin entry point, run in every vLLM process: makes `"kv_connector": "PDConnector"`
work by bare name and installs pdserve's patches to vLLM (pdserve.vllm_patches)."""

CONNECTOR_NAME = "PDConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # lazy: heavy

    from pdserve.vllm_patches import install  # lazy: heavy (vLLM)

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "pdserve.connector.connector", "PDConnector")
    install()
