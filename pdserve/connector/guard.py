"""The process boundary with vLLM: no exception of pdserve's crosses into vLLM's engine loop.

An exception there kills the EngineCore (and with it every request of the instance). A hook
wrapped here logs the failure and returns a safe default instead; transfers keep their
deadlines, so whatever the failure interrupted ends as a failed (recomputed) transfer.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

logger = logging.getLogger("pdserve.connector")


def guarded(default: Callable[[], Any] = lambda: None):
    def wrap(hook):
        @functools.wraps(hook)
        def run(*args, **kwargs):
            try:
                return hook(*args, **kwargs)
            except Exception:  # noqa: BLE001 - the process boundary with vLLM
                logger.exception("pdserve: internal error in %s (answering %r instead)", hook.__name__, default())
                return default()

        return run

    return wrap
