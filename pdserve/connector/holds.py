"""P's book of KV blocks held for READ-mode transfers, shared with the control-plane thread.

D asks P, after reading, whether P held exactly those blocks for that transfer (ReadDone). The
answer must come from the server thread while the worker thread adds and expires holds, hence
this small locked table; everything else about a transfer stays on the worker thread.
"""

from __future__ import annotations

import threading


class HoldBook:
    def __init__(self) -> None:
        self._holds: dict[str, tuple[int, ...]] = {}
        self._changed = threading.Condition()

    def add(self, transfer_id: str, block_ids: tuple[int, ...]) -> None:
        with self._changed:
            self._holds[transfer_id] = tuple(block_ids)
            self._changed.notify_all()

    def discard(self, transfer_id: str) -> None:
        with self._changed:
            self._holds.pop(transfer_id, None)

    def take(self, transfer_id: str, block_ids: tuple[int, ...], wait_s: float) -> str:
        """Remove the hold if it matches; returns "" on success, else why not. Waits up to
        `wait_s` for a hold that the worker thread has not registered yet."""
        with self._changed:
            self._changed.wait_for(lambda: transfer_id in self._holds, timeout=wait_s)
            held = self._holds.get(transfer_id)
            if held is None:
                return f"no KV is held for transfer {transfer_id} (unknown, expired or already released)"
            if held != tuple(block_ids):
                return f"transfer {transfer_id} holds blocks {list(held)}, not {list(block_ids)}"
            del self._holds[transfer_id]
            return ""
