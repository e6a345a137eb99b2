"""The session's cache of reference generations and the deployment that computes them."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager


class ReferenceCache(dict):
    """Greedy generations by name, shared across modules, and the one collocated deployment that
    computes the PD tests' references: started on first need, stopped when the session ends."""

    def __init__(self) -> None:
        super().__init__()
        self._stack = contextlib.ExitStack()
        self._server = None

    def server(self, start: Callable[[], ContextManager]):
        """The session's reference deployment: `start()` is entered on the first call only."""
        if self._server is None:
            self._server = self._stack.enter_context(start())
        return self._server

    def close(self) -> None:
        self._server = None
        self._stack.close()
