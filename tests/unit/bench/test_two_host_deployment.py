"""`write-two-host` / `read-two-host`: accepted, budgeted and tuned like write/read, refused clearly
where they cannot run, and deployed as TwoHostPD behind a relay (both faked here)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from pdserve.bench import cli, two_host_deployment
from pdserve.bench.budget import TWO_HOST_CONFIGS, Budget
from pdserve.bench.deployment import DeploymentRequest, Endpoint, check_available
from pdserve.bench.launcher_deployer import LauncherDeployer
from pdserve.errors import ConfigError, LaunchError
from tests.unit.bench import synthetic


def parse(*argv):
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def test_the_configuration_names_are_accepted_and_tuned_like_their_one_host_twins():
    assert TWO_HOST_CONFIGS == ("write-two-host", "read-two-host")
    synthetic.plan(configs=("write", "write-two-host", "read", "read-two-host"),
                   candidates=(("write-two-host", ("default", "512/256")),))
    plan = cli.build_plan(parse("--configs", "write,write-two-host,read,read-two-host"))
    for twin in ("write", "read"):
        assert plan.budgets(f"{twin}-two-host") == plan.budgets(twin) != ()
    tuned = cli.build_plan(parse("--configs", "write,write-two-host", "--tune", "write=default,256"))
    assert tuned.budgets("write-two-host") == (Budget(), Budget(256))
    untuned = cli.build_plan(parse("--configs", "write,write-two-host", "--tune", "write-two-host="))
    assert untuned.budgets("write-two-host") == () and untuned.budgets("write") != ()
    assert "write-two-host" not in dict(cli.build_plan(parse()).candidates)  # the preset's own plan is unchanged
    with pytest.raises(ConfigError, match="unknown configurations"):
        synthetic.plan(configs=("collocated-two-host",))


@pytest.mark.parametrize("twin", ["write", "read"])
def test_budgets_go_to_each_role_exactly_as_on_one_host(tmp_path, twin):
    budget = Budget.parse("512/256")
    budget.check(f"{twin}-two-host")
    two = DeploymentRequest(f"{twin}-two-host", tmp_path, tmp_path / "logs", budget, prefix_caching=True)
    one = DeploymentRequest(twin, tmp_path, tmp_path / "logs", budget, prefix_caching=True)
    assert two.two_host and not one.two_host and two.mode == twin
    assert two.role_budgets == (512, 256) and two.extra_vllm_args == ()
    options = two.up_options(18800, 600.0)
    assert options == one.up_options(18800, 600.0)
    assert (options.mode, options.prefill_budget, options.decode_budget, options.prefix_caching) == (twin, 512, 256, True)
    assert options.budget_args("decode") == ("--max-num-batched-tokens", "256")


def test_unavailable_says_why_before_anything_starts(monkeypatch):
    deployer = LauncherDeployer()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in deployer.unavailable("write-two-host")
    with pytest.raises(ConfigError, match="read-two-host: needs root"):
        check_available(deployer, ("write", "read-two-host"))
    assert deployer.unavailable("write") is None
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "ip" else f"/usr/bin/{tool}")
    assert "`ip` command (iproute2)" in deployer.unavailable("read-two-host")
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    failed = subprocess.CompletedProcess(["ip"], 1, "", 'Object "netns" is unknown, try "ip help".')
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
    assert deployer.unavailable("write-two-host") == '`ip netns` does not work here: Object "netns" is unknown, try "ip help".'


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and `ip netns`")
def test_available_as_root_with_ip_netns():
    assert LauncherDeployer().unavailable("write-two-host") is None


class FakeHosts:
    namespaces = {"a": "pdsa-test", "b": "pdsb-test"}

    def ip(self, host):
        return {"a": "10.200.0.1", "b": "10.200.0.2"}[host]


class FakeTwoHostPD:
    """Records how it was made; changes SIGTERM on entry as TwoHosts does."""

    made: list = []

    def __init__(self, options, log_dir, connector_extra, served="/elsewhere"):
        self.options, self.log_dir, self.connector_extra = options, log_dir, connector_extra
        self.hosts = FakeHosts()
        self.served = served
        self.closed = False
        FakeTwoHostPD.made.append(self)

    def __enter__(self):
        self.saved = signal.signal(signal.SIGTERM, lambda *a: None)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self.saved)
        self.closed = True

    def url(self, role):
        return "http://10.200.0.1:30010"

    def served_model(self, role):
        return self.served

    def metrics(self, role):
        return {'pdserve:kv_peers_attached_total{transport="nixl"}': 1.0, "pdserve:kv_transfers_completed_total": 9.0}


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    import pdserve.bench.hosts.netns_relay as relay_module
    import pdserve.bench.hosts.two_host as two_host_module

    relays = []

    @contextlib.contextmanager
    def fake_relay(listen, netns, target, log):
        relays.append({"listen": listen, "netns": netns, "target": target, "log": log, "open": True})
        try:
            yield relay_module.RelayProcess(listen, netns, target, None)
        finally:
            relays[-1]["open"] = False

    FakeTwoHostPD.made = []
    monkeypatch.setattr(two_host_module, "TwoHostPD", FakeTwoHostPD)
    monkeypatch.setattr(relay_module, "netns_relay", fake_relay)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    return relays, model_dir


def test_the_deployment_is_two_host_pd_behind_a_relay_on_the_bench_port(fakes, tmp_path, monkeypatch):
    relays, model_dir = fakes
    monkeypatch.setattr(FakeTwoHostPD, "served_model", lambda self, role: str(model_dir.resolve()))
    bench_handler = lambda *a: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, bench_handler)
    request = DeploymentRequest("read-two-host", model_dir, tmp_path / "logs", Budget(512, 256))
    (tmp_path / "logs").mkdir()
    try:
        with LauncherDeployer(port=18850, startup_timeout_s=300.0).up(request) as endpoint:
            assert endpoint == Endpoint("http://127.0.0.1:18850", str(model_dir.resolve()))
            assert signal.getsignal(signal.SIGTERM) is bench_handler  # Ctrl-C-like unwinding, as elsewhere
            assert relays[0]["open"]
    finally:
        signal.signal(signal.SIGTERM, previous)
    (pd,) = FakeTwoHostPD.made
    assert pd.options == request.up_options(18850, 300.0) and pd.connector_extra == {} and pd.closed
    assert (pd.options.mode, pd.options.prefill_budget, pd.options.decode_budget) == ("read", 512, 256)
    assert relays == [{"listen": ("127.0.0.1", 18850), "netns": "pdsa-test", "target": ("10.200.0.1", 30000),
                       "log": tmp_path / "logs" / "relay.log", "open": False}]
    counts = json.loads((tmp_path / "logs" / "transfers.json").read_text())
    assert counts["prefill"]["attached_nixl"] == 1.0 and counts["decode"]["completed"] == 9.0


def test_another_model_on_the_deployment_is_refused_and_everything_stops(fakes, tmp_path):
    relays, model_dir = fakes
    request = DeploymentRequest("write-two-host", model_dir, tmp_path / "logs")
    with pytest.raises(LaunchError, match="serves '/elsewhere'"):
        with two_host_deployment.two_host_deployment(request, 18850, 300.0):
            pytest.fail("yielded a deployment serving another model")
    assert FakeTwoHostPD.made[0].closed and relays[0]["open"] is False
    assert not (tmp_path / "logs" / "transfers.json").exists()


def test_the_same_host_configurations_do_not_take_the_two_host_path(monkeypatch, tmp_path):
    from pdserve import launch

    def up(options):
        raise LaunchError(f"launch.up({options.mode})")

    monkeypatch.setattr(launch, "up", up)
    with pytest.raises(LaunchError, match=r"launch.up\(write\)"):
        with LauncherDeployer().up(DeploymentRequest("write", Path("."), tmp_path)):
            pass
