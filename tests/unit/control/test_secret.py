import logging
import os
import stat

import pytest

from pdserve.control.secret import SECRET_FILE_ENV, generate_secret_file, load_secret
from pdserve.errors import ConfigError


def test_generate_writes_a_private_hex_secret_that_loads(tmp_path, caplog):
    path = tmp_path / "secret"
    generate_secret_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    secret = load_secret(path)
    assert len(secret) == 64 and bytes.fromhex(secret.decode())
    assert "readable" not in caplog.text
    with pytest.raises(ConfigError, match="already exists"):
        generate_secret_file(path)
    generate_secret_file(path, overwrite=True)
    assert load_secret(path) != secret


def test_env_variable_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "s"
    generate_secret_file(path)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert load_secret() == load_secret(path)
    monkeypatch.delenv(SECRET_FILE_ENV)
    with pytest.raises(ConfigError, match=SECRET_FILE_ENV):
        load_secret()


def test_missing_empty_and_readable_files(tmp_path, caplog):
    with pytest.raises(ConfigError, match="does not exist"):
        load_secret(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ConfigError, match="is empty"):
        load_secret(empty)
    shared = tmp_path / "shared"
    shared.write_text("abc\n")
    shared.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert load_secret(shared) == b"abc"
    assert "readable by group or others" in caplog.text
