"""The control-plane secret: a file shared by every process of a deployment (HMAC key)."""

from __future__ import annotations

import logging
import os
import secrets
import stat

from pdserve.errors import ConfigError

logger = logging.getLogger(__name__)

SECRET_FILE_ENV = "PDSERVE_SECRET_FILE"


def load_secret(path: str | os.PathLike | None = None) -> bytes:
    """The secret in `path`, or in the file named by $PDSERVE_SECRET_FILE when `path` is None.

    The file must exist and hold a non-empty secret (surrounding whitespace is ignored); a file
    readable by group or others is accepted with a warning.
    """
    if path is None:
        path = os.environ.get(SECRET_FILE_ENV)
        if not path:
            raise ConfigError(f"no control-plane secret: give a secret file or set ${SECRET_FILE_ENV}")
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as f:
            secret = f.read().strip()
    except FileNotFoundError:
        raise ConfigError(f"secret file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read secret file {path}: {e}") from e
    if not secret:
        raise ConfigError(f"secret file {path} is empty")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("secret file %s is readable by group or others (mode %o); chmod 600 it", path, mode & 0o777)
    return secret


def generate_secret_file(path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write 32 random bytes, hex-encoded, to `path` with mode 0600."""
    path = os.fspath(path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"secret file {path} already exists") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(secrets.token_hex(32) + "\n")
