"""The connector's fixtures hold here too: the engine logs to "pdserve.connector", and a swallowed
internal error there fails the test."""

from tests.unit.connector.conftest import live_process, no_swallowed_internal_errors

__all__ = ["live_process", "no_swallowed_internal_errors"]
