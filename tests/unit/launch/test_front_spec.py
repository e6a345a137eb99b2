"""The front as the launcher plans it: its command line says everything its config holds, its URL
is one a client on this host can dial, a bad limit is refused in one line, and behind a router it
knows every instance to fall back on."""

import dataclasses
from pathlib import Path

import pytest

from pdserve.front.__main__ import parse_args
from pdserve.front.config import FrontConfig, Limits, Upstream
from pdserve.launch.front_spec import FrontSpec, direct_sources
from pdserve.launch.instance import InstanceSpec
from pdserve.launch.modes import Deployment, with_front
from pdserve.launch.router import RouterSpec

SPEC = FrontSpec(8000, ("router", "http://127.0.0.1:8010"), (("prefill", "http://127.0.0.1:8001"),
                                                            ("decode", "http://127.0.0.1:8002")),
                 drain_timeout=12.0, host="0.0.0.0", direct_sources=(("decode", "http://127.0.0.1:8002"),),
                 limits=Limits(max_connections=50, head_timeout=3.0, max_body_bytes=1 << 20))


def test_the_command_line_carries_the_whole_config():
    argv = SPEC.process_spec(Path("/run")).argv
    assert argv[1:3] == ("-m", "pdserve.front")
    config = parse_args(list(argv[3:]))
    assert config == FrontConfig("0.0.0.0", 8000, Upstream("router", "127.0.0.1", 8010),
                                 (Upstream("prefill", "127.0.0.1", 8001), Upstream("decode", "127.0.0.1", 8002)),
                                 (Upstream("decode", "127.0.0.1", 8002),), 12.0, SPEC.limits)


@pytest.mark.parametrize("host, url", [("0.0.0.0", "http://127.0.0.1:8000"), ("::", "http://[::1]:8000"),
                                       ("10.1.2.3", "http://10.1.2.3:8000"), ("fe80::1", "http://[fe80::1]:8000"),
                                       ("gateway.local", "http://gateway.local:8000")])
def test_its_url_is_where_a_client_on_this_host_reaches_it(host, url):
    assert dataclasses.replace(SPEC, host=host).url == url


def test_the_decode_instances_answer_whole_requests():
    instances = [InstanceSpec(name, role, port, "/m", (0,)) for name, role, port in
                 (("prefill", "prefill", 1), ("decode0", "decode", 2), ("decode1", "decode", 3), ("vllm", "both", 4))]
    assert direct_sources(instances) == (("decode0", "http://127.0.0.1:2"), ("decode1", "http://127.0.0.1:3"))
    assert direct_sources(instances[3:]) == ()


def test_behind_a_router_the_front_falls_back_on_every_instance_decode_first():
    prefill, decode = (InstanceSpec(role, role, port, "/m", (0,)) for role, port in (("prefill", 18001),
                                                                                    ("decode", 18002)))
    front = with_front(Deployment((prefill, decode), RouterSpec(18000, 18003)), drain_timeout=5).front
    assert front.fallback_sources == (("decode", decode.url), ("prefill", prefill.url))
    config = parse_args(list(front.process_spec(Path("/run")).argv[3:]))
    assert config.fallback_sources == (Upstream("decode", "127.0.0.1", 18002), Upstream("prefill", "127.0.0.1", 18001))
    plain = with_front(Deployment((InstanceSpec("vllm", "both", 18000, "/m", (0,)),)), drain_timeout=5).front
    assert plain.fallback_sources == () and "--fallback-to" not in plain.process_spec(Path("/run")).argv


@pytest.mark.parametrize("flags, message", [
    (["--head-timeout", "0"], "front limit head_timeout must be positive, got 0.0"),
    (["--connection-wait", "9"], "connection_wait (9.0 s) must be shorter than head_timeout (5.0 s)"),
    (["--max-connections", "many"], "argument --max-connections: invalid int value: 'many'"),
    (["--upstream", "router=ftp://x"], "router URL 'ftp://x' is not http://HOST:PORT"),
])
def test_a_bad_flag_is_refused_in_one_line(flags, message, capsys):
    base = ["--port", "8000", "--upstream", "router=http://127.0.0.1:1", "--models-from", "a=http://127.0.0.1:2"]
    with pytest.raises(SystemExit) as exit_:
        parse_args(base + flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err
