"""The front: the small process on a deployment's client port, in front of its router (or only instance).

It exists for what vllm-router 0.1.17 does not do: answer GET /v1/models in PD discovery mode
(exchange.py), word every error in OpenAI's shape (openai_error.py), and drain on SIGTERM
(server.py). Everything else passes through byte for byte, streaming included. The launcher's
side of it (FrontSpec: where it listens, what it fronts) is in spec.py.
"""
