"""The fault rig: a fault plan's rules and byte corruption, attached to a worker through
pdserve/rigs.py. `register` is a vLLM general plugin, so every vLLM process offers the rig; it
attaches only to a worker whose config names a fault plan or asks for corrupted transfers."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.config import ConnectorConfig
from pdserve.faults.corrupt import CorruptingTransport
from pdserve.faults.plan import FaultPlan
from pdserve.rigs import Rig, register_rig
from pdserve.transport.base import Transport

RIG_NAME = "faults"


class FaultRig(Rig):
    """Copy rules and corruption on the worker's shared-memory transport, message rules on what it
    sends, kill rules at its named points."""

    def __init__(self, plan: FaultPlan, corrupt: bool):
        self._plan = plan
        self._corrupt = corrupt

    def wrap_transport(self, transport: Transport) -> Transport:
        self._plan.install_copy_hook(transport)
        corruptible = hasattr(transport, "set_copy_hook")  # shared memory, NIXL reads: bytes addressable here
        return CorruptingTransport(transport) if self._corrupt and corruptible else transport

    def outgoing(self, message: object, send: Callable[[object], bool]) -> bool:
        return self._plan.outgoing(message, send)

    def at(self, point: str) -> None:
        self._plan.at(point)


def attach(config: ConnectorConfig) -> FaultRig | None:
    """The rig for `config`, None when it names no fault plan and asks for no corruption."""
    if not (config.test_fault_plan or config.test_corrupt_transfers):
        return None
    return FaultRig(FaultPlan.load(config.test_fault_plan, config.role.value), config.test_corrupt_transfers)


def register() -> None:
    """vLLM general plugin (entry point `pdserve-faults`): offer the fault rig to this process's workers."""
    register_rig(RIG_NAME, attach)
