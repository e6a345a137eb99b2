"""Registration with vllm-router (MoRIIO discovery protocol), once this instance serves HTTP.

Registering before the OpenAI server listens would let the router send requests into a
refused connection, so a thread first waits for our own /health, then heartbeats, each beat
signed with the deployment's secret for the registrar in front of the router
(control/registration.py). A prefill instance with `serve_decode` registers as a decode instance
too, from its worker half and only while its `ServeGate` is open (placement/serve_gate.py,
whole_requests.py).
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable

from pdserve.config import ConnectorConfig, Role
from pdserve.control.codec import Codec
from pdserve.control.registration import Registration, RegistrationHeartbeat
from pdserve.control.secret import load_secret
from pdserve.errors import ConfigError

logger = logging.getLogger("pdserve.connector")


class RouterRegistration:
    """Registers this instance as `role` (its own by default); with `when`, a beat is sent only
    while `when()` is true."""

    def __init__(self, config: ConnectorConfig, role: Role | None = None, when: Callable[[], bool] | None = None):
        self._config = config
        self._role = role or config.role
        self._when = when
        self._stop = threading.Event()
        self._heartbeats: list[RegistrationHeartbeat] = []
        self._thread = threading.Thread(target=self._run, name="pdserve-registration", daemon=True)
        self._thread.start()

    def registration(self) -> Registration:
        c = self._config
        return Registration(type=self._role.value, http_address=f"{c.host_ip}:{c.http_port}",
                            zmq_address=c.zmq_address, transfer_mode=c.mode.value)

    def payload(self) -> dict:
        """What the router learns about this instance (through the registrar)."""
        return self.registration().router_map()

    def _run(self) -> None:
        url = f"http://{self._config.host_ip}:{self._config.http_port}/health"
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            self._stop.wait(0.5)
        if self._stop.is_set():
            return
        registration = self.registration()
        identity = f"registration-{registration.type}-{registration.http_address}"
        try:
            codec = Codec(load_secret(self._config.secret_file), identity)
        except ConfigError as e:
            logger.error("pdserve: cannot register with the router: %s", e)
            return
        self._heartbeats.append(RegistrationHeartbeat(self._config.proxy_ip, self._config.proxy_ping_port, registration,
                                                      codec, self._config.heartbeat_interval, self._when))
        logger.info("pdserve: registering with router %s:%d as %s%s", self._config.proxy_ip,
                    self._config.proxy_ping_port, registration.router_map(),
                    " while serving whole requests" if self._when else "")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        for heartbeat in self._heartbeats:
            heartbeat.stop()
