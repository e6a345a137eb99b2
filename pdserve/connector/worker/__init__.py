"""The connector's half in vLLM's worker processes: `PDWorker` (worker.py) and its helpers.

It owns the KV memory (kv_memory.py) and its transport (kv_transport.py), the control-plane
servers, the handshake (handshake.py), and drives the transfer engine (pdserve/transfer/).
"""
