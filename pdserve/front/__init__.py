"""The front: the small process on a deployment's client port, in front of its router (or only instance).

It exists for what vllm-router 0.1.17 does not do: answer GET /v1/models in PD discovery mode
(exchange.py), send completions with echo and logprobs where its merge cannot get them wrong
(routes.py), word every error in OpenAI's shape (openai_error.py), hold each client to limits
(config.Limits, connections.py, intake.py), keep what only pdserve sets out of what clients send
(body.py, headers.py), and drain on SIGTERM (server.py). exchange.py handles one request: upstream.py
sends it and reads what is read whole, relay.py writes a success to the client piece by piece. Everything else passes through,
streams piece by piece, on kept-alive connections at both ends (aiohttp's HTTP/1.1 server and
client). The launcher's side of it (FrontSpec: where it listens, what it fronts) is pdserve/launch/front_spec.py.
"""
