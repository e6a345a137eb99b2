"""parse_connector_config: MoRIIO key names, defaults, and loud rejection of anything malformed."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.config import SECRET_FILE_ENV, ConnectorConfig, Role, TransferMode, parse_connector_config
from pdserve.errors import ConfigError

ENV = {SECRET_FILE_ENV: "/run/pdserve/secret"}


def parse(extra=None, role="kv_producer", env=ENV) -> ConnectorConfig:
    return parse_connector_config(role, extra, env=env)


def test_defaults():
    c = parse({})
    assert (c.role, c.mode, c.host_ip, c.handshake_port, c.notify_port) == (
        Role.PRODUCER, TransferMode.WRITE, "127.0.0.1", 6301, 6401)
    assert (c.http_port, c.proxy_ip, c.proxy_ping_port, c.transport) == (None, None, None, "auto")
    assert c.secret_file == "/run/pdserve/secret"
    assert all(x > 0 for x in (c.handshake_timeout, c.transfer_timeout, c.defer_timeout, c.release_grace,
                               c.heartbeat_interval))
    assert c.test_corrupt_transfers is False
    assert parse(None) == c
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.handshake_port = 1


def test_moriio_key_names_are_understood():
    c = parse({"handshake_port": 7301, "notify_port": "7401", "read_mode": True, "host_ip": "10.0.0.5",
               "proxy_ip": "10.0.0.1", "proxy_ping_port": 36367, "http_port": 8100,
               "transfer_timeout": 12, "defer_timeout": "90.5"}, role="kv_consumer")
    assert (c.role, c.mode, c.host_ip, c.handshake_port, c.notify_port) == (
        Role.CONSUMER, TransferMode.READ, "10.0.0.5", 7301, 7401)
    assert (c.proxy_ip, c.proxy_ping_port, c.http_port) == ("10.0.0.1", 36367, 8100)
    assert (c.transfer_timeout, c.defer_timeout) == (12.0, 90.5)
    assert c.engine_id == "10.0.0.5:7301"
    assert c.zmq_address == "host:10.0.0.5,handshake:7301,notify:7401"


@pytest.mark.parametrize("value, mode", [(False, TransferMode.WRITE), ("true", TransferMode.READ),
                                         ("0", TransferMode.WRITE), (1, TransferMode.READ)])
def test_read_mode_accepts_boolean_spellings(value, mode):
    assert parse({"read_mode": value}).mode is mode


def test_secret_file_key_wins_over_the_environment():
    assert parse({"secret_file": "/a"}).secret_file == "/a"
    assert parse({"secret_file": "/a"}, env={}).secret_file == "/a"


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ConfigError, match="handshake_prot"):
        parse({"handshake_prot": 6301})


@pytest.mark.parametrize("env", [{}, {SECRET_FILE_ENV: ""}])
def test_missing_secret_is_rejected(env):
    with pytest.raises(ConfigError, match=SECRET_FILE_ENV):
        parse({}, env=env)


@pytest.mark.parametrize("role", ["kv_both", "", None])
def test_bad_role_is_rejected(role):
    with pytest.raises(ConfigError, match="kv_role"):
        parse({}, role=role)


@pytest.mark.parametrize("key", ["handshake_port", "notify_port", "http_port"])
@pytest.mark.parametrize("value", [-1, 65536, "abc", [1]])
def test_bad_ports_are_rejected_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        parse({key: value})


def test_bad_proxy_port_is_rejected():
    with pytest.raises(ConfigError, match="proxy_ping_port"):
        parse({"proxy_ip": "10.0.0.1", "proxy_ping_port": 99999, "http_port": 8000})


@pytest.mark.parametrize("key", ["transfer_timeout", "defer_timeout", "handshake_timeout", "release_grace",
                                 "heartbeat_interval"])
@pytest.mark.parametrize("value", [0, -1, "inf", "nan", "soon", None])
def test_bad_timeouts_are_rejected_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        parse({key: value})


@pytest.mark.parametrize("extra, words", [
    ({"proxy_ip": "10.0.0.1"}, "together"),
    ({"proxy_ping_port": 36367}, "together"),
    ({"proxy_ip": "10.0.0.1", "proxy_ping_port": 36367}, "http_port"),
    ({"transport": "rdma"}, "rdma"),
    ({"read_mode": "maybe"}, "read_mode"),
    ({"test_corrupt_transfers": 2}, "test_corrupt_transfers"),
])
def test_inconsistent_or_unsupported_settings_are_rejected(extra, words):
    with pytest.raises(ConfigError, match=words):
        parse(extra)


def test_placement_keys_are_parsed_with_the_rest_and_write_only_options_refuse_read_mode():
    read = parse_connector_config("kv_consumer", {"secret_file": "x", "placement": "adaptive", "read_mode": True})
    assert read.placement.adaptive and read.mode.value == "READ"
    with pytest.raises(ConfigError, match="WRITE-mode placement option"):
        parse_connector_config("kv_producer", {"secret_file": "x", "placement": "adaptive", "read_mode": True,
                                               "serve_decode": True})
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config keys: eager_prefill"):
        parse_connector_config("kv_producer", {"secret_file": "x", "placement": "adaptive", "eager_prefill": True})


def test_kv_verify_defaults_to_digest_where_the_kv_moves_from_host_memory():
    assert parse().kv_verify == "digest"
    assert parse({"kv_verify": "off"}).kv_verify == "off"
    staged = parse_connector_config("kv_consumer", {}, env=ENV, kv_device="cuda", vllm_kv_buffer_device="cpu")
    assert staged.kv_verify == "digest"  # host staging: the mirror is hashed
    direct = parse_connector_config("kv_consumer", {}, env=ENV, kv_device="cuda", vllm_kv_buffer_device="cuda")
    assert direct.kv_verify == "off"  # KV moved straight from GPU memory is not hashed


@pytest.mark.parametrize("value", ["crc", "on", True, ""])
def test_bad_kv_verify_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="kv_connector_extra_config.kv_verify must be one of digest, off"):
        parse({"kv_verify": value})


def test_kv_verify_digest_is_refused_for_kv_moved_from_gpu_memory():
    with pytest.raises(ConfigError, match="kv_verify digest hashes KV in host memory"):
        parse_connector_config("kv_consumer", {"kv_verify": "digest"}, env=ENV, kv_device="cuda",
                               vllm_kv_buffer_device="cuda")
