"""The relay from root loopback into a network namespace, against a real namespace (needs root).

A decoy on the same port in the root namespace answers `root`: a relay that connected from the
wrong namespace would reach it instead of the server inside."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from pdserve.bench.hosts.netns_relay import Address, netns_relay
from pdserve.errors import LaunchError

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="needs root and `ip netns`")

# inside the namespace: `echo X` -> X; `stream N` -> N chunks 0.1 s apart; on the client's EOF
# (a half-close) it answers `bye N` with the bytes it received, then closes
SERVER = r"""
import socket, sys, threading, time
def serve(conn):
    received, buffer = 0, b""
    while data := conn.recv(4096):
        received += len(data)
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            word, _, arg = line.decode().partition(" ")
            if word == "echo":
                conn.sendall(arg.encode() + b"\n")
            elif word == "stream":
                for i in range(int(arg)):
                    conn.sendall(b"chunk %d\n" % i)
                    time.sleep(0.1)
    conn.sendall(b"bye %d\n" % received)
    conn.close()
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


@pytest.fixture
def namespace():
    name = f"pdsrelay-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    assert not os.path.exists(f"/run/netns/{name}"), "the test namespace survived"


@pytest.fixture
def decoy():
    """A server on root loopback answering `root`; its port is the inner server's too."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    stop = threading.Event()

    def answer():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.sendall(b"root\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


@pytest.fixture
def inner_server(namespace, decoy):
    server = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c", SERVER, str(decoy)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        yield Address("127.0.0.1", decoy)
    finally:
        server.kill()
        server.wait(10)
        server.stdout.close()


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def read_line(conn: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            break
        line += chunk
    return line


def established_in(namespace: str, port: int) -> str:
    done = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-tnH", "state", "established",
                           f"( sport = :{port} or dport = :{port} )"], capture_output=True, text=True)
    return done.stdout.strip()


def test_bytes_round_trip_stream_and_half_close_through_the_namespace(namespace, inner_server, tmp_path):
    listen = Address("127.0.0.1", free_port())
    with netns_relay(listen, namespace, inner_server, tmp_path / "relay.log") as relay:
        assert relay.url == f"http://127.0.0.1:{listen.port}"
        with socket.create_connection(listen, timeout=10) as conn:
            for word in ("one", "two", "x" * 100_000):  # one at a time: nothing may wait in a buffer
                conn.sendall(f"echo {word}\n".encode())
                assert read_line(conn) == f"{word}\n".encode()
            conn.sendall(b"stream 5\n")
            arrivals = []
            for i in range(5):
                assert read_line(conn) == b"chunk %d\n" % i
                arrivals.append(time.monotonic())
            assert arrivals[-1] - arrivals[0] > 0.3, "the stream arrived in one piece"
            conn.shutdown(socket.SHUT_WR)  # the client is done sending: the answer still comes back
            sent = len("echo one\necho two\n") + len("echo " + "x" * 100_000 + "\n") + len("stream 5\n")
            assert read_line(conn) == f"bye {sent}\n".encode()
            assert conn.recv(10) == b""  # the server closed: so did the relay
        with socket.create_connection(listen, timeout=10) as second:  # and it keeps accepting
            second.sendall(b"echo again\n")
            assert read_line(second) == b"again\n"
        popen = relay.popen
    assert popen.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(popen.pid, 0)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(listen, timeout=5)


def test_stopping_the_relay_closes_open_connections_on_both_sides(namespace, inner_server, tmp_path):
    listen = Address("127.0.0.1", free_port())
    with netns_relay(listen, namespace, inner_server, tmp_path / "relay.log"):
        conn = socket.create_connection(listen, timeout=10)
        conn.sendall(b"echo held\n")
        assert read_line(conn) == b"held\n"
        assert established_in(namespace, inner_server.port), "no upstream connection inside the namespace"
    with conn:
        try:
            rest = conn.recv(100)
        except ConnectionResetError:
            rest = b""
        assert rest == b""
    deadline = time.monotonic() + 5
    while established_in(namespace, inner_server.port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert established_in(namespace, inner_server.port) == "", "an upstream connection outlived the relay"


def test_a_missing_namespace_fails_the_start_and_leaves_nothing(tmp_path):
    listen = Address("127.0.0.1", free_port())
    with pytest.raises(LaunchError, match="did not start"):
        with netns_relay(listen, f"pdsrelay-missing-{secrets.token_hex(3)}", Address("127.0.0.1", 9), tmp_path / "r.log"):
            pytest.fail("the relay started without its namespace")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(listen, timeout=5)


def test_addresses_are_host_and_port():
    assert Address.parse("10.200.0.1:30000") == ("10.200.0.1", 30000)
    assert str(Address("127.0.0.1", 18800)) == "127.0.0.1:18800"
    for bad in ("10.200.0.1", ":80", "host:x", "host:0", "host:70000"):
        with pytest.raises(Exception, match="HOST:PORT"):
            Address.parse(bad)
