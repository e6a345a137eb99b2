"""Where pdserve keeps what it makes: the project root that owns .cache/, models/ and runs/."""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """The directory holding the checkout (or $PDSERVE_HOME): owner of .cache/, models/, runs/."""
    home = os.environ.get("PDSERVE_HOME")
    return Path(home).resolve() if home else Path(__file__).resolve().parents[1]
