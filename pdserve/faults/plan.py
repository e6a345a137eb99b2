"""A fault plan: rules a test writes to a JSON file, re-read whenever the file changes, so one
running deployment can go through many faults without a restart.

    {"rules": [
      {"action": "drop" | "delay" | "duplicate" | "reorder", "message": "<tag>", "seconds": 3.0},
      {"action": "fail_copy" | "slow_copy" | "stall_copy" | "corrupt_copy", "seconds": 3.0},
      {"action": "kill", "at": "after_layer:1" | "receive:<tag>"}
    ], "generation": 1}

Every rule may carry `"count": N` (apply to the first N matches since the file last changed;
default every match) and `"role": "P" | "D"` (only that side applies it; default both). Message rules act on what this process *sends* (`<tag>` is a wire message tag:
remote_blocks, write_done, release, read_done, read_ack). Copy rules act on this process's
transport: `slow_copy` sleeps on the copy thread after each batch (the queue behind it waits
too), `fail_copy` fails a batch after its bytes landed (the worst case for D: the blocks look
written), `stall_copy` sleeps after a batch was admitted and before its bytes move (a copy that
began before its deadline and is slowed past it; shared-memory and NIXL transports alike),
`corrupt_copy` flips bytes of every batch after they landed (corrupt.py; shared memory copies, and
NIXL reads into host memory: a NIXL write lands in the peer, out of reach): the copy succeeds with
wrong bytes, so a test can show that kv_verify's digest catches them (or, with it off, that the
decode side really computes from them). `kill` SIGKILLs this instance's whole process group at a named point.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pdserve.faults.corrupt import invert_bytes

logger = logging.getLogger("pdserve.faults")

MESSAGE_ACTIONS = ("drop", "delay", "duplicate", "reorder")
COPY_ACTIONS = ("fail_copy", "slow_copy", "stall_copy", "corrupt_copy")
REORDER_S = 0.3
RELOAD_EVERY_S = 0.2


@dataclass
class FaultRule:
    action: str
    message: str = ""
    at: str = ""
    seconds: float = 0.0
    count: int | None = None
    role: str = ""
    used: int = 0

    @classmethod
    def from_json(cls, data: dict) -> FaultRule:
        action = data.get("action")
        if action not in MESSAGE_ACTIONS + COPY_ACTIONS + ("kill",):
            raise ValueError(f"unknown fault action {action!r}")
        return cls(action, str(data.get("message", "")), str(data.get("at", "")), float(data.get("seconds", 0.0)),
                   data.get("count"), str(data.get("role", "")))

    def take(self) -> bool:
        if self.count is not None and self.used >= self.count:
            return False
        self.used += 1
        return True


class FaultPlan:
    """The rules in force. `FaultPlan.load(None)` has none (a rig that only corrupts transfers)."""

    def __init__(self, path: str | None, role: str = ""):
        self._path = path
        self._role = role
        self._rules: list[FaultRule] = []
        self._stamp: tuple | None = None
        self._next_check = 0.0
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | None, role: str = "") -> FaultPlan:
        plan = cls(path, role)
        if path:
            logger.warning("pdserve: FAULT INJECTION enabled from %s (test only)", path)
        return plan

    @property
    def enabled(self) -> bool:
        return bool(self._path)

    def rules(self) -> list[FaultRule]:
        if not self._path:
            return []
        with self._lock:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + RELOAD_EVERY_S
                self._reload()
            return list(self._rules)

    def _reload(self) -> None:
        try:
            stat = os.stat(self._path)
        except OSError:
            self._rules, self._stamp = [], None
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        try:
            with open(self._path) as f:
                data = json.load(f)
            rules = [FaultRule.from_json(r) for r in data.get("rules", [])]
            self._rules = [r for r in rules if r.role in ("", self._role)]
            self._stamp = stamp
            logger.warning("pdserve: fault plan now %s", [(r.action, r.message or r.at) for r in self._rules])
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            logger.error("pdserve: ignoring unreadable fault plan %s: %s", self._path, exc)

    # ---- hooks -----------------------------------------------------------------------------

    def outgoing(self, message, send: Callable[[object], bool]) -> bool:
        """Send `message` through `send`, as the rules for its tag say; never blocks."""
        tag = getattr(type(message), "TAG", "")
        for rule in self.rules():
            if rule.action in MESSAGE_ACTIONS and rule.message == tag and rule.take():
                logger.warning("pdserve: fault: %s %s", rule.action, tag)
                if rule.action == "drop":
                    return True
                if rule.action == "duplicate":
                    return send(message) and send(message)
                delay = rule.seconds if rule.action == "delay" else REORDER_S
                timer = threading.Timer(delay, send, args=(message,))
                timer.daemon = True
                timer.start()
                return True
        return send(message)

    def at(self, point: str) -> None:
        """A named point of the worker: kill here if a rule says so."""
        for rule in self.rules():
            if rule.action == "kill" and rule.at == point and rule.take():
                logger.warning("pdserve: fault: killing this instance at %s", point)
                try:
                    os.killpg(os.getpgid(0), signal.SIGKILL)
                finally:
                    os.kill(os.getpid(), signal.SIGKILL)

    def install_copy_hook(self, transport) -> None:
        """Run copy rules on `transport`'s copy thread: `stall_copy` through its stall hook (every
        copy-thread transport), the others through its copy hook (shared memory; NIXL reads into
        host memory)."""
        if not self._path:
            return
        if hasattr(transport, "set_copy_hook"):
            transport.set_copy_hook(self._on_copy)
        if hasattr(transport, "set_stall_hook"):
            transport.set_stall_hook(self._on_stall)

    def _on_stall(self, direction) -> None:
        for rule in self.rules():
            if rule.action == "stall_copy" and rule.take():
                logger.warning("pdserve: fault: stall_copy %.1f s", rule.seconds)
                time.sleep(rule.seconds)

    def _on_copy(self, direction, ranges) -> None:
        for rule in self.rules():
            if rule.action == "corrupt_copy" and rule.take():
                invert_bytes(ranges)
            elif rule.action in ("fail_copy", "slow_copy") and rule.take():
                logger.warning("pdserve: fault: %s", rule.action)
                if rule.action == "slow_copy":
                    time.sleep(rule.seconds)
                else:
                    raise RuntimeError("injected copy failure")
