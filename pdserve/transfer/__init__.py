"""The transfer engine: moves a request's prompt KV between a prefill and a decode instance, free of vLLM.

`TransferEngine` (engine.py) drives every transfer of one worker; its parts are modules here,
what each kind of transfer does is in kinds/. The connector's worker half
(pdserve/connector/worker/) feeds it; it knows nothing of the connector.
"""
