"""The router an xPyD deployment plans (real vllm-router, MoRIIO discovery) pairs any prefill with
any decode: 2P+2D fake workers register over ZMQ as PDConnector does, and the X-Request-ID both
legs of a request carry says which pair served it."""

from __future__ import annotations

import collections
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from pdserve.control.codec import Codec
from pdserve.control.registration import Registration, RegistrationHeartbeat
from pdserve.control.secret import load_secret
from pdserve.launch import UpOptions, plan
from pdserve.launch.process import ManagedProcess

BASE = 29060


class _Worker(BaseHTTPRequestHandler):
    """Answers like vLLM with PDConnector would, and records (request id, worker name)."""

    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._reply({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.seen.append((self.headers.get("X-Request-ID", "").rsplit("_", 1)[-1], self.server.name))
        params = body.get("kv_transfer_params") or {}
        self._reply({"id": "c", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                     "kv_transfer_params": {**params, "remote_block_ids": [0]}})

    def _reply(self, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.mark.parametrize("mode", ["write", "read"])
def test_any_prefill_pairs_with_any_decode(tmp_path: Path, mode):
    deployment = plan(UpOptions(mode=mode, model="/m", port=BASE, cores=(0, 1), num_prefill=2, num_decode=2))
    router = deployment.router
    _Worker.seen = []
    servers, beats = [], []
    try:
        for instance in deployment.instances:
            config = json.loads(instance.extra_args[-1])["kv_connector_extra_config"]
            server = ThreadingHTTPServer(("127.0.0.1", instance.port), _Worker)
            server.name = instance.name
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
            registration = Registration(
                "P" if instance.role == "prefill" else "D", f"127.0.0.1:{instance.port}",
                f"host:127.0.0.1,handshake:{config['handshake_port']},notify:{config['notify_port']}", mode.upper())
            beats.append(RegistrationHeartbeat("127.0.0.1", config["proxy_ping_port"], registration,
                                               Codec(load_secret(config["secret_file"]), instance.name), interval_s=0.5))
        process = ManagedProcess(router.process_spec(tmp_path))
        process.start()
        try:
            deadline = time.monotonic() + 30
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            names = {instance.name for instance in deployment.instances}
            while True:  # until every worker has registered and served a leg
                try:
                    requests.post(f"{router.url}/v1/completions", json=body, timeout=5)
                except requests.ConnectionError:
                    pass
                with _Worker.lock:
                    if {name for _, name in _Worker.seen} == names:
                        break
                assert time.monotonic() < deadline, f"router never routed to all of {names}: {process.log_tail()}"
                time.sleep(0.1)
            time.sleep(0.3)
            _Worker.seen = []
            for _ in range(32):
                assert requests.post(f"{router.url}/v1/completions", json=body, timeout=10).status_code == 200
            time.sleep(0.3)  # WRITE: the prefill leg may still be in flight
        finally:
            process.stop(time.monotonic() + 10)
    finally:
        for beat in beats:
            beat.stop()
        for server in servers:
            server.shutdown()
            server.server_close()
    legs = collections.defaultdict(set)
    for request_id, name in _Worker.seen:
        legs[request_id].add(name)
    pairs = collections.Counter(tuple(sorted(names)) for names in legs.values())
    assert sum(pairs.values()) == 32 and all(len(p) == 2 for p in pairs), pairs
    assert collections.Counter(name for name in (n for p in pairs.elements() for n in p)
                               if name.startswith("prefill")) == {"prefill0": 16, "prefill1": 16}  # round_robin
    assert len(pairs) == 4, f"only these prefill/decode pairs served requests: {pairs}"
