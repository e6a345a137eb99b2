"""Where pdserve keeps what it makes: the work directory that owns models/, .cache/ and runs/.

In order: $PDSERVE_WORK_DIR ($PDSERVE_HOME, its older name); the source checkout the package
runs from (so a clone keeps its models and runs beside the code); the user's cache directory.
Nothing is ever written next to an installed package.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

WORK_DIR_VARIABLES = ("PDSERVE_WORK_DIR", "PDSERVE_HOME")


def work_dir() -> Path:
    """The directory under which models/, .cache/ and runs/ live (not created here)."""
    for variable in WORK_DIR_VARIABLES:
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser().resolve()
    checkout = source_checkout()
    return checkout if checkout is not None else user_cache_dir()


def source_checkout() -> Path | None:
    """The checkout holding this package, when it runs from one (its parent's pyproject.toml names pdserve)."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return root if project.get("name") == "pdserve" else None


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser().resolve() / "pdserve"


