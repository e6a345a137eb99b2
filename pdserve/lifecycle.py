"""What every child process pdserve starts shares of its life: it ends when its parent does."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """In the child (a `preexec_fn`): get SIGTERM if the launching thread dies, a safety net for a
    parent that is SIGKILLed before it could stop its children (Linux PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
