"""A NIXL agent with a UCX backend, seen through the few calls the nixl transport makes.

NIXL is an optional dependency (`pdserve[nixl]`, the `nixl-cu12` wheel): `load_bindings()` is the
one place that imports it, and every NIXL exception raised by a call here comes out as a
TransferError naming the call. The agent is built from NIXL's own bindings rather than its Python
wrapper because the wrapper fixes the progress thread's poll delay at 0 µs, which spins a whole
core; on a small CPU host that core is the model's. All calls are serialised by one lock (the
agent is created without NIXL's own thread synchronisation).
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from enum import Enum
from types import ModuleType
from typing import NamedTuple

from pdserve.errors import ConfigError, TransferError
from pdserve.transport.device import MemoryDevice

NIXL_PACKAGE = "nixl-cu12"
BINDING_MODULES = ("nixl_cu12._bindings", "nixl._bindings")
PROGRESS_DELAY_US = 1000  # the progress thread's poll timeout: the target side of a TCP "RMA" waits this long at most


def load_bindings() -> ModuleType:
    """NIXL's native bindings; ConfigError naming the missing package when NIXL is not installed."""
    for name in BINDING_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ConfigError(f"transport nixl needs the {NIXL_PACKAGE} package: pip install 'pdserve[nixl]'")


def nixl_installed() -> bool:
    """Whether NIXL's bindings can be imported here, without importing them."""
    for name in BINDING_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:  # the parent package is missing
            continue
    return False


class NixlMemory(NamedTuple):
    """How NIXL names a region's memory: its segment type and the device id it registers under."""

    segment: str  # "DRAM" (host memory) or "VRAM" (GPU memory)
    device_id: int


DRAM = NixlMemory("DRAM", 0)


def nixl_memory(device: MemoryDevice) -> NixlMemory:
    """Host memory is DRAM under device id 0 (as vLLM's NixlConnector registers it); a GPU's
    memory is VRAM under the GPU's ordinal, which UCX's cuda transports need to reach it."""
    return DRAM if device.is_cpu else NixlMemory("VRAM", device.index)


class XferState(Enum):
    DONE = "DONE"
    IN_PROGRESS = "IN_PROGRESS"
    FAILED = "FAILED"


class NixlAgent:
    """One NIXL agent named `name`, with the UCX backend and DRAM or VRAM registrations."""

    def __init__(self, name: str, progress_delay_us: int = PROGRESS_DELAY_US):
        self._nixl = nixl = load_bindings()
        self._lock = threading.Lock()
        self._registered: list = []
        config = nixl.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False
        config.pthrDelay = progress_delay_us
        config.syncMode = nixl.NIXL_THREAD_SYNC_NONE
        with self._call("create the agent"):
            self._agent = nixl.nixlAgent(name, config)
            if "UCX" not in self._agent.getAvailPlugins():
                raise TransferError("NIXL has no UCX plugin")
            self._agent.createBackend("UCX", {})
        self.name = name

    def _call(self, what: str):
        return _Guard(self._lock, what, self._nixl)

    def register(self, address: int, size: int, memory: NixlMemory = DRAM) -> None:
        with self._call(f"register {size} bytes of {memory.segment} at {address:#x}"):
            descs = self._nixl.nixlRegDList(self._segment(memory.segment), [(address, size, memory.device_id, "")])
            self._status(self._agent.registerMem(descs), "registerMem")
            self._registered.append(descs)

    def metadata(self) -> bytes:
        """What a peer's `add_remote` needs to reach our registered memory."""
        with self._call("read the local metadata"):
            return bytes(self._agent.getLocalMD())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; returns its agent name."""
        with self._call("load a peer's metadata"):
            name = self._agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        with self._call(f"remove peer agent {name}"):
            self._agent.invalidateRemoteMD(name)

    def post(self, write: bool, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
             remote_name: str, local_segment: str = "DRAM", remote_segment: str = "DRAM") -> tuple[int, XferState]:
        """Create and post one transfer of (address, length, device id) triples, each list of one
        segment type ("DRAM" or "VRAM"); returns its request handle and first state. The caller
        must `release` the handle."""
        nixl = self._nixl
        with self._call(f"post a transfer to {remote_name}"):
            local_descs = nixl.nixlXferDList(self._segment(local_segment), local)
            remote_descs = nixl.nixlXferDList(self._segment(remote_segment), remote)
            op = nixl.NIXL_WRITE if write else nixl.NIXL_READ
            request = self._agent.createXferReq(op, local_descs, remote_descs, remote_name, "", [])
            try:
                state = self._state(self._agent.postXferReq(request, ""))
            except BaseException:
                self._agent.releaseXferReq(request)
                raise
        return request, state

    def state(self, request: int) -> XferState:
        with self._call("check a transfer"):
            return self._state(self._agent.getXferStatus(request))

    def release(self, request: int) -> None:
        """Free a request (NIXL aborts it first when it is still in flight)."""
        with self._call("release a transfer"):
            self._agent.releaseXferReq(request)

    def close(self) -> None:
        with self._call("deregister memory"):
            for descs in self._registered:
                self._agent.deregisterMem(descs, [])
            self._registered.clear()

    def _segment(self, name: str):
        if name not in ("DRAM", "VRAM"):
            raise TransferError(f"NIXL memory type {name!r} is neither DRAM nor VRAM")
        return getattr(self._nixl, f"{name}_SEG")

    def _state(self, status) -> XferState:
        if status == self._nixl.NIXL_SUCCESS:
            return XferState.DONE
        if status == self._nixl.NIXL_IN_PROG:
            return XferState.IN_PROGRESS
        return XferState.FAILED

    def _status(self, status, call: str) -> None:
        if status != self._nixl.NIXL_SUCCESS:
            raise TransferError(f"NIXL {call} returned {status}")


class _Guard:
    """Holds the agent lock; turns any NIXL exception into TransferError("NIXL cannot <what>: ...")."""

    def __init__(self, lock: threading.Lock, what: str, nixl: ModuleType):
        self._lock, self._what, self._nixl = lock, what, nixl

    def __enter__(self):
        self._lock.acquire()

    def __exit__(self, exc_type, exc, tb):
        self._lock.release()
        if exc is None or isinstance(exc, TransferError) or not isinstance(exc, Exception):
            return False
        raise TransferError(f"NIXL cannot {self._what}: {type(exc).__name__}: {exc}") from exc
