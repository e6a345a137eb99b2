"""The `bench` extra (`pip install 'pdserve[bench]'`): statistics and plotting packages that only
the bench's report needs, so an instance never imports them. Bench modules import them through
`require`, which turns a missing one into a one-line error saying how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType

from pdserve.errors import PDServeError

INSTALL = "pip install 'pdserve[bench]'"


class MissingExtra(PDServeError):
    """A package of the bench extra is not installed: the environment's fault, not the command line's."""


def require(name: str) -> ModuleType:
    """Import module `name` of the bench extra; MissingExtra naming INSTALL when it is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        package = name.partition(".")[0]
        if exc.name is None or exc.name.partition(".")[0] != package:
            raise  # the package is there, something it imports is not
        raise MissingExtra(f"the bench needs {package}, which is not installed: {INSTALL}") from None
