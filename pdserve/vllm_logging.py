"""pdserve's log lines inside a vLLM process."""

from __future__ import annotations

import logging


def route_logs_to_vllm() -> None:
    """pdserve's modules log to "pdserve.*"; in a vLLM process, print them like vLLM's own."""
    ours, theirs = logging.getLogger("pdserve"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
