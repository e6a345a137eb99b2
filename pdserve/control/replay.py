"""The nonces a codec has accepted recently, so that a captured frame cannot be played again.

A frame is accepted only while its timestamp is inside the skew window, so a nonce needs to be
remembered only until its timestamp leaves that window; after that the frame is refused as
stale anyway. The cache never forgets a nonce earlier than that: when it is full of nonces still
inside the window it refuses new frames instead (an attacker who holds the secret could
otherwise flood it to make room for a replay). Nor does it trust the clock to move forward: a
frame no newer than the newest nonce it has forgotten is refused, so a wall clock stepped back
cannot reopen the window for a forgotten nonce.
"""

from __future__ import annotations

import heapq

from pdserve.errors import AuthenticationError


class ReplayCache:
    """Not thread-safe: the codec calls `admit` under its lock."""

    def __init__(self, max_nonces: int):
        if max_nonces <= 0:
            raise ValueError(f"max_nonces must be positive, got {max_nonces}")
        self.max_nonces = max_nonces
        self._seen: set[bytes] = set()
        self._by_ts: list[tuple[float, bytes]] = []  # min-heap: the nonce to forget next on top
        self._forgotten_up_to = float("-inf")  # the newest timestamp of a forgotten nonce

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: bytes, ts: float, window_start: float) -> None:
        """Record `nonce` (of a frame sent at `ts`); forget nonces sent before `window_start`.

        Raises AuthenticationError for a nonce already seen, or when every remembered nonce is
        still inside the window and the cache is full.
        """
        while self._by_ts and self._by_ts[0][0] < window_start:
            old_ts, old = heapq.heappop(self._by_ts)
            self._seen.discard(old)
            self._forgotten_up_to = max(self._forgotten_up_to, old_ts)
        if ts <= self._forgotten_up_to:
            raise AuthenticationError("stale message: older than every nonce the replay cache still remembers")
        if nonce in self._seen:
            raise AuthenticationError(f"replayed message: nonce {nonce.hex()} already seen")
        if len(self._seen) >= self.max_nonces:
            raise AuthenticationError(
                f"replay cache full: {len(self._seen)} nonces still inside the skew window; message refused"
            )
        self._seen.add(nonce)
        heapq.heappush(self._by_ts, (ts, nonce))
