"""The router process a PD deployment plans: the registrar with the real vllm-router as its child.
Fake workers register as PDConnector does; forged registrations get no request; the router's
discovery socket listens on loopback only; the two stop as one."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgpack
import requests
import zmq

from pdserve.control.codec import Codec
from pdserve.control.registration import Registration, RegistrationHeartbeat
from pdserve.control.secret import load_secret
from pdserve.launch import UpOptions, plan
from pdserve.launch.process import ManagedProcess, group_members

BASE = 29120
FORGED_PORTS = (29140, 29141)  # outside the deployment's ports


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/count":
            with self.server.lock:
                self._reply({"num_requests": self.server.num_requests})
        else:
            self._reply({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.num_requests += 1
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


class FakeWorker:
    """An HTTP server that answers completions like vLLM with PDConnector and counts them (also
    on GET /count)."""

    def __init__(self, host: str, port: int):
        self.server = ThreadingHTTPServer((host, port), _Handler)
        self.server.lock = threading.Lock()
        self.server.num_requests = 0
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def num_requests(self) -> int:
        with self.server.lock:
            return self.server.num_requests

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def registration(role: str, host: str, port: int, mode: str = "WRITE") -> Registration:
    return Registration(role, f"{host}:{port}", f"host:{host},handshake:{port + 100},notify:{port + 200}", mode)


class UnsignedBeat:
    """What registered with vllm-router before the registrar: its bare map, every `interval_s`."""

    def __init__(self, host: str, port: int, registration: Registration, interval_s: float = 0.2):
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{host}:{port}")
        self._frame = msgpack.packb(registration.router_map())
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._socket.send(self._frame, zmq.NOBLOCK)
            except zmq.Again:
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._socket.close(0)
        self._context.term()


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on TCP `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    out.add(address)
    return out


def route(url: str, num_requests: int) -> list[int]:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    return [requests.post(f"{url}/v1/completions", json=body, timeout=10).status_code for _ in range(num_requests)]


def test_only_signed_instances_get_requests_and_the_router_listens_on_loopback(tmp_path: Path):
    deployment = plan(UpOptions(mode="write", model="/m", port=BASE, cores=(0, 1)))
    router, registrar = deployment.router, deployment.router.registrar
    assert registrar.listen_port == json.loads(deployment.instances[0].extra_args[-1])[
        "kv_connector_extra_config"]["proxy_ping_port"]
    codec = Codec(load_secret(registrar.secret_file), "test-instances")
    real = {i.role: FakeWorker("127.0.0.1", i.port) for i in deployment.instances}
    forged = {"P": FakeWorker("127.0.0.1", FORGED_PORTS[0]), "D": FakeWorker("127.0.0.1", FORGED_PORTS[1])}
    beats = [RegistrationHeartbeat("127.0.0.1", registrar.listen_port, registration(role[0].upper(), "127.0.0.1", w.server.server_port),
                                   codec, 0.2) for role, w in real.items()]
    beats.append(UnsignedBeat("127.0.0.1", registrar.listen_port, registration("P", "127.0.0.1", FORGED_PORTS[0])))
    beats.append(RegistrationHeartbeat("127.0.0.1", registrar.listen_port, registration("D", "127.0.0.1", FORGED_PORTS[1]),
                                       Codec(b"a guessed secret", "intruder"), 0.2))
    process = ManagedProcess(router.process_spec(tmp_path))
    process.start()
    try:
        deadline = time.monotonic() + 30
        while not process.healthy() or real["decode"].num_requests == 0:
            assert process.exit_code() is None and time.monotonic() < deadline, process.log_tail()
            try:
                route(router.url, 1)
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        time.sleep(1.0)  # every beat has arrived a few times over
        before = {role: w.num_requests for role, w in real.items()}
        assert route(router.url, 16) == [200] * 16
        time.sleep(0.3)  # WRITE: the prefill leg may still be in flight
        assert {role: w.num_requests - before[role] for role, w in real.items()} == {"prefill": 16, "decode": 16}
        assert {role: w.num_requests for role, w in forged.items()} == {"P": 0, "D": 0}
        assert listening(router_discovery := registrar.router_port) == {"0100007F"}, router_discovery
        assert listening(registrar.listen_port) == {"0100007F"}
        assert "bad MAC" in "\n".join(process.log_tail(200))
        group = group_members(process.pid)
        assert len(group) == 2  # the registrar and vllm-router
    finally:
        process.stop(time.monotonic() + 15)
        for beat in beats:
            beat.stop()
        for worker in (*real.values(), *forged.values()):
            worker.close()
    assert group_members(process.pid) == [] and process.exit_code() == 0
    assert listening(registrar.listen_port) == set() and listening(registrar.router_port) == set()


def test_the_registrar_exits_with_the_router(tmp_path: Path):
    router = plan(UpOptions(mode="read", model="/m", port=BASE, cores=(0, 1))).router
    process = ManagedProcess(router.process_spec(tmp_path))
    process.start()
    try:
        deadline = time.monotonic() + 30
        while not listening(router.port):  # it answers /health only once instances registered
            assert process.exit_code() is None and time.monotonic() < deadline, process.log_tail()
            time.sleep(0.2)
        (child,) = [pid for pid in group_members(process.pid) if pid != process.pid]
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while process.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.exit_code() == 128 + signal.SIGKILL, process.log_tail()
        assert "the router exited with code -9" in "\n".join(process.log_tail())
    finally:
        process.stop(time.monotonic() + 15)
    assert group_members(process.pid) == []


def test_bad_arguments_and_a_taken_port_are_one_line_each(tmp_path: Path):
    import socket
    import subprocess
    import sys

    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32)

    def run(*args: str) -> tuple[int, list[str]]:
        done = subprocess.run([sys.executable, "-m", "pdserve.registrar", *args, "--", "true"],
                              capture_output=True, text=True, timeout=60)
        return done.returncode, done.stderr.strip().splitlines()

    assert run("--listen", "nohost:1", "--router-port", "2", "--secret-file", str(secret)) == (
        2, ["pdserve registrar: --listen must be IP:PORT, got 'nohost:1'"])
    assert run("--listen", "127.0.0.1:1", "--router-port", "70000", "--secret-file", str(secret)) == (
        2, ["pdserve registrar: --router-port must be 1..65535, got 70000"])
    code, lines = run("--listen", "127.0.0.1:1", "--router-port", "2", "--secret-file", str(tmp_path / "none"))
    assert code == 2 and len(lines) == 1 and "does not exist" in lines[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, lines = run("--listen", f"127.0.0.1:{taken.getsockname()[1]}", "--router-port", "2",
                          "--secret-file", str(secret))
    assert code == 1 and lines[-1].endswith("address already in use") and "Traceback" not in "\n".join(lines)
