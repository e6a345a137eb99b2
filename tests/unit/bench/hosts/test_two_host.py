"""The two-host deployment's commands: the same `vllm serve` flags per role as `pdserve up` on one host."""

import json
from pathlib import Path

import pytest

from pdserve.bench.hosts.two_host import CHUNK_TOKENS, NETWORK, TIMEOUTS, TwoHostPD, metric
from pdserve.launch.options import UpOptions
from pdserve.launch.pd_modes import pd_deployment

SECRET = Path("/nonexistent/secret")


def vllm_args(argv: list[str]) -> list[str]:
    return argv[argv.index("--") + 1:]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("budgets,prefix_caching", [((512, 256), False), ((None, 64), True), ((None, None), False)])
def test_each_role_gets_the_flags_and_cores_of_the_same_host_deployment(tmp_path, mode, budgets, prefix_caching):
    options = UpOptions(mode=mode, model="/models/tiny", port=18800, prefix_caching=prefix_caching,
                        prefill_budget=budgets[0], decode_budget=budgets[1], cores=(0, 1))
    same_host = {spec.name: spec for spec in pd_deployment(options, mode).instances}
    pd = TwoHostPD(options=options, connector_extra={}, log_dir=tmp_path)
    assert pd.mode == mode
    for role, budget in zip(("prefill", "decode"), budgets):
        argv = pd.instance_argv(role, SECRET)
        assert vllm_args(argv) == list(same_host[role].vllm_args)
        assert option(argv, "--cores") == ",".join(map(str, same_host[role].cores))
        assert (option(argv, "--mode"), option(argv, "--model"), option(argv, "--role")) == (mode, "/models/tiny", role)
        assert ("--max-num-batched-tokens" in vllm_args(argv)) == (budget is not None)
        assert ("--enforce-eager" in argv) is False and option(argv, "--connector-extra") == "{}"
    prefill = vllm_args(pd.instance_argv("prefill", SECRET))
    assert ("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching") in prefill


def test_without_options_it_is_the_test_harness(tmp_path):
    pd = TwoHostPD("read", transports={"decode": "nixl"}, log_dir=tmp_path)
    argv = pd.instance_argv("decode", SECRET)
    assert option(argv, "--max-num-batched-tokens") == str(CHUNK_TOKENS) and "--enforce-eager" in argv
    assert (option(argv, "--transport"), option(argv, "--mode"), option(argv, "--allowed-peers")) == ("nixl", "read", NETWORK)
    assert (option(argv, "--host-ip"), option(argv, "--router")) == ("10.200.0.2", "10.200.0.1:30002")
    assert json.loads(option(argv, "--connector-extra")) == TIMEOUTS
    assert option(pd.instance_argv("prefill", SECRET), "--transport") == "auto"
    assert pd.url("prefill") == "http://10.200.0.1:30010" and pd.url("decode") == "http://10.200.0.2:30020"
    assert pd.router_url == "http://10.200.0.1:30000"


def test_metric_sums_the_samples_with_the_labels():
    samples = {'pdserve:kv_peers_attached_total{transport="nixl",engine="0"}': 1.0,
               'pdserve:kv_peers_attached_total{transport="nixl",engine="1"}': 2.0,
               'pdserve:kv_peers_attached_total{transport="shm",engine="0"}': 5.0, "other": 7.0}
    assert metric(samples, "pdserve:kv_peers_attached_total", transport="nixl") == 3.0
    assert metric(samples, "pdserve:kv_peers_attached_total") == 8.0
    assert metric(samples, "missing") == 0.0


def test_the_script_still_exports_the_harness():
    from scripts.two_host import TwoHostPD as exported
    from scripts.two_host import metric as exported_metric

    assert exported is TwoHostPD and exported_metric is metric


def test_the_client_names_the_served_model(capsys):
    import argparse
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pdserve.bench.hosts.two_host import add_client_parser, run_client

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "/models/tiny"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        parser = argparse.ArgumentParser()
        add_client_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["client", "model", "--url", f"http://127.0.0.1:{server.server_port}"])
        assert run_client(args) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert capsys.readouterr().out == "/models/tiny\n"
