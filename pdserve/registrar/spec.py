"""Where a router's registrar listens, where the router's own discovery socket is, and the argv
that runs both (the registrar process with the router as its child, __main__.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RegistrarSpec:
    """Instances register at `listen_host`:`listen_port`; the router's discovery socket binds
    LOOPBACK:`router_port`; registrations are checked against the secret in `secret_file`."""

    listen_host: str
    listen_port: int
    router_port: int
    secret_file: Path

    def wrap(self, router_argv: Sequence[str]) -> tuple[str, ...]:
        """The argv that runs the registrar with `router_argv` (vllm-router in PD mode, without a
        discovery address: this adds it) as its child."""
        listen = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return (sys.executable, "-m", "pdserve.registrar", "--listen", f"{listen}:{self.listen_port}",
                "--router-port", str(self.router_port), "--secret-file", str(self.secret_file), "--", *router_argv,
                "--vllm-discovery-address", f"{LOOPBACK}:{self.router_port}")
