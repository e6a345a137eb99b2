"""A stand-in for vllm.v1.request.RequestStatus (the scheduler half only reads `.name`), so
these tests run without importing vLLM."""

import enum


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
