"""The per-host commands: what `pdserve instance` and `pdserve router` would run."""

import json

import pytest

from pdserve.errors import ConfigError
from pdserve.launch.per_host import Endpoint, InstanceOptions, RouterOptions, instance_command, router_command


def test_an_instance_binds_its_host_ip_and_registers_at_the_router(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32)
    argv, env = instance_command(InstanceOptions(
        role="decode", router=Endpoint.parse("10.200.0.1:30002", "--router"), host_ip="10.200.0.2",
        model="/models/tiny", secret_file=secret, mode="read", port=30110, allowed_peers=("10.200.0.0/24",),
        cores=(1,), vllm_args=("--enforce-eager",)))
    argv = argv[argv.index("taskset"):]  # after the private /dev/shm wrapper, where the machine has one
    assert argv[:3] == ["taskset", "-c", "1"] and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert argv[argv.index("--host") + 1] == "10.200.0.2" and argv[argv.index("--port") + 1] == "30110"
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert config["kv_role"] == "kv_consumer" and extra["read_mode"] is True
    assert (extra["host_ip"], extra["handshake_port"], extra["notify_port"]) == ("10.200.0.2", 30111, 30112)
    assert (extra["proxy_ip"], extra["proxy_ping_port"], extra["transport"]) == ("10.200.0.1", 30002, "auto")
    assert extra["allowed_peers"] == ["10.200.0.0/24"] and extra["secret_file"] == str(secret)


def test_the_router_runs_pd_mode_behind_a_registrar_on_its_host_ip(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32)
    argv = router_command(RouterOptions("10.200.0.1", 30000, secret_file=secret))
    registrar, router = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert registrar[1:3] == ["-m", "pdserve.registrar"]
    assert (option(registrar, "--listen"), option(registrar, "--secret-file")) == ("10.200.0.1:30002", str(secret))
    assert option(registrar, "--router-port") == "30003"
    assert option(router, "--host") == "10.200.0.1" and "--vllm-pd-disaggregation" in router
    assert option(router, "--vllm-discovery-address") == "127.0.0.1:30003"  # only the registrar reaches it


def test_the_router_takes_the_secret_from_the_environment_or_refuses_to_start(tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_bytes(b"k" * 32)
    monkeypatch.setenv("PDSERVE_SECRET_FILE", str(secret))
    argv = router_command(RouterOptions("10.0.0.1", 9000, discovery_port=9100))
    assert (option(argv, "--listen"), option(argv, "--router-port"), option(argv, "--secret-file")) == (
        "10.0.0.1:9100", "9101", str(secret))
    with pytest.raises(ConfigError, match="does not exist"):
        RouterOptions("10.0.0.1", secret_file=tmp_path / "none")
    for clash in ({"port": 9001, "discovery_port": 9000}, {"port": 9000, "discovery_port": 65535}):
        with pytest.raises(ConfigError, match="--discovery-port: the router's own discovery socket"):
            RouterOptions("10.0.0.1", **clash)
    monkeypatch.delenv("PDSERVE_SECRET_FILE")
    with pytest.raises(ConfigError, match=r"needs the deployment's secret: set \$PDSERVE_SECRET_FILE"):
        RouterOptions("10.0.0.1")


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("text", ["10.0.0.1", "host:80", "10.0.0.1:0", "10.0.0.1:x"])
def test_a_malformed_router_address_is_refused(text):
    with pytest.raises(ConfigError, match="IP:PORT"):
        Endpoint.parse(text, "--router")


def test_a_missing_secret_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="secret-file"):
        InstanceOptions(role="prefill", router=Endpoint("10.0.0.1", 1), host_ip="10.0.0.2", model="m",
                        secret_file=tmp_path / "none")
