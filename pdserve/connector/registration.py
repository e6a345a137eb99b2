"""Registration with vllm-router (MoRIIO discovery protocol), once this instance serves HTTP.

Registering before the OpenAI server listens would let the router send requests into a
refused connection, so a thread first waits for our own /health, then heartbeats. A prefill
instance with `serve_decode` registers as a decode instance too (whole_requests.py).
"""

from __future__ import annotations

import logging
import threading
import urllib.request

from pdserve.config import ConnectorConfig, Role
from pdserve.control.registration import RegistrationHeartbeat

logger = logging.getLogger("pdserve.connector")


class RouterRegistration:
    def __init__(self, config: ConnectorConfig):
        self._config = config
        self._stop = threading.Event()
        self._heartbeats: list[RegistrationHeartbeat] = []
        self._thread = threading.Thread(target=self._run, name="pdserve-registration", daemon=True)
        self._thread.start()

    def payloads(self) -> list[dict]:
        c = self._config
        roles = [c.role.value]
        if c.role is Role.PRODUCER and c.placement.serve_decode:
            roles.append(Role.CONSUMER.value)
        return [self.payload(role) for role in roles]

    def payload(self, role: str | None = None) -> dict:
        c = self._config
        return {
            "type": role or c.role.value,
            "http_address": f"{c.host_ip}:{c.http_port}",
            "zmq_address": c.zmq_address,
            "transfer_mode": c.mode.value,
            "tp_size": 1,
            "dp_size": 1,
        }

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
        for payload in self.payloads():
            self._heartbeats.append(RegistrationHeartbeat(
                self._config.proxy_ip, self._config.proxy_ping_port, payload, self._config.heartbeat_interval))
            logger.info("pdserve: registered with router %s:%d as %s", self._config.proxy_ip,
                        self._config.proxy_ping_port, payload)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        for heartbeat in self._heartbeats:
            heartbeat.stop()
