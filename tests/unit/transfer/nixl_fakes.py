"""A NixlTransport on a stand-in agent whose requests run until the test ends them, for the
two-engine harness: the engine sees the real transport's handles; no UCX, no NIXL package.

Both sides live in this process, so a request really moves its bytes (one memmove per copy) at
the moment the test ends it, and a test can tell what landed before and after."""

from __future__ import annotations

import ctypes

from pdserve.transport.nixl import NixlTransport
from pdserve.transport.nixl_agent import XferState


class CopyingAgent:
    """A NIXL agent whose posted requests stay IN_PROGRESS until `end_all`, which copies their
    bytes; releasing a request still running is an error (NIXL would let it run on)."""

    def __init__(self):
        self.requests: dict[int, tuple[bool, list, list]] = {}
        self.state_of: dict[int, XferState] = {}

    def register(self, address, size, memory):
        pass

    def metadata(self) -> bytes:
        return b""

    def add_remote(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote(self, name):
        pass

    def post(self, write, local, remote, remote_name, local_segment="DRAM", remote_segment="DRAM"):
        request = len(self.requests) + 1
        self.requests[request] = (write, local, remote)
        self.state_of[request] = XferState.IN_PROGRESS
        return request, XferState.IN_PROGRESS

    def state(self, request):
        return self.state_of[request]

    def running(self) -> list[int]:
        return [r for r, state in self.state_of.items() if state is XferState.IN_PROGRESS]

    def end_all(self) -> None:
        """Land every running request's bytes, then report it complete."""
        for request in self.running():
            write, local, remote = self.requests[request]
            for (local_address, length, _), (remote_address, _, _) in zip(local, remote):
                destination, source = (remote_address, local_address) if write else (local_address, remote_address)
                ctypes.memmove(destination, source, length)
            self.state_of[request] = XferState.DONE

    def release(self, request):
        assert self.state_of[request] is not XferState.IN_PROGRESS, "a running NIXL request was released"

    def close(self):
        pass


class SlowNixl(NixlTransport):
    """A NixlTransport on a CopyingAgent; a peer's agent is named like its identity (the harness
    hands no NIXL metadata in its handshake)."""

    def __init__(self, name: str):
        self.agent = CopyingAgent()
        self.stuck: list[str] = []
        super().__init__(name, name=name, agent=self.agent, on_stuck_copy=self.stuck.append)

    def attach_peer(self, peer_id, descriptors, endpoint=None) -> None:
        super().attach_peer(peer_id, descriptors, endpoint or peer_id.encode())
