"""A TCP relay from the root network namespace into a named one, as its own process.

    python -m pdserve.bench.hosts.netns_relay --listen 127.0.0.1:18800 --netns pdsa-1a2b3c --target 10.200.0.1:30000

A deployment across network namespaces (netns.py) listens only inside them, while a client such as
the bench's runs in the root namespace. The relay binds and listens in the root namespace first,
then enters the target namespace (setns), so every connection it accepts is a root-namespace
socket and every connect() it makes is made inside the target. Each accepted connection gets one
upstream connection and two pump threads; an EOF is passed on as a half-close, and both sockets
are closed once both directions ended or either failed. TCP_NODELAY on both sides: a streamed
token is forwarded as it arrives. SIGTERM (or SIGINT) closes the listener and every connection and
exits 0; the relay also gets SIGTERM when the process that started it dies (PR_SET_PDEATHSIG).

In the parent, `with netns_relay(listen, netns, target, log) as relay:` starts it, waits until it
listens (a deadline), and stops it on exit (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, NamedTuple

from pdserve.errors import ConfigError, LaunchError

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
READY = b"listening\n"
BUFFER_BYTES = 1 << 16
CONNECT_TIMEOUT_S = 10.0
START_DEADLINE_S = 10.0
STOP_DEADLINE_S = 5.0


class Address(NamedTuple):
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{text!r} is not HOST:PORT")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def enter_netns(name: str) -> None:
    """Move this thread (call it before starting any) into network namespace `name` (/run/netns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class Connection:
    """One accepted client socket and its upstream socket inside the target namespace."""

    def __init__(self, client: socket.socket, upstream: socket.socket, on_close) -> None:
        self.sockets = (client, upstream)
        self._on_close = on_close
        self._lock = threading.Lock()
        self._open_directions = 2
        self._closed = False

    def pump(self, source: socket.socket, sink: socket.socket) -> None:
        """Copy one direction until EOF (passed on as a half-close) or an error (ends both)."""
        try:
            while data := source.recv(BUFFER_BYTES):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            self.close()
            return
        with self._lock:
            self._open_directions -= 1
            done = self._open_directions == 0
        if done:
            self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the other pump thread's recv
            sock.close()
        self._on_close(self)


class Relay:
    """Accepts on `listener` (already bound, in the root namespace) and connects to `target`
    from the namespace this process is in."""

    def __init__(self, listener: socket.socket, target: Address) -> None:
        self.listener = listener
        self.target = target
        self._connections: set[Connection] = set()
        self._lock = threading.Lock()

    def serve_forever(self) -> None:
        while True:
            client, peer = self.listener.accept()
            threading.Thread(target=self._open, args=(client, peer), daemon=True).start()

    def _open(self, client: socket.socket, peer) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            logger.warning("relay: %s -> %s failed: %s", peer, self.target, exc)
            client.close()
            return
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = Connection(client, upstream, self._forget)
        with self._lock:
            self._connections.add(connection)
        threading.Thread(target=connection.pump, args=(upstream, client), daemon=True).start()
        connection.pump(client, upstream)

    def _forget(self, connection: Connection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.close()


def serve(listen: Address, netns: str, target: Address) -> int:
    """The relay process: listen here, enter `netns`, say READY on stdout, relay until SIGTERM."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_cleanly)
    listener = socket.create_server(tuple(listen), backlog=256)
    relay = Relay(listener, target)
    try:
        enter_netns(netns)
        os.write(sys.stdout.fileno(), READY)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the parent stopped reading
        relay.serve_forever()
    except SystemExit:
        return 0
    finally:
        relay.close()


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


# ---- in the parent ------------------------------------------------------------------------------

class RelayProcess(NamedTuple):
    listen: Address
    netns: str
    target: Address
    popen: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://{self.listen}"


@contextlib.contextmanager
def netns_relay(listen: Address, netns: str, target: Address, log: Path,
                deadline_s: float = START_DEADLINE_S) -> Iterator[RelayProcess]:
    """A relay process from `listen` (root namespace) to `target` inside `netns`, its stderr in
    `log`; yields once it listens (LaunchError if it does not within `deadline_s`), stopped on exit."""
    argv = [sys.executable, "-m", "pdserve.bench.hosts.netns_relay", "--listen", str(listen), "--netns", netns,
            "--target", str(target)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as err:
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                 start_new_session=True)
    try:
        _wait_ready(popen, deadline_s, log)
        yield RelayProcess(listen, netns, target, popen)
    finally:
        stop(popen)


def _wait_ready(popen: subprocess.Popen, deadline_s: float, log: Path) -> None:
    deadline = time.monotonic() + deadline_s
    received = b""
    with popen.stdout, selectors.DefaultSelector() as selector:
        selector.register(popen.stdout, selectors.EVENT_READ)
        while not received.endswith(b"\n") and (left := deadline - time.monotonic()) > 0:
            if selector.select(left):
                chunk = os.read(popen.stdout.fileno(), 256)
                if not chunk:
                    break
                received += chunk
    if received != READY:
        stop(popen)
        tail = log.read_text(errors="replace")[-1500:].strip()
        raise LaunchError(f"netns relay {' '.join(popen.args[3:])} did not start within {deadline_s:g} s "
                          f"(exit code {popen.returncode}): {tail or 'no output'}")


def stop(popen: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after STOP_DEADLINE_S; returns once the process is gone."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            logger.warning("netns relay %s ignored SIGTERM for %g s: killed", popen.pid, STOP_DEADLINE_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(STOP_DEADLINE_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, type=Address.parse, help="HOST:PORT in the root namespace")
    parser.add_argument("--netns", required=True, help="the target network namespace (a name under /run/netns)")
    parser.add_argument("--target", required=True, type=Address.parse, help="HOST:PORT inside the namespace")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    return serve(args.listen, args.netns, args.target)


if __name__ == "__main__":
    raise SystemExit(main())
