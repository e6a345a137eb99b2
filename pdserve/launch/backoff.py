"""How long the supervisor waits before restarting a process that died: 1 s doubling to 30 s,
back to 1 s once a restarted process has stayed healthy for a minute."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackoffPolicy:
    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 60.0  # healthy this long: the next failure waits initial_s again

    def __post_init__(self) -> None:
        if not (0 < self.initial_s <= self.max_s and self.factor >= 1 and self.reset_after_s >= 0):
            raise ValueError(f"inconsistent backoff policy {self}")


class Backoff:
    """The restart delays of one process. Times are the caller's clock (time.monotonic)."""

    def __init__(self, policy: BackoffPolicy) -> None:
        self.policy = policy
        self._next_s = policy.initial_s
        self._healthy_since: float | None = None

    def healthy(self, now: float) -> None:
        """The process answers its health check (called on every check; the first one counts)."""
        if self._healthy_since is None:
            self._healthy_since = now

    def failed(self, now: float) -> float:
        """The process died (or never became healthy): seconds to wait before the next start."""
        if self._healthy_since is not None and now - self._healthy_since >= self.policy.reset_after_s:
            self._next_s = self.policy.initial_s
        self._healthy_since = None
        delay = self._next_s
        self._next_s = min(self._next_s * self.policy.factor, self.policy.max_s)
        return delay
