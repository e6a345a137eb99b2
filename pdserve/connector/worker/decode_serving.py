"""`DecodeServing`: P with `serve_decode` registers at the router as a decode instance too, while
D's streams are loaded (the gate is placement/serve_gate.py)."""

from __future__ import annotations

from pdserve.config import ConnectorConfig, Role
from pdserve.connector.registration import RouterRegistration
from pdserve.placement import DecodeStatus, PrefillLoad, ServeGate


class DecodeServing:
    def __init__(self, config: ConnectorConfig):
        self._config = config
        self._gate = ServeGate(config.placement.stream_itl_s)
        self._registration: RouterRegistration | None = None
        self._reported: bool | None = None

    @classmethod
    def for_config(cls, config: ConnectorConfig) -> DecodeServing | None:
        """One for a P configured to serve decode, else None."""
        return cls(config) if config.role is Role.PRODUCER and config.placement.serve_decode else None

    def start(self) -> None:
        if self._config.proxy_ip:
            self._registration = RouterRegistration(self._config, Role.CONSUMER, self._gate.is_open)

    def on_status(self, status: DecodeStatus) -> None:
        """Control-plane thread: a decode instance reported its streams."""
        self._gate.on_status(status)

    def on_own_load(self, load: PrefillLoad) -> None:
        self._gate.on_own_load(load)

    def take_change(self) -> list[int]:
        """[1] or [0] when the gate opened or closed since last asked, else []."""
        if self._gate.open == self._reported:
            return []
        self._reported = self._gate.open
        return [int(self._reported)]

    def stop(self) -> None:
        if self._registration is not None:
            self._registration.stop()
            self._registration = None
