"""Port checks before a launch and after its stop."""

from __future__ import annotations

import socket

from pdserve.errors import LaunchError


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind host:port now (SO_REUSEADDR, as servers do: TIME_WAIT is fine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def require_free(ports: tuple[int, ...]) -> None:
    taken = [p for p in ports if not port_free(p)]
    if taken:
        raise LaunchError(f"port {', '.join(map(str, taken))} already in use on 127.0.0.1 (choose another --port)")
