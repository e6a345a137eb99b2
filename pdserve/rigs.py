"""The one point where a test rig attaches to an instance's worker.

A rig package (pdserve/faults) registers a factory here, from a vLLM general plugin; the worker
calls `attach_rig(config)` once at start and routes three things through the rig it gets: its
transport backends, every control message it sends, and a few named points of its work. A
factory returns None unless `config` asks for its rig, so a deployment gets `Rig()`, which changes
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.errors import ConfigError

if TYPE_CHECKING:
    from pdserve.config import ConnectorConfig
    from pdserve.transport.base import Transport


class Rig:
    """What a rig may do to one worker. The worker calls these from its own threads; each default
    leaves the worker's behaviour as it is."""

    def wrap_transport(self, transport: Transport) -> Transport:
        """Once per transport backend, before the worker first uses it (shared memory at start,
        NIXL when it starts): returns the transport the worker uses instead."""
        return transport

    def outgoing(self, message: object, send: Callable[[object], bool]) -> bool:
        """For every control message the worker sends a peer: `send(message)` sends it and says
        whether it went; the rig may drop, delay or repeat it. Must not block."""
        return send(message)

    def at(self, point: str) -> None:
        """At a named point of the worker: `receive:<tag>` before it handles a message with that
        wire tag, `after_layer:<index>` after it queued the sends of a KV layer."""


RigFactory = Callable[["ConnectorConfig"], "Rig | None"]

_factories: dict[str, RigFactory] = {}


def register_rig(name: str, factory: RigFactory) -> None:
    """Offer a rig to every worker this process starts; registering a name again replaces it."""
    _factories[name] = factory


def unregister_rig(name: str) -> None:
    _factories.pop(name, None)


def attach_rig(config: ConnectorConfig) -> Rig:
    """The rig that `config` asks for, or `Rig()` when none does; ConfigError when two do."""
    rigs = {name: rig for name, factory in _factories.items() if (rig := factory(config)) is not None}
    if len(rigs) > 1:
        raise ConfigError(f"more than one test rig attaches to this worker: {', '.join(sorted(rigs))}")
    return next(iter(rigs.values()), Rig())
